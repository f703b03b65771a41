"""Weights held in Constant nodes (Paddle2ONNX's way) are weights: the rewrite lifts MatMul's into
initializers, every quantization path lifts every weight's, the result computes what the original
computes, and the report says how many were lifted (issue 42, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from helpers import all_nodes, assert_equivalent, no_bench, session
from onnx_conv2matmul import ConvertOptions, convert
from onnx_conv2matmul.cli.app import main

C = 64  # channels: the 5-wide conv's weight is 80 KiB, above --other-weights' 64 KiB


def _constant(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], name=f"{name}_const", value=numpy_helper.from_array(array, name)
    )


def constant_weights_model(opset: int, *, in_branch: bool = False) -> onnx.ModelProto:
    """x [N, T, C] -> MatMul(Constant [C, C]) -> Transpose -> pointwise Conv(Constant) ->
    Conv k=5 (Constant) -> Transpose -> y [N, T, C]; with ``in_branch``, the MatMul and its
    Constant sit in both branches of an If on a graph input."""
    rng = np.random.default_rng(7)
    w_mm = (rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32)
    w_pw = (rng.standard_normal((C, C, 1)) / np.sqrt(C)).astype(np.float32)
    w_k5 = (rng.standard_normal((C, C, 5)) / np.sqrt(5 * C)).astype(np.float32)
    nodes = [_constant("w_pw", w_pw), _constant("w_k5", w_k5)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", C])]
    if in_branch:
        branches = []
        for branch in ("then", "else"):
            matmul = helper.make_node("MatMul", ["x", f"w_mm_{branch}"], [f"h_{branch}"])
            body = helper.make_graph(
                [_constant(f"w_mm_{branch}", w_mm), matmul],
                branch,
                [],
                [helper.make_tensor_value_info(f"h_{branch}", TensorProto.FLOAT, ["N", "T", C])],
            )
            branches.append(body)
        nodes.append(
            helper.make_node("If", ["flag"], ["h"], then_branch=branches[0], else_branch=branches[1])
        )
        inputs.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    else:
        nodes += [_constant("w_mm", w_mm), helper.make_node("MatMul", ["x", "w_mm"], ["h"])]
    nodes += [
        helper.make_node("Transpose", ["h"], ["hc"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["hc", "w_pw"], ["p"], kernel_shape=[1], name="pointwise"),
        helper.make_node("Conv", ["p", "w_k5"], ["q"], kernel_shape=[5], pads=[2, 2], name="wide"),
        helper.make_node("Transpose", ["q"], ["y"], perm=[0, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant_weights",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", C])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset == 12 else 10
    onnx.checker.check_model(model)
    return model


def _feeds(model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    names = [i.name for i in model.graph.input]
    feeds = []
    for length in (1, 7, 40):
        feed = {"x": rng.standard_normal((2, length, C)).astype(np.float32)}
        if "flag" in names:
            feed["flag"] = np.array(length % 2 == 1)
        feeds.append(feed)
    return feeds


def _constants(model: onnx.ModelProto) -> list[str]:
    return sorted(n.output[0] for n in all_nodes(model.graph) if n.op_type == "Constant")


def _invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench([str(a) for a in args]), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("opset", [12, 21])
@pytest.mark.parametrize("in_branch", [False, True], ids=["main-graph", "if-branches"])
def test_the_rewrite_lifts_matmul_weights_and_stays_exact(opset: int, in_branch: bool) -> None:
    model = constant_weights_model(opset, in_branch=in_branch)
    rewritten, report = convert(model, ConvertOptions(extended=True))
    matmul_constants = 2 if in_branch else 1
    assert report.constants_lifted == matmul_constants
    assert report.totals()["constants_lifted"] == matmul_constants
    # The pointwise conv is converted (its weight moves into a transposed initializer); the wide
    # conv is skipped and keeps its Constant byte for byte.
    assert [e.name for e in report.converted] == ["pointwise"]
    assert _constants(rewritten) == ["w_k5"]
    onnx.checker.check_model(rewritten)
    assert_equivalent(model, rewritten, _feeds(model))


def test_a_skipped_conv_alone_leaves_the_model_as_it_was() -> None:
    w_k5 = np.ones((C, C, 5), np.float32)
    graph = helper.make_graph(
        [
            _constant("w_k5", w_k5),
            helper.make_node("Conv", ["x", "w_k5"], ["y"], kernel_shape=[5], name="wide"),
        ],
        "wide_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C, "T2"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    rewritten, report = convert(model, ConvertOptions(extended=True))
    assert report.constants_lifted == 0 and not report.converted
    assert _constants(rewritten) == ["w_k5"]


@pytest.mark.parametrize("opset", [12, 21])
def test_quantize_takes_the_matmul_that_a_constant_fed(tmp_path: Path, opset: int) -> None:
    model = constant_weights_model(opset)
    onnx.save(model, tmp_path / "m.onnx")
    out = tmp_path / "m.int4.onnx"
    code, stdout, stderr = _invoke("quantize", tmp_path / "m.onnx", out, "--report-json-stdout")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["rewrite"]["constants_lifted"] == 3
    quantized = onnx.load(out)
    ops = [n.op_type for n in all_nodes(quantized.graph)]
    assert ops.count("MatMulNBits") == 2 and "MatMul" not in ops  # the model's MatMul and the pointwise conv
    assert _constants(quantized) == []
    for feeds in _feeds(model):
        session(str(out)).run(None, feeds)


@pytest.mark.parametrize("opset", [12, 21])
@pytest.mark.parametrize(
    "options",
    [("--int8-dynamic",), ("--other-weights", "int8"), ("--algorithm", "k_quant")],
    ids=["int8-dynamic", "other-weights-int8", "k_quant"],
)
def test_every_quantization_path_runs_on_constant_weights(
    tmp_path: Path, options: tuple[str, ...], opset: int
) -> None:
    model = constant_weights_model(opset)
    onnx.save(model, tmp_path / "m.onnx")
    out = tmp_path / "m.q.onnx"
    code, stdout, stderr = _invoke(
        "quantize", tmp_path / "m.onnx", out, *options, "--min-cosine", "0.9", "--report-json-stdout"
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["rewrite"]["constants_lifted"] == 3
    quantized = onnx.load(out)
    assert _constants(quantized) == []
    ops = {n.op_type for n in all_nodes(quantized.graph)}
    if options[0] == "--int8-dynamic":
        assert "MatMulInteger" in ops or "ConvInteger" in ops
    if options[0] == "--other-weights":
        # The wide conv's 80 KiB weight, an initializer now, is a candidate: stored as int8, read
        # through a per-axis DequantizeLinear from opset 13, through Cast and Mul below.
        other = data["other_weights"]
        assert [t["name"] for t in other["stored"]] == ["w_k5"] and other["kept"] == []
        assert ("DequantizeLinear" in ops) == (opset >= 13) and ("Cast" in ops) == (opset < 13)
    ref, got = session(model), session(str(out))
    for feeds in _feeds(model):
        a, b = ref.run(None, feeds)[0], got.run(None, feeds)[0]
        assert float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b))) > 0.9


@pytest.mark.network
def test_a_paddle_recognizer_with_every_weight_in_a_constant(tmp_path: Path) -> None:
    """PP-OCRv4 rec (Paddle2ONNX, opset 12) holds all its weights in Constant nodes: before, the
    defaults quantized 1 of its 14 MatMuls (0.982x of fp32) and --int8-dynamic ended as an
    internal error (exit 3, "Expected conv2d_157.w_0 to be an initializer")."""
    from model_cache import FETCHER
    from real_packages import REC

    src = FETCHER.fetch(REC)
    out = tmp_path / "rec.int4.onnx"
    code, stdout, stderr = _invoke("quantize", src, out, "--report-json-stdout", "--bench-rounds", "3")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["rewrite"]["constants_lifted"] >= 40
    assert data["quantized_nodes"] >= 8
    assert out.stat().st_size < 0.75 * src.stat().st_size
    code, _, stderr = _invoke("quantize", src, tmp_path / "rec.int8.onnx", "--int8-dynamic")
    assert code == 0, stderr  # its MatMuls in int8 (0.70x); its convs stay float (no ConvInteger)
