"""Exit codes, streams and hints that are right (issue 32, class 4).

* every numeric option of every command refuses NaN, the infinities and values out of its
  range before any work: the table is generated from the click commands themselves, and an
  option that is neither numeric nor listed as not numeric fails the test, so a new option is
  classified (and then covered) when it is added;
* a corrupt model is a user mistake (exit 2) for every command, ``bench`` included, and
  ``ONNX_CONV2MATMUL_DEBUG=1`` changes what is printed, never the exit code;
* no hint names a flag that the same invocation refuses;
* closed or vanishing stdout and stderr change neither the result nor the exit code, and
  nothing but the JSON reaches stdout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import onnx
import pytest
from click.testing import CliRunner

from helpers import no_bench, stack_model
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.cli.common import HINTS, hint_text, refused_flags
from onnx_conv2matmul.errors import Hint
from processes import TIMEOUT, console_code

COMMANDS: dict[str, click.Command] = {"(main)": main, **main.commands}  # type: ignore[attr-defined]

# Options that take no number: paths, names, patterns, choices, sizes and lists checked below.
NOT_NUMERIC = {
    "--check", "--manifest", "--report-json", "--config", "--save-config", "--inputs", "--validate",
    "--verify-signal-input-name", "--verify-length-input-name", "--exclude", "--include",
    "--layout", "--quantization", "--algorithm", "--bits", "--other-weights", "--bench", "--prefer",
    "--criterion",
}  # fmt: skip
# Options of text type that carry numbers: bad values for each (None: the numeric types' own).
TEXT_NUMERIC = {
    "--verify-lengths": ["nan", "inf", "0", "-3", "1e3", "16,nan"],
    "--bench-lengths": ["nan", "inf", "0", "-3", "16,inf"],
    "--verify-memory": ["nan", "inf", "-inf", "1e999", "0", "-1MiB"],
    "--max-drop": ["nan", "inf", "-inf", "-0.1", "nan%", "inf%", "1e999"],
    "--verify-input": ["x=nan", "x=inf", "x=-inf", "x=1e999"],
    "--verify-dim": ["N=nan", "N=inf", "N=0", "N=-1"],
    "--bits-for": ["*=nan", "*=inf", "*=3", "*=-4"],
    "--block-size": ["nan", "inf", "0", "-64", "48"],
}
NON_FINITE = ["nan", "inf", "-inf", "1e999", "NaN", "+inf"]
# What an option needs beside it to be read at all.
COMPANIONS = {
    "--max-drop": ["--validate", "json:loads"],
    "--max-evaluations": ["--auto"],
    "--bench-rounds": [],
    "--max-dilation": [],
}


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.is_flag]


def _numeric(option: click.Option) -> bool:
    return isinstance(option.type, click.types._NumberParamTypeBase)


def _bad_values(option: click.Option) -> list[str]:
    flag = option.opts[0]
    if flag in TEXT_NUMERIC:
        return TEXT_NUMERIC[flag]
    values = list(NON_FINITE)
    kind = option.type
    if isinstance(kind, click.types._NumberRangeBase):
        if kind.min is not None:
            values.append(str(kind.min - 1))
        if kind.max is not None:
            values.append(str(kind.max + 1))
    return values


def test_every_option_is_classified() -> None:
    """A new option must be numeric (and so tested below) or named as not numeric."""
    unclassified = sorted(
        {
            o.opts[0]
            for c in COMMANDS.values()
            for o in _options(c)
            if not _numeric(o) and o.opts[0] not in NOT_NUMERIC | set(TEXT_NUMERIC)
        }
    )
    assert unclassified == []


CASES = sorted(
    {
        (name, o.opts[0], value)
        for name, c in COMMANDS.items()
        for o in _options(c)
        if _numeric(o) or o.opts[0] in TEXT_NUMERIC
        for value in _bad_values(o)
    }
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "m.onnx"
    onnx.save(stack_model(layers=2, channels=64), path)
    return path


def _args(command: str, model: Path, tmp: Path) -> list[str]:
    out = str(tmp / "o.onnx")
    return {
        "(main)": [str(model), out],
        "convert": ["convert", str(model), out, "--verify"],
        "quantize": ["quantize", str(model), out],
        "verify": ["verify", str(model), str(model)],
        "bench": ["bench", str(model)],
        "inspect": ["inspect", str(model)],
        "bundle": ["bundle", str(Path(__file__).parent / "data" / "parakeet_small"), str(tmp / "b")],
    }[command]


@pytest.mark.parametrize(("command", "flag", "value"), CASES)
def test_numeric_options_refuse_bad_values_before_any_work(
    model: Path, tmp_path: Path, command: str, flag: str, value: str
) -> None:
    args = [*_args(command, model, tmp_path), *COMPANIONS.get(flag, []), f"{flag}={value}"]
    result = CliRunner().invoke(main, no_bench(args))
    assert result.exit_code == 2, (args, result.output)
    named = (flag, flag.lstrip("-"), flag.lstrip("-").replace("-", " "))  # "block size" from the library
    assert any(name in result.output for name in named), result.output
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "b").exists()


# --- exit codes --------------------------------------------------------------------------------


def _corrupt(tmp_path: Path) -> Path:
    path = tmp_path / "bad.onnx"
    onnx.save(stack_model(layers=2, channels=64), path)
    path.write_bytes(path.read_bytes()[:300])
    return path


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("command", ["bench", "convert", "quantize", "inspect", "verify"])
def test_a_corrupt_model_is_exit_2_with_or_without_debug(tmp_path: Path, command: str, debug: bool) -> None:
    bad = _corrupt(tmp_path)
    args = {
        "bench": ["bench", bad],
        "convert": ["convert", bad, tmp_path / "o.onnx"],
        "quantize": ["quantize", bad, tmp_path / "o.onnx"],
        "inspect": ["inspect", bad],
        "verify": ["verify", bad, bad],
    }[command]
    env = {"ONNX_CONV2MATMUL_DEBUG": "1" if debug else ""}
    result = CliRunner().invoke(main, no_bench(args), env=env)
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output


@pytest.mark.parametrize("debug", [False, True])
def test_debug_changes_what_is_printed_never_the_exit_code(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug: bool
) -> None:
    """An internal error (a bug) is exit 3 either way; with the variable its traceback is printed too."""
    from onnx_conv2matmul import api

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "inspect_file", broken)
    env = {"ONNX_CONV2MATMUL_DEBUG": "1" if debug else ""}
    result = CliRunner().invoke(main, ["inspect", str(model)], env=env)
    assert result.exit_code == 3
    assert "internal error" in result.output
    assert ("Traceback" in result.output) == debug


# --- hints -------------------------------------------------------------------------------------


def _contexts() -> list[tuple[str, click.Context]]:
    found = []
    for name, command in COMMANDS.items():
        names = {p.name for p in command.params}
        for with_inputs in (False, True):
            if with_inputs and "inputs" not in names:
                continue
            ctx = click.Context(command, info_name=command.name)
            ctx.params = {"inputs": ("x.npz",)} if with_inputs else {}
            found.append((f"{name}{' --inputs' if with_inputs else ''}", ctx))
    return found


@pytest.mark.parametrize("hint", list(Hint), ids=lambda h: h.name)
def test_no_hint_names_a_flag_the_invocation_refuses(hint: Hint) -> None:
    assert hint in HINTS
    for label, ctx in _contexts():
        text = hint_text(hint, ctx)
        if text is None:
            continue
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", text))
        known = {opt for p in ctx.command.params for opt in getattr(p, "opts", [])}
        assert flags <= known, (label, hint, text)
        assert not flags & refused_flags(ctx), (label, hint, text)


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (c, f)
        for c in ("quantize", "verify")
        for f in ("--verify-input=x=1", "--verify-dim=N=1", "--verify-lengths=16")
    ]
    + [("bench", "--verify-lengths=16"), ("bench", "--verify-batch=2")],
)
def test_the_refusals_the_hints_avoid_are_real(model: Path, tmp_path: Path, command: str, flag: str) -> None:
    """refused_flags says what the commands do: each of these is refused (exit 2)."""
    import numpy as np

    np.savez(tmp_path / "x.npz", x=np.zeros((1, 8, 64), np.float32))
    args = _args(command, model, tmp_path)
    if command != "bench":
        args += ["--inputs", str(tmp_path / "x.npz")]
    result = CliRunner().invoke(main, no_bench([*args, flag]))
    assert result.exit_code == 2, result.output


def test_the_example_hint_with_inputs(model: Path, tmp_path: Path) -> None:
    """Inputs above the memory budget: the hint names --verify-memory, not --verify-lengths."""
    import numpy as np

    np.savez(tmp_path / "x.npz", x=np.zeros((2, 20, 64), np.float32))
    args = ["quantize", model, tmp_path / "o.onnx", "--inputs", tmp_path / "x.npz", "--verify-memory", "1KiB"]
    result = CliRunner().invoke(main, no_bench(args))
    assert result.exit_code == 2
    assert "--verify-memory" in result.output and "--verify-lengths" not in result.output


# --- streams -----------------------------------------------------------------------------------


def _console(args: list[str], redirect: str = "") -> subprocess.CompletedProcess[str]:
    """The console entry point under ``sh`` with ``redirect`` (e.g. ``>&-``) applied to it."""
    code = console_code("")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_CONV2MATMUL_DEBUG"}
    return subprocess.run(
        [
            "sh",
            "-c",
            f'p="$0"; c="$1"; shift; exec "$p" -c "$c" "$@" {redirect}',
            sys.executable,
            code,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        check=False,
    )


REDIRECTS = ["", ">&-", "2>&-", ">&- 2>&-", "<&- >&- 2>&-", ">/dev/full", "2>/dev/full"]


@pytest.mark.parametrize("redirect", REDIRECTS)
@pytest.mark.parametrize("json_stdout", [False, True])
def test_closed_or_full_streams_change_nothing(
    model: Path, tmp_path: Path, redirect: str, json_stdout: bool
) -> None:
    extra = ["--report-json-stdout"] if json_stdout else []
    good = _console(["convert", str(model), str(tmp_path / "o.onnx"), *extra], redirect)
    assert good.returncode == 0, good.stderr
    onnx.checker.check_model(str(tmp_path / "o.onnx"))
    failed = _console(["verify", str(model), str(_other(tmp_path)), *extra], redirect)
    assert failed.returncode == 1, failed.stderr


def _other(tmp_path: Path) -> Path:
    path = tmp_path / "other.onnx"
    if not path.exists():
        onnx.save(stack_model(layers=2, channels=64), path)  # other random weights
    return path


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_pipe_that_goes_away_changes_nothing(model: Path, tmp_path: Path, stream: str) -> None:
    code = console_code("")
    out = tmp_path / "o.onnx"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "convert", str(model), str(out), "--report-json-stdout"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gone, kept = (proc.stdout, proc.stderr) if stream == "stdout" else (proc.stderr, proc.stdout)
    assert gone is not None and kept is not None
    gone.close()
    rest = kept.read()
    assert proc.wait(timeout=TIMEOUT) == 0, rest
    onnx.checker.check_model(str(out))
    if stream == "stderr":
        assert json.loads(rest)["return_code"] == 0


def test_only_the_json_reaches_stdout(tmp_path: Path, model: Path) -> None:
    """gptq's bundled code prints progress; none of it may reach stdout."""
    import numpy as np

    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).standard_normal((1, 8, 64)).astype(np.float32))
    args = [
        "quantize",
        str(model),
        str(tmp_path / "o.onnx"),
        "--no-bench",
        "--inputs",
        str(tmp_path / "x.npz"),
    ]
    plain = _console([*args, "--algorithm", "gptq"])
    assert plain.returncode == 0 and plain.stdout == "", plain.stdout
    as_json = _console([*args, "--algorithm", "gptq", "--report-json-stdout"])
    assert as_json.returncode == 0
    assert json.loads(as_json.stdout)["return_code"] == 0
