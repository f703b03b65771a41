"""Synthesised inputs the model can take: values read from the graph, sizes found by probing it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from helpers import no_bench
from model_cache import FETCHER
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import ModelRunError
from onnx_conv2matmul.speed.timing import TimingOptions
from onnx_conv2matmul.verify.check import VerifyOptions, discover_inputs, verify_models
from real_packages import REC, SILERO

RNG = np.random.default_rng(11)


def _recognizer(height: int | str | None = "H", width: int | str | None = "W") -> onnx.ModelProto:
    """A CRNN-shaped net: a pointwise conv, a pool of 16 rows that must leave one row (heights
    16 to 31 run), Squeeze of that row, then a per-column projection: ``[N, W, 5]``."""
    inits = [
        numpy_helper.from_array(RNG.standard_normal((8, 3, 1, 1)).astype(np.float32), "pw"),
        numpy_helper.from_array(RNG.standard_normal((8, 5)).astype(np.float32), "proj"),
        numpy_helper.from_array(np.array([2], np.int64), "row"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "pw"], ["c"], name="pw"),
        helper.make_node("AveragePool", ["c"], ["p"], kernel_shape=[16, 1], strides=[16, 1]),
        helper.make_node("Squeeze", ["p", "row"], ["s"]),
        helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["t", "proj"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rec",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, height, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "Wo", "C"])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _branching(constant: int = 16000) -> onnx.ModelProto:
    """``sr`` (int64 scalar) picks a branch: Equal(Cast(sr), constant) -> If; the other branch
    cannot run (a Concat of mismatched shapes), as a model's branch for rates it does not take."""
    out = helper.make_tensor_value_info
    good = helper.make_graph([helper.make_node("Identity", ["x"], ["g"])], "good", [], [out("g", 1, None)])
    bad = helper.make_graph(
        [
            helper.make_node("Constant", [], ["odd"], value=numpy_helper.from_array(np.zeros((3, 1), "f"))),
            helper.make_node("Concat", ["x", "odd"], ["b"], axis=0),
        ],
        "bad",
        [],
        [helper.make_tensor_value_info("b", 1, None)],
    )
    nodes = [
        helper.make_node("Cast", ["sr"], ["sr64"], to=TensorProto.INT64),
        helper.make_node("Constant", [], ["rate"], value=numpy_helper.from_array(np.array(constant, "i8"))),
        helper.make_node("Equal", ["sr64", "rate"], ["is_rate"]),
        helper.make_node("If", ["is_rate"], ["y"], then_branch=good, else_branch=bad),
    ]
    graph = helper.make_graph(
        nodes,
        "vad",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T"]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, path)
    return str(path)


@pytest.mark.parametrize(("height", "width"), [("H", "W"), ("?", "W"), ("?", "?"), (None, None)], ids=str)
def test_a_height_the_network_pins_is_found_by_probing(tmp_path: Path, height: str, width: str) -> None:
    """Before: every default length (64..160) set the height too, and the model runs at none.
    Two ``?`` (Paddle2ONNX's unknown size: PP-OCRv3 rec's height and width) are two dims."""
    src = _save(_recognizer(height, width), tmp_path / "rec.onnx")
    report = verify_models(src, src)
    assert report.passed, report.failures
    found = report.options.found
    assert found is not None and [(f.what, f.value) for f in found] == [("x[2]", 16)]
    assert found[0].how.startswith("probe:") and "from 16 to 16" in found[0].how
    # With the height fixed, the width is the one sequence dim: it takes the default lengths.
    assert {r.dims.get("W", r.dims.get("(unnamed)")) for r in report.runs} == {64, 80, 97, 128, 191}
    assert report.to_dict()["options"]["axes"] == {"x[2]": 16}


def test_discover_inputs_gives_the_options_every_step_feeds(tmp_path: Path) -> None:
    src = _save(_recognizer(), tmp_path / "rec.onnx")
    options = discover_inputs(src, VerifyOptions())
    assert options.axes == {"x[2]": 16} and options.found is not None
    assert discover_inputs(src, options) is options  # looked for once
    # Sizes given win over probing; real inputs are never probed.
    given = VerifyOptions(dims={"H": 24})
    assert discover_inputs(src, given).axes == {}
    feeds = ({"x": np.zeros((1, 3, 16, 8), np.float32)},)
    assert discover_inputs(src, VerifyOptions(feeds=feeds)).found is None


def test_an_integer_scalar_takes_the_constant_it_is_compared_with(tmp_path: Path) -> None:
    """Before: ``sr`` was random in [0, 4), so the If took the branch that cannot run."""
    src = _save(_branching(), tmp_path / "vad.onnx")
    report = verify_models(src, src)
    assert report.passed, report.failures
    assert report.inputs["sr"] == "fixed 16000"
    found = report.options.found
    assert found is not None and [(f.what, f.value) for f in found] == [("sr", 16000)]
    assert "compared with 16000 in Equal" in found[0].how
    # A value given is kept.
    with pytest.raises(ModelRunError):
        verify_models(src, src, VerifyOptions(inputs={"sr": 8000}))


def test_a_model_that_runs_at_no_shape_names_the_dims_and_the_inputs_option(tmp_path: Path) -> None:
    model = _recognizer()
    model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, 7], np.int64), "bad_shape"))
    model.graph.node[-1].output[0] = "y5"
    model.graph.node.append(helper.make_node("Reshape", ["y5", "bad_shape"], ["y"]))
    src = _save(model, tmp_path / "broken.onnx")
    with pytest.raises(ModelRunError, match=r"none of the synthesised shapes tried \(dims .*W \(x\[3\]\)"):
        verify_models(src, src)
    result = CliRunner().invoke(main, no_bench(["quantize", src, str(tmp_path / "q.onnx")]))
    assert result.exit_code == 2
    assert "--inputs FILE.npz gives real inputs" in result.stderr


@pytest.mark.network
def test_ppocr_v4_recognizer_quantizes_with_no_option(tmp_path: Path) -> None:
    """Before: exit 2, the latency step ran it at 224x224 (and the check found one size only)."""
    src = FETCHER.fetch(REC)
    options = discover_inputs(str(src), VerifyOptions())
    assert options.axes == {"x[2]": 48}
    result = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q.onnx"), "--bench-rounds", "3"])
    assert result.exit_code == 0, result.stderr
    assert "x[2] = 48" in result.stderr and (tmp_path / "q.onnx").exists()


@pytest.mark.network
def test_silero_vad_check_runs_at_its_sample_rate(tmp_path: Path) -> None:
    """Before: ``sr`` random in [0, 4) checked the 8 kHz branch only, by accident."""
    src = str(FETCHER.fetch(SILERO))
    report = verify_models(src, src)
    assert report.passed
    assert report.inputs["sr"] == "fixed 16000"
    assert all(run.dims["(unnamed)"] >= 192 for run in report.runs)


@pytest.mark.network
def test_ppocr_v4_recognizer_with_inputs_times_at_the_height_it_takes(tmp_path: Path) -> None:
    """Before: with --inputs, the latency step still synthesised 224x224 and ended with exit 2."""
    src = FETCHER.fetch(REC)
    np.savez(tmp_path / "lines.npz", x=np.random.default_rng(0).uniform(-1, 1, (4, 3, 48, 320)).astype("f"))
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(src), str(out), "--inputs", str(tmp_path / "lines.npz"), "--bench-rounds", "3"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.stderr
    assert out.exists()


def test_bench_times_a_height_the_network_pins_as_quantize_does(tmp_path: Path) -> None:
    """Before, ``bench`` fed the height each default length (224, 448 for an image) and stopped:
    onnxruntime cannot run the model there. It now finds the height by probing, as the check does."""
    from onnx_conv2matmul.api import bench_models

    src = _save(_recognizer("?", "W"), tmp_path / "rec.onnx")
    report = bench_models([src, src], options=TimingOptions(rounds=3))
    assert [lat.length for lat in report.timing.models[0].latencies] == [200, 1000]
