"""The public API: one function per command, each returning its typed report, safe to call from a
host program (any thread, its own logging, stdout and umask left alone)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import onnx_conv2matmul
from helpers import stack_model
from onnx_conv2matmul import (
    BundleReport,
    ConvertReport,
    InspectReport,
    QuantizeOptions,
    QuantizeReport,
    VerifyCommandReport,
    VerifyOptions,
    check_bundle,
    convert_file,
    inspect_file,
    quantize_file,
    verify_files,
)

PACKAGE_DIR = Path(onnx_conv2matmul.__file__).parent


def test_every_public_name_resolves_and_importing_imports_nothing_heavy() -> None:
    code = (
        "import sys, onnx_conv2matmul as m\n"
        "heavy = [n for n in ('onnx_ir', 'onnxruntime', 'numpy') if n in sys.modules]\n"
        "assert not heavy, heavy\n"
        "missing = [n for n in m.__all__ if getattr(m, n, None) is None]\n"
        "assert not missing, missing\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    for command in (
        "convert_file",
        "verify_files",
        "quantize_file",
        "inspect_file",
        "check_bundle",
        "build_bundle",
    ):
        assert command in onnx_conv2matmul.__all__


def test_the_package_is_typed() -> None:
    assert (PACKAGE_DIR / "py.typed").is_file()
    pyproject = (PACKAGE_DIR.parent.parent / "pyproject.toml").read_text()
    assert 'onnx_conv2matmul = ["py.typed"]' in pyproject


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(stack_model(layers=2, channels=64), path)
    return path


def _every_command(model: Path, out: Path) -> list[object]:
    """Each public command once, as a script would call them, in this thread."""
    out.mkdir()
    converted = convert_file(model, out / "c.onnx")
    checked = verify_files(model, out / "c.onnx", VerifyOptions(lengths=(3, 5)))
    quantized = quantize_file(
        model, out / "q.onnx", QuantizeOptions(block_size=32), verify=VerifyOptions(lengths=(3, 5))
    )
    inspected = inspect_file(model)
    listed = check_bundle(out)
    return [converted, checked, quantized, inspected, listed]


def test_each_command_returns_its_typed_report(model: Path, tmp_path: Path) -> None:
    reports = _every_command(model, tmp_path / "out")
    kinds = [ConvertReport, VerifyCommandReport, QuantizeReport, InspectReport, BundleReport]
    assert [type(r) for r in reports] == kinds
    converted, checked, quantized, _, listed = reports
    assert isinstance(converted, ConvertReport) and converted.return_code == 0
    assert isinstance(checked, VerifyCommandReport) and checked.return_code == 0
    assert isinstance(quantized, QuantizeReport) and quantized.return_code == 0
    assert isinstance(listed, BundleReport)
    assert {m.name for m in listed.models} >= {"c.onnx", "q.onnx"}
    for report in reports:
        assert report.to_dict()["return_code"] == 0  # type: ignore[attr-defined]


def test_commands_run_from_a_worker_thread(model: Path, tmp_path: Path) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reports = pool.submit(_every_command, model, tmp_path / "out").result()
    assert all(r.return_code == 0 for r in reports)  # type: ignore[attr-defined]


def test_the_library_leaves_logging_stdout_and_umask_alone(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No level, handler or stream of the host's is changed; onnxruntime's quantizer records
    reach the host's root handlers only through this package's logger, at DEBUG."""
    root = logging.getLogger()
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(logging.DEBUG)
    root.addHandler(handler)
    before = (root.level, list(root.handlers), logging.getLogger("neural_compressor").level)

    def no_umask(_mask: int) -> int:
        raise AssertionError("the library set the umask")

    monkeypatch.setattr(os, "umask", no_umask)
    try:
        _every_command(model, tmp_path / "out")
        quantize_file(model, tmp_path / "i8.onnx", int8_dynamic=True, verify=VerifyOptions(lengths=(3,)))
    finally:
        root.removeHandler(handler)
    assert (root.level, [h for h in root.handlers if h is not handler], before[2]) == (
        before[0],
        [h for h in before[1] if h is not handler],
        before[2],
    )
    foreign = [r for r in seen if "onnxruntime" in r.pathname and r.levelno > logging.DEBUG]
    assert foreign == []
    assert capsys.readouterr().out == ""


def test_a_quantizer_record_is_taken_into_the_package_logger(caplog: pytest.LogCaptureFixture) -> None:
    from onnx_conv2matmul.quantize.weight_only import onnxruntime_logs_captured

    ort_logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    caplog.set_level(logging.DEBUG)
    with onnxruntime_logs_captured():
        ort_logger.warning("quantizing node %s", "n1")
        logging.getLogger("somebody.else").warning("not ours")
    ort_logger.warning("after the block")
    messages = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert (
        "onnx_conv2matmul.quantize.weight_only",
        logging.DEBUG,
        "onnxruntime.quantization.matmul_nbits_quantizer [WARNING] quantizing node n1",
    ) in messages
    assert ("somebody.else", logging.WARNING, "not ours") in messages
    assert ("onnxruntime.quantization.matmul_nbits_quantizer", logging.WARNING, "after the block") in messages
    assert not any(name.startswith("onnxruntime") and "n1" in text for name, _, text in messages)
