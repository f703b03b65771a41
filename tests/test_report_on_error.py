"""A requested report is written on every exit path that can write one, errors included (issue 43,
rule 4): the report's place is checked first, so a missing input, a missing ``--inputs`` file or an
option that names nothing in the model still leaves the error object in the ``--report-json``
file, by every command. A value the command line cannot parse ends the run before the report's
place could be checked: the error object is written there only where that cannot hurt (no file
yet, or one of this tool's reports) and no other argument names the path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from onnx_conv2matmul.cli.app import main

DATA = Path(__file__).parent / "data"
ENCODER = str(DATA / "conformer_small.onnx")


def _args(command: str, model: str, tmp: Path) -> list[str]:
    out = str(tmp / "o.onnx")
    return {
        "convert": ["convert", model, out, "--verify"],
        "quantize": ["quantize", model, out, "--no-bench"],
        "verify": ["verify", model, ENCODER],
        "bench": ["bench", model],
        "bundle": ["bundle", str(DATA / "parakeet_small") if model == ENCODER else model, str(tmp / "b")],
    }[command]


ERRORS = {
    "a missing input": (lambda tmp: str(tmp / "missing.onnx"), [], "not"),
    "a missing --inputs file": (lambda tmp: ENCODER, ["--inputs", "nowhere.npz"], "inputs file not found"),
    "an option naming nothing in the model": (
        lambda tmp: ENCODER,
        ["--verify-dim", "nosuch=3"],
        "unknown dim",
    ),
}


@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize("command", ["convert", "quantize", "verify", "bench", "bundle"])
def test_the_report_file_gets_the_error(tmp_path: Path, command: str, error: str) -> None:
    model, extra, said = ERRORS[error]
    if command in ("convert", "bench") and extra and extra[0] == "--inputs":
        pytest.skip(f"{command} takes no --inputs")
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        main, [*_args(command, model(tmp_path), tmp_path), *extra, "--report-json", str(report)]
    )
    assert result.exit_code == 2, result.output
    data = json.loads(report.read_text())
    assert data["return_code"] == 2 and data["command"] == command
    assert said in data["error"], data["error"]


def test_a_parse_error_never_writes_over_a_file_that_is_not_a_report(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(Path(ENCODER).read_bytes())
    before = model.read_bytes()
    # The report path is the model itself, or the output: nothing is written there.
    for args in (
        ["quantize", ENCODER, str(tmp_path / "o.onnx"), "--report-json", str(model)],
        ["quantize", ENCODER, str(tmp_path / "o.json"), "--report-json", str(tmp_path / "o.json")],
    ):
        result = CliRunner().invoke(main, [*args, "--bits", "3"])
        assert result.exit_code == 2
    assert model.read_bytes() == before and not (tmp_path / "o.json").exists()


def test_a_parse_error_never_writes_over_a_json_file_that_is_not_a_report(tmp_path: Path) -> None:
    """The mark a bundle folder carries is JSON naming the tool too; it is not a report."""
    mark = tmp_path / "mark.json"
    mark.write_text('{"tool": "onnx-conv2matmul", "owned": true}')
    before = mark.read_text()
    result = CliRunner().invoke(
        main, ["quantize", ENCODER, str(tmp_path / "o.onnx"), "--report-json", str(mark), "--bits", "3"]
    )
    assert result.exit_code == 2 and mark.read_text() == before
