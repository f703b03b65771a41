"""One error model: every error class in errors.py, exit codes from one table, no flags in messages."""

from __future__ import annotations

import ast
import errno
import re
import signal
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import conv_model, no_bench
from onnx_conv2matmul import errors
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.cli.common import HINTS as _HINTS
from onnx_conv2matmul.errors import (
    CheckerError,
    Conv2MatMulError,
    DestinationBusy,
    ExitCode,
    Hint,
    InputError,
    Interrupted,
    ModelRunError,
    exit_code_for,
)
from onnx_conv2matmul.files import publish as _publish
from onnx_conv2matmul.files.checks import check_paths
from onnx_conv2matmul.verify import check as verify

SRC = Path(__file__).resolve().parent.parent / "src" / "onnx_conv2matmul"
# The command line's own package: it names its flags on purpose.
FRONT_END = "cli"
FLAG = re.compile(r"--[a-z]")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InputError("x"), 2),
        (DestinationBusy("x"), 2),
        (ModelRunError("x"), 2),
        (CheckerError("x"), 1),
        (Conv2MatMulError("x"), 1),
        (OSError(errno.ENOSPC, "No space left on device"), 2),
        (MemoryError(), 2),
        (errors.OutOfMemory("x"), 2),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), 2),
        (RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : std::bad_alloc"), 2),
        (CheckerError("Failed to allocate memory for requested buffer"), 2),
        (KeyboardInterrupt(), 130),
        (Interrupted(signal.SIGTERM), 143),
        (ValueError("a bug"), 3),
    ],
)
def test_exit_codes_come_from_one_table(error: BaseException, code: int) -> None:
    assert exit_code_for(error) == code


def test_exit_code_values() -> None:
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3]


def test_every_error_class_lives_in_errors() -> None:
    """The classes the modules raise are errors.py's (the old names still import)."""
    assert _publish.DestinationBusy is errors.DestinationBusy
    assert verify.ModelRunError is errors.ModelRunError
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        classes = [
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id.endswith(("Error", "Busy")) for b in node.bases)
        ]
        if path.name != "errors.py":
            assert classes == [], f"{path.name} defines error classes {classes}"


def _raised_strings(tree: ast.AST) -> list[str]:
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            constants = [c for c in ast.walk(node.exc) if isinstance(c, ast.Constant)]
            texts += [c.value for c in constants if isinstance(c.value, str)]
    return texts


@pytest.mark.parametrize(
    "name",
    sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != FRONT_END),
)
def test_library_errors_name_no_flag(name: str) -> None:
    flagged = [text for text in _raised_strings(ast.parse((SRC / name).read_text())) if FLAG.search(text)]
    assert flagged == []


def test_every_hint_is_worded_by_the_command_line() -> None:
    assert set(_HINTS) == set(Hint)
    for option, text in _HINTS.values():
        assert FLAG.search(text), text
        assert any(option in {p.name for p in command.params} for command in main.commands.values())


def test_library_message_and_hint_then_the_cli_names_the_flag(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    with pytest.raises(InputError) as raised:
        check_paths(str(src), str(src), inplace=False)
    assert str(raised.value) == "output is the input" and raised.value.hint is Hint.OUTPUT_IS_INPUT
    result = CliRunner().invoke(main, [str(src), str(src)])
    assert result.exit_code == 2
    assert "output is the input (use --inplace to replace the input)" in result.stderr
    # quantize has no --inplace: no hint naming it.
    result = CliRunner().invoke(main, no_bench(["quantize", str(src), str(src)]))
    assert result.exit_code == 2 and "--inplace" not in result.stderr, result.stderr


def test_hint_defaults_per_class() -> None:
    assert ModelRunError("x").hint is Hint.VERIFY_INPUTS
    assert InputError("x").hint is None
    assert InputError("x", hint=Hint.NO_OUTPUT).hint is Hint.NO_OUTPUT
