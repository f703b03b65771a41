"""Tests written to kill mutants of ``rewrite/`` that survived (docs/mutation.md).

The names of what a rewrite emits matter: ``matmul`` in the report is what a user puts in a
quantizer's exclude list, and every emitted node and value needs a name of its own for the saved
model to be valid and readable. Each test that rewrites a model runs it against the original in
onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from helpers import (
    ALL,
    assert_equivalent,
    conv_feeds,
    conv_model,
    fused_conv_model,
    gemm_model,
    unnamed_conv_output,
    with_z,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert

EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)


def _nodes(model: onnx.ModelProto) -> list[tuple[str, str, list[str], list[str]]]:
    return [(n.op_type, n.name, list(n.input), list(n.output)) for n in model.graph.node]


def _grouped(base: str, out: str) -> list[tuple[str, str, list[str], list[str]]]:
    return [
        ("Transpose", f"{base}/Transpose", ["x"], [f"{base}/channels_last"]),
        ("Split", f"{base}/Split", [f"{base}/channels_last"], [f"{base}/group0", f"{base}/group1"]),
        ("MatMul", f"{base}/MatMul", [f"{base}/group0", "W_matmul_group0"], [f"{base}/matmul0"]),
        ("MatMul", f"{base}/MatMul_1", [f"{base}/group1", "W_matmul_group1"], [f"{base}/matmul1"]),
        ("Concat", f"{base}/Concat", [f"{base}/matmul0", f"{base}/matmul1"], [f"{base}/matmul"]),
        ("Add", f"{base}/Add", [f"{base}/matmul", "B"], [f"{base}/biased"]),
        ("Transpose", f"{base}/Transpose_1", [f"{base}/biased"], [out]),
    ]


@pytest.mark.parametrize(("name", "base"), [("gc", "gc"), ("", "y")])
def test_a_grouped_conv_emits_named_nodes_and_values(name: str, base: str) -> None:
    """Named after the conv, else after its output: the Split, each group's part and MatMul."""
    model = conv_model(group=2, in_channels=6, out_channels=4, name=name)
    rewritten, report = convert(model, EXTENDED)
    (entry,) = report.entries
    assert (entry.status, entry.matmul, entry.extra_ops) == (
        Status.CONVERTED,
        f"{base}/MatMul",
        ["Split", "Concat"],
    )
    assert _nodes(rewritten) == _grouped(base, "y")
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(1, 5)))


def test_a_grouped_conv_without_any_name_is_named_after_conv() -> None:
    """Only a model built in memory has an unnamed conv output; the new nodes still get names."""
    original = conv_model(group=2, in_channels=6, out_channels=4, name="")
    model = unnamed_conv_output(original)
    rewritten, report = convert(model, EXTENDED)
    assert [(e.status, e.matmul) for e in report.entries] == [(Status.CONVERTED, "Conv/MatMul")]
    assert isinstance(rewritten, ir.Model)
    made = _nodes(ir.serde.serialize_model(rewritten))
    assert made[-1][:2] == ("Identity", "keep")
    expected = _grouped("Conv", "Conv/transposed")
    assert [m[:3] for m in made[:-1]] == [e[:3] for e in expected]
    assert [m[3] for m in made[:-2]] == [e[3] for e in expected[:-1]]
    assert_equivalent(original, ir.serde.serialize_model(rewritten), conv_feeds(6, 1, lengths=(1, 5)))


@pytest.mark.parametrize(
    ("activation", "params", "detail"),
    [
        ("LeakyRelu", [0.2], "activation LeakyRelu(0.2)"),
        ("HardSigmoid", [0.2, 0.5], "activation HardSigmoid(0.2, 0.5)"),
        ("Relu", None, "activation Relu"),
    ],
)
def test_a_fused_conv_s_detail_shows_its_activation_parameters(
    activation: str, params: list[float] | None, detail: str
) -> None:
    model = fused_conv_model(activation=activation, params=params)
    rewritten, report = convert(model, ALL)
    assert [(e.status, e.detail) for e in report.entries] == [(Status.CONVERTED, detail)]
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(1, 5)))


def test_clip_takes_its_bounds_as_inputs_from_opset_11_exactly() -> None:
    model = fused_conv_model(activation="Clip", params=[-0.5, 0.7], opset=11)
    rewritten, _ = convert(model, ALL)
    (clip,) = [n for n in rewritten.graph.node if n.op_type == "Clip"]
    assert (list(clip.input[1:]), list(clip.attribute)) == (["pw/clip_min", "pw/clip_max"], [])
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(1, 5)))


def _gemm(a: str, dtype: int, opset: int) -> onnx.ModelProto:
    """One Gemm ``y = a @ B`` on a [M, 6] input, its B a [6, 5] initializer."""
    weights = np.random.default_rng(0).standard_normal(30).tolist()
    graph = helper.make_graph(
        [helper.make_node("Gemm", [a, "B"], ["y"], name="fc")],
        "g",
        [helper.make_tensor_value_info("a", dtype, ["M", 6])],
        [helper.make_tensor_value_info("y", dtype, ["M", 5])],
        [helper.make_tensor("B", dtype, [6, 5], weights)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_a_bfloat16_gemm_converts_from_opset_13_exactly() -> None:
    """onnxruntime runs no bfloat16 MatMul on CPU: the plan and the graph are checked."""
    rewritten, report = convert(_gemm("a", TensorProto.BFLOAT16, 13), ALL)
    assert [(e.status, e.matmul) for e in report.entries] == [(Status.CONVERTED, "fc/MatMul")]
    assert [n.op_type for n in rewritten.graph.node] == ["MatMul"]
    _, report = convert(_gemm("a", TensorProto.BFLOAT16, 12), ALL)
    assert [(e.reason, e.detail) for e in report.entries] == [
        (SkipReason.OPSET_UNSUPPORTED, "bfloat16 MatMul needs opset 13, model has 12")
    ]


def test_a_gemm_without_its_input_a_stays() -> None:
    """An empty name for A (a model onnx's checker refuses, read as it is): skipped, not a crash."""
    model = _gemm("", TensorProto.FLOAT, 17)
    rewritten, report = convert(model, ALL)
    assert [(e.status, e.reason, e.detail) for e in report.entries] == [
        (Status.SKIPPED, SkipReason.INVALID_ATTRIBUTES, "Gemm without input A or B, or not with one output")
    ]
    assert [n.op_type for n in rewritten.graph.node] == ["Gemm"]


def test_an_unknown_activation_is_named_with_those_known() -> None:
    _, report = convert(fused_conv_model(activation="Elu", params=[1.0]), ALL)
    assert [(e.status, e.detail) for e in report.entries] == [
        (Status.SKIPPED, "activation 'Elu' is not one of Relu, Tanh, Sigmoid, LeakyRelu, HardSigmoid, Clip")
    ]


def _gemm_with_c(a_shape: list[int | str] | None, c: np.ndarray, *, c_node: bool = False) -> onnx.ModelProto:
    """``y = a @ B + C``, B [6, 5], with C an initializer or a Constant node's output."""
    rng = np.random.default_rng(0)
    b = helper.make_tensor("B", TensorProto.FLOAT, [6, 5], rng.standard_normal(30).tolist())
    c_tensor = onnx.numpy_helper.from_array(c, "C")
    nodes = [helper.make_node("Constant", [], ["C"], value=c_tensor)] if c_node else []
    nodes.append(helper.make_node("Gemm", ["a", "B", "C"], ["y"], name="fc"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [b] + ([] if c_node else [c_tensor]),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("a_shape", [None, ["M", 6]], ids=["a-unknown", "a-symbolic"])
def test_a_c_of_fixed_rows_converts_when_a_s_rows_are_not_known(a_shape: list[int | str] | None) -> None:
    """C [3, 5] fits an A of 3 rows: with A's rows unknown or symbolic, nothing contradicts it."""
    c = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    model = _gemm_with_c(a_shape, c)
    rewritten, report = convert(model, ALL)
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert [n.op_type for n in rewritten.graph.node] == ["MatMul", "Add"]
    a = np.random.default_rng(3).standard_normal((3, 6)).astype(np.float32)
    assert_equivalent(model, rewritten, [{"a": a}])


@pytest.mark.parametrize(
    ("c_shape", "c_node", "detail"),
    [
        ((7,), False, "C shape [7] does not broadcast to [M, 5]"),
        ((7,), True, "C shape [7] does not broadcast to [M, 5]"),
    ],
    ids=["initializer", "constant-node"],
)
def test_a_c_that_contradicts_the_weight_is_named(
    c_shape: tuple[int, ...], c_node: bool, detail: str
) -> None:
    c = np.zeros(c_shape, np.float32)
    _, report = convert(_gemm_with_c(["M", 6], c, c_node=c_node), ALL)
    assert [(e.status, e.reason, e.detail) for e in report.entries] == [
        (Status.SKIPPED, SkipReason.INVALID_ATTRIBUTES, detail)
    ]


def test_a_symbolic_row_of_c_is_shown_unknown() -> None:
    model = gemm_model(c="MN")
    (c_input,) = [i for i in model.graph.input if i.name == "C"]
    c_input.type.tensor_type.shape.dim[1].dim_value = 7
    _, report = convert(model, ALL)
    assert [(e.reason, e.detail) for e in report.entries] == [
        (SkipReason.INVALID_ATTRIBUTES, "C shape [None, 7] does not broadcast to [M, 5]")
    ]


def test_a_c_of_another_type_is_named() -> None:
    _, report = convert(_gemm_with_c(["M", 6], np.zeros(5, np.float64)), ALL)
    assert [(e.reason, e.detail) for e in report.entries] == [
        (SkipReason.INVALID_ATTRIBUTES, "C type DOUBLE != weight type FLOAT")
    ]


def test_a_c_input_not_read_under_beta_0_stays_an_input() -> None:
    """beta 0 and a C that is a graph input: C is not read; the model keeps its input."""
    model = gemm_model(c="N", c_source="input", beta=0.0)
    rewritten, report = convert(model, ALL)
    assert [(e.status, e.detail) for e in report.entries] == [
        (Status.CONVERTED, "transB, beta 0, C not read")
    ]
    assert [i.name for i in rewritten.graph.input] == ["a", "C"]
    rng = np.random.default_rng(4)
    feeds = {
        "a": rng.standard_normal((3, 6)).astype(np.float32),
        "C": rng.standard_normal(5).astype(np.float32),
    }
    assert_equivalent(model, rewritten, [feeds])


@pytest.mark.parametrize(("activation", "detail"), [("Relu", "activation Relu, input Z"), (None, "input Z")])
def test_a_fused_conv_s_detail_names_its_input_z(activation: str | None, detail: str) -> None:
    model = fused_conv_model(activation=activation, z=True, out_channels=4)
    rewritten, report = convert(model, ALL)
    assert [(e.status, e.detail) for e in report.entries] == [(Status.CONVERTED, detail)]
    assert_equivalent(model, rewritten, with_z(conv_feeds(6, 1, lengths=(1, 5)), 4))


def test_a_fused_conv_s_activation_converts_from_opset_6_exactly() -> None:
    """onnxruntime runs no model below opset 7: the plan is checked."""
    _, report = convert(fused_conv_model(activation="Relu", opset=6), ALL)
    assert [(e.status, e.detail) for e in report.entries] == [(Status.CONVERTED, "activation Relu")]
    _, report = convert(fused_conv_model(activation="Relu", opset=5), ALL)
    assert [(e.reason, e.detail) for e in report.entries] == [
        (SkipReason.OPSET_UNSUPPORTED, "Relu needs opset 6, model has 5")
    ]


@pytest.mark.parametrize("attrs", [{"pads": [1, 2]}, {"strides": [2]}], ids=["pads", "strides"])
def test_the_report_names_the_matmul_after_a_pad_or_a_slice(attrs: dict[str, object]) -> None:
    """``matmul`` is what a user excludes from quantization: the MatMul's name, whatever comes before."""
    model = conv_model(attrs=attrs)
    rewritten, report = convert(model, EXTENDED)
    (matmul,) = [n.name for n in rewritten.graph.node if n.op_type == "MatMul"]
    assert [(e.status, e.matmul) for e in report.entries] == [(Status.CONVERTED, matmul)]
    assert matmul == "pw/MatMul"
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(1, 8)))


def test_a_fused_conv_s_z_and_activation_come_after_named_values() -> None:
    model = fused_conv_model(activation="Relu", z=True, out_channels=4)
    rewritten, _ = convert(model, ALL)
    assert _nodes(rewritten) == [
        ("Transpose", "pw/Transpose", ["x"], ["pw/channels_last"]),
        ("MatMul", "pw/MatMul", ["pw/channels_last", "W_matmul"], ["pw/matmul"]),
        ("Add", "pw/Add", ["pw/matmul", "B"], ["pw/biased"]),
        ("Transpose", "pw/Transpose_1", ["pw/biased"], ["pw/channels_first"]),
        ("Add", "pw/Add_1", ["pw/channels_first", "z"], ["pw/summed"]),
        ("Relu", "pw/Relu", ["pw/summed"], ["y"]),
    ]
    assert_equivalent(model, rewritten, with_z(conv_feeds(6, 1, lengths=(1, 5)), 4))


def test_a_c_from_a_constant_holding_a_float_converts() -> None:
    """A Constant may hold its value as ``value_float``: not a tensor the rewrite reads, but no error."""
    rng = np.random.default_rng(0)
    b = helper.make_tensor("B", TensorProto.FLOAT, [6, 5], rng.standard_normal(30).tolist())
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["C"], value_float=2.0),
            helper.make_node("Gemm", ["a", "B", "C"], ["y"], name="fc"),
        ],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 5])],
        [b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rewritten, report = convert(model, ALL)
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert_equivalent(model, rewritten, [{"a": rng.standard_normal((3, 6)).astype(np.float32)}])
