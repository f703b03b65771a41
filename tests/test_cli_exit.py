"""Exit codes, and one JSON object on stdout with --report-json-stdout whatever happens."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import conv_model, matmul_model, no_bench
from onnx_conv2matmul import api
from onnx_conv2matmul.cli.app import main


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def one_line(stderr: str) -> bool:
    return len(stderr.strip().splitlines()) == 1


# ---- 7. --report-json-stdout: exactly one JSON object on stdout, always -------------------------


def _json(stdout: str) -> dict[str, object]:
    data = json.loads(stdout)  # the whole of stdout is one object
    assert isinstance(data, dict)
    return data


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    onnx.save(conv_model(), tmp_path / "m.onnx")
    onnx.save(conv_model(seed=1), tmp_path / "other.onnx")
    onnx.save(matmul_model(), tmp_path / "mm.onnx")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    onnx.save(conv_model(), bundle / "a.onnx")
    return {
        "model": str(tmp_path / "m.onnx"),
        "other": str(tmp_path / "other.onnx"),
        "mm": str(tmp_path / "mm.onnx"),
        "missing": str(tmp_path / "missing.onnx"),
        "out": str(tmp_path / "o.onnx"),
        "bundle": str(bundle),
        "tmp": str(tmp_path),
    }


@pytest.mark.parametrize(
    ("args", "code", "error"),
    [
        (["{model}", "{out}"], 0, None),
        (["{missing}", "{out}"], 2, "input not found"),
        (["{model}", "{out}", "--no-such-option"], 2, "No such option"),
        (["{model}", "{out}", "--max-dilation", "0"], 2, "0 is not in the range"),
        ([], 2, "Missing argument"),
        (["{model}", "{out}", "--verify", "--verify-input", "bad"], 2, "expected NAME=VALUE"),
        (["verify", "{model}", "{model}", "--verify-lengths", "3"], 0, None),
        (["verify", "{model}", "{other}", "--verify-lengths", "3"], 1, "verification failed"),
        (["verify", "{model}", "{missing}"], 2, "input not found"),
        (["verify", "{model}"], 2, "Missing argument"),
        (["quantize", "{mm}", "{out}", "--verify-lengths", "3"], 0, None),
        (["quantize", "{model}", "{out}", "--block-size", "512"], 2, "block size"),
        (["quantize", "{model}", "{out}", "--bits", "3"], 2, "'3' is not one of"),
        (
            ["quantize", "{mm}", "{out}", "--verify-lengths", "3", "--bits", "4", "--min-cosine", "1"],
            1,
            "below --min-cosine",
        ),
        (["bundle", "--check", "{bundle}"], 0, None),
        (["bundle", "--check", "{tmp}/nope"], 2, "not a directory"),
    ],
)
def test_report_json_stdout_on_every_exit(
    files: dict[str, str], args: list[str], code: int, error: str | None
) -> None:
    got, stdout, stderr = invoke(*[a.format(**files) for a in args], "--report-json-stdout")
    assert got == code, stderr
    data = _json(stdout)
    assert data["return_code"] == code
    if error is None:
        assert data["error"] is None
    else:
        assert isinstance(data["error"], str) and error in data["error"], data["error"]
        assert error in stderr or code == 1


@pytest.fixture
def convert_raises_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """convert_file raises an exception no error class covers (a bug), without the debug switch."""

    def boom(*args: object, **kwargs: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(api, "convert_file", boom)
    monkeypatch.delenv("ONNX_CONV2MATMUL_DEBUG", raising=False)


@pytest.mark.usefixtures("convert_raises_a_bug")
def test_report_json_stdout_on_an_internal_error(files: dict[str, str]) -> None:
    code, stdout, _ = invoke(files["model"], files["out"], "--report-json-stdout")
    assert code == 3
    data = _json(stdout)
    assert data["return_code"] == 3 and "boom" in str(data["error"])


def test_report_json_stdout_is_not_printed_twice_with_help(files: dict[str, str]) -> None:
    code, stdout, _ = invoke("--report-json-stdout", "--help")
    assert code == 0 and "{" not in stdout


# ---- 8. exit codes: 1 failed, 2 usage or input, 3 internal error ---------------------------------


@pytest.mark.usefixtures("convert_raises_a_bug")
def test_unexpected_exception_is_an_internal_error(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, stdout, stderr = invoke(files["model"], files["out"])
    assert code == 3
    assert stdout == "" and one_line(stderr)
    assert "internal error" in stderr and "boom" in stderr and "please report" in stderr
    assert "ONNX_CONV2MATMUL_DEBUG=1" in stderr
    monkeypatch.setenv("ONNX_CONV2MATMUL_DEBUG", "1")  # more is printed, the exit code stays
    code, _, stderr = invoke(files["model"], files["out"])
    assert code == 3 and "Traceback" in stderr and "boom" in stderr


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device", "o.onnx"), MemoryError()], ids=["disk-full", "memory"]
)
def test_system_errors_exit_2(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(api, "convert_file", fail)
    code, _, stderr = invoke(files["model"], files["out"])
    assert code == 2 and one_line(stderr), stderr
    assert ("No space left on device: o.onnx" if isinstance(error, OSError) else "out of memory") in stderr


def test_checker_rejecting_the_output_exits_1(files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_conv2matmul import CheckerError

    def reject(*args: object, **kwargs: object) -> None:
        raise CheckerError("ONNX checker rejected the rewritten model: test")

    monkeypatch.setattr(api, "convert_file", reject)
    code, _, stderr = invoke(files["model"], files["out"])
    assert code == 1 and "checker rejected" in stderr


def test_what_a_library_prints_on_stdout_goes_to_stderr(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime's quantizers print progress bars; stdout still carries exactly one object."""
    from onnx_conv2matmul import api

    real = api.convert_file

    def chatty(*args: object, **kwargs: object) -> object:
        print("Progress: [#####     ] 50.00%")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "convert_file", chatty)
    code, stdout, stderr = invoke(files["model"], files["out"], "--report-json-stdout")
    assert code == 0
    assert _json(stdout)["return_code"] == 0
    assert "Progress: [#####" in stderr
    code, stdout, stderr = invoke(files["model"], files["out"] + "2")
    # Without JSON too: stdout is the tool's (issue 43, rule 6), a library's prints go to stderr.
    assert code == 0 and "Progress: [#####" not in stdout and "Progress: [#####" in stderr
