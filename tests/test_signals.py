"""SIGINT and SIGTERM on a real process: staging removed, exit 128 + signal, no traceback.

Each process runs the console entry point declared in pyproject.toml; the test holds it at a
chosen step by replacing one function with a long sleep (a signal interrupts the sleep), and
sends the signal once the process says it has reached that step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from helpers import conv_model

ROOT = Path(__file__).resolve().parents[1]


def entry_point() -> tuple[str, str]:
    """The console script's ``module:function`` from pyproject.toml."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["onnx-conv2matmul"].partition(":")
    return module, function


def spawn(prelude: str, *args: str) -> subprocess.Popen[str]:
    """Run the console entry point after ``prelude`` (Python code) in a new process."""
    module, function = entry_point()
    code = textwrap.dedent(prelude) + textwrap.dedent(
        f"""
        import sys
        sys.argv[0] = "onnx-conv2matmul"
        from {module} import {function}
        sys.exit({function}())
        """
    )
    env = dict(os.environ)
    env.pop("ONNX_CONV2MATMUL_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


MARKER = "stalled"


def stall(module: str, function: str) -> str:
    """Prelude: ``module.function`` says so on stderr, then sleeps instead of working."""
    return f"""
        import sys, time
        import {module} as _target
        def _stall(*args, **kwargs):
            sys.stderr.write("{MARKER}\\n")
            sys.stderr.flush()
            time.sleep(600)
        _target.{function} = _stall
    """


def wait_for_marker(proc: subprocess.Popen[str]) -> str:
    """Read stderr up to the stall's marker line; return what came before it."""
    assert proc.stderr is not None
    before = []
    while (line := proc.stderr.readline()) != f"{MARKER}\n":
        if not line:
            out, err = proc.communicate()
            pytest.fail(f"the process ended early ({proc.returncode}): {''.join(before)}{err}{out}")
        before.append(line)
    return "".join(before)


def staging(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


SIGNALS = [(signal.SIGINT, 130), (signal.SIGTERM, 143)]
SIGNAL_IDS = ["SIGINT", "SIGTERM"]


@pytest.fixture
def external_model(tmp_path: Path) -> Path:
    src = tmp_path / "m.onnx"
    onnx.save(
        conv_model(spatial=1, attrs={"strides": [2]}),
        src,
        save_as_external_data=True,
        location="m.onnx.data",
        size_threshold=0,
    )
    return src


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize(
    ("command", "target"),
    [
        ("convert", ("onnx_conv2matmul.api", "convert")),  # the data file is being copied
        ("convert --verify", ("onnx_conv2matmul.api", "verify_models")),  # a staged output
        ("quantize", ("onnx_conv2matmul.quantize.workflow", "verify_models")),  # a staged quantized output
    ],
    ids=["convert-copying", "convert-verifying", "quantize-measuring"],
)
def test_signal_while_staging_removes_everything(
    tmp_path: Path, external_model: Path, signum: int, code: int, command: str, target: tuple[str, str]
) -> None:
    before = {p.name for p in tmp_path.iterdir()}
    out = tmp_path / "o.onnx"
    name, *flags = command.split()
    args = (
        [str(external_model), str(out), *flags]
        if name == "convert"
        else [name, str(external_model), str(out)]
    )
    proc = spawn(stall(*target), *args)
    wait_for_marker(proc)
    assert staging(tmp_path), "the step is reached with an output staged"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and stdout == ""
    assert stderr.strip().splitlines()[-1].endswith("nothing was written"), stderr
    assert {p.name for p in tmp_path.iterdir()} == before, "staging directory left behind"


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
def test_signal_after_publishing_says_what_was_written(
    tmp_path: Path, external_model: Path, signum: int, code: int
) -> None:
    out = tmp_path / "o.onnx"
    proc = spawn(stall("onnx_conv2matmul.cli.render", "print_convert_report"), str(external_model), str(out))
    wait_for_marker(proc)
    assert out.exists() and not staging(tmp_path)
    proc.send_signal(signum)
    _, stderr = proc.communicate()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert "nothing was written" not in stderr
    assert str(out) in stderr
    onnx.checker.check_model(str(out))


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("onnx_conv2matmul.cli.app", ["{model}", "{out}"]),  # the entry point importing the CLI
        ("onnx_conv2matmul.cli.render", ["verify", "{model}", "{model}"]),  # a command importing
    ],
    ids=["importing-cli", "importing-in-a-command"],
)
def test_signal_during_start_up(tmp_path: Path, signum: int, code: int, module: str, args: list[str]) -> None:
    """Ctrl-C (or SIGTERM) while modules are imported: one line, no traceback, 128 + signal."""
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    prelude = f"""
        import sys, time
        class _SlowImport:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    sys.stderr.write("importing\\n")
                    sys.stderr.flush()
                    time.sleep(600)
                return None
        sys.meta_path.insert(0, _SlowImport())
    """
    values = {"model": str(src), "out": str(tmp_path / "o.onnx")}
    proc = spawn(prelude, *[a.format(**values) for a in args], "--report-json-stdout")
    assert proc.stderr is not None
    assert proc.stderr.readline() == "importing\n"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr
    assert stderr.strip().endswith("nothing was written") and len(stderr.strip().splitlines()) == 1
    assert json.loads(stdout)["return_code"] == code
    assert {p.name for p in tmp_path.iterdir()} == {"m.onnx"}


def test_importing_the_package_leaves_signal_handling_alone() -> None:
    """Only the console entry point installs handlers: a library import changes nothing."""
    code = (
        "import signal\n"
        "import onnx_conv2matmul.cli.entry, onnx_conv2matmul.cli.app, onnx_conv2matmul.api\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
