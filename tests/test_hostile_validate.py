"""User code is fenced (issue 32, class 3): a ``--validate`` function, or its module at import.

Table-driven over what hostile or careless code does: raise anything, exit, return something
that is not a finite number, change the process it runs in, parse ``sys.argv``. Each is placed
in the function and at the module's import; every one ends the run with exit 2, one line on
stderr naming the function, no model, the JSON report written, and the process (working
directory, ``sys.argv``, environment, streams, signal handlers) as it was.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import no_bench, stack_model
from onnx_conv2matmul.cli.app import main

# Statements, each run in the function (indented into it) or at the module's import.
HOSTILE = {
    "exit0": "import sys; sys.exit(0)",
    "exit2": "import sys; sys.exit(2)",
    "raise_systemexit": "raise SystemExit('bye')",
    "raise_value_error": "raise ValueError('boom')",
    "raise_base_exception": "raise type('Odd', (BaseException,), {})('odd')",
    "raise_generator_exit": "raise GeneratorExit()",
    "chdir": "import os, tempfile; os.chdir(tempfile.gettempdir())",
    "argv_appended": "import sys; sys.argv.append('--oops')",
    "argv_replaced": "import sys; sys.argv = ['x', '--oops']",
    "environ": "import os; os.environ['ONNX_CONV2MATMUL_HOSTILE'] = '1'",
    "environ_removed": "import os; os.environ.pop('HOME', None)",
    "stdout_replaced": "import io, sys; sys.stdout = io.StringIO()",
    "stderr_closed": "import io, sys; sys.stderr = io.StringIO(); sys.stderr.close()",
    "sigint_handler": "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)",
    "argparse_required": (
        "import argparse; p = argparse.ArgumentParser(); p.add_argument('--data', required=True);"
        " p.parse_args()"
    ),
}
# Results of the function that are no finite number.
RETURNS = {
    "nan": "float('nan')",
    "inf": "float('inf')",
    "text": "'high'",
    "none": "None",
    "bool": "True",
    "list": "[1.0, 2.0]",
    "bad_repr": "type('R', (), {'__repr__': lambda self: 1 / 0})()",
    "numpy_nan": "__import__('numpy').float32('nan')",
}


def _module(place: str, statement: str, result: str = "1.0") -> str:
    body = statement if place == "call" else "pass"
    top = statement if place == "import" else ""
    return textwrap.dedent(
        f"""
        {top}

        def score(path):
            {body}
            return {result}
        """
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "m.onnx"
    onnx.save(stack_model(layers=2, channels=64), path)
    return path


def _state() -> tuple[object, ...]:
    return (
        os.getcwd(),
        list(sys.argv),
        dict(os.environ),
        sys.stdin,
        sys.stdout,
        sys.stderr,
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
    )


def _run(model: Path, tmp_path: Path, source: str) -> tuple[int, str, str]:
    module = tmp_path / "metric_mod.py"
    module.write_text(source)
    sys.modules.pop("_onnx_conv2matmul_validate_metric_mod", None)
    out = tmp_path / "o.onnx"
    before = _state()
    result = CliRunner().invoke(
        main, no_bench(["quantize", model, out, "--validate", f"{module}:score", "--report-json-stdout"])
    )
    assert _state() == before, "the process changed"
    if result.exit_code != 0:
        assert not out.exists()
    return result.exit_code, result.stdout, result.stderr


def _assert_fenced(code: int, stdout: str, stderr: str) -> None:
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: the validation function") and "metric_mod.py:score" in lines[0]
    report = json.loads(stdout)  # the one JSON object, nothing else
    assert report["return_code"] == 2 and "metric_mod.py:score" in report["error"]


@pytest.mark.parametrize("place", ["call", "import"])
@pytest.mark.parametrize("behaviour", sorted(HOSTILE))
def test_hostile_code_is_fenced(
    model: Path, tmp_path: Path, place: str, behaviour: str, sigint_raises: None
) -> None:
    # SIGINT as a terminal gives it: in a run started in the background it is ignored already,
    # and code that ignores it would change nothing there.
    _assert_fenced(*_run(model, tmp_path, _module(place, HOSTILE[behaviour])))


@pytest.mark.parametrize("result", sorted(RETURNS))
def test_a_result_that_is_no_finite_number_is_fenced(model: Path, tmp_path: Path, result: str) -> None:
    _assert_fenced(*_run(model, tmp_path, _module("call", "pass", RETURNS[result])))


def test_argparse_at_import_sees_none_of_the_tools_arguments(model: Path, tmp_path: Path) -> None:
    """A module that parses its command line at import finds only the function's name there."""
    source = _module(
        "import",
        "import argparse; p = argparse.ArgumentParser(); p.add_argument('--level', default='1');"
        " ARGS = p.parse_args()",
        "float(ARGS.level)",
    )
    code, stdout, stderr = _run(model, tmp_path, source)
    assert code == 0, stderr
    assert json.loads(stdout)["accuracy"]["metric"]["score"] == 1.0


def test_printing_at_import_is_shown_on_success_only(model: Path, tmp_path: Path) -> None:
    code, stdout, stderr = _run(model, tmp_path, _module("import", "print('loading my metric')"))
    assert code == 0 and "loading my metric" in stderr
    assert json.loads(stdout)["return_code"] == 0


def test_keyboard_interrupt_ends_the_run_as_interrupted(model: Path, tmp_path: Path) -> None:
    """Decided: a KeyboardInterrupt cannot be told from Ctrl-C, so it is not fenced (exit 130)."""
    code, _, _ = _run(model, tmp_path, _module("call", "raise KeyboardInterrupt"))
    assert code == 130
