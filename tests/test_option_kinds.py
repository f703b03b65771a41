"""Options that name an input are checked against the model's input of that name, its kind,
element type and rank, before any work (issue 43, rule 7), by every command that takes them:
a signal is a float tensor, lengths are one number per batch row. Before, an int64 ``length``
named as the signal, or the float signal named as lengths, was taken and checked nothing like
what was asked, at exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from onnx_conv2matmul.cli.app import main

ENCODER = str(
    Path(__file__).parent / "data" / "conformer_small.onnx"
)  # audio_signal f32 [B,80,T], length i64 [B]

CASES = [
    (
        "--verify-signal-input-name",
        "length",
        "signal input 'length' is int64 of rank 1: the signal is a float tensor (the model's float"
        " inputs: audio_signal)",
    ),
    (
        "--verify-length-input-name",
        "audio_signal",
        "length input 'audio_signal' is float32 of rank 3: lengths are one number per batch row, a tensor"
        " of rank 0 or 1 (the model's integer inputs of that rank: length)",
    ),
    ("--verify-signal-input-name", "nosuch", "unknown signal input 'nosuch'"),
    ("--verify-input", "length=1.5", "input 'length' is int64 of rank 1: 1.5 is not a whole number"),
]


def _args(command: str, tmp: Path) -> list[str]:
    out = str(tmp / "o.onnx")
    return {
        "convert": ["convert", ENCODER, out, "--verify"],
        "quantize": ["quantize", ENCODER, out, "--no-bench"],
        "verify": ["verify", ENCODER, ENCODER],
        "bench": ["bench", ENCODER, "--bench-rounds", "3"],
    }[command]


@pytest.mark.parametrize(("flag", "value", "said"), CASES, ids=lambda c: str(c)[:24])
@pytest.mark.parametrize("command", ["convert", "quantize", "verify", "bench"])
def test_an_input_named_for_a_role_it_cannot_play_is_refused(
    tmp_path: Path, command: str, flag: str, value: str, said: str
) -> None:
    result = CliRunner().invoke(main, [*_args(command, tmp_path), flag, value])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split())
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_the_inputs_that_fit_their_roles_are_taken(tmp_path: Path, command: str) -> None:
    names = ["--verify-signal-input-name", "audio_signal", "--verify-length-input-name", "length"]
    result = CliRunner().invoke(main, [*_args(command, tmp_path), *names])
    assert result.exit_code == 0, result.output
