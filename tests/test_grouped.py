"""Grouped pointwise convs in extended mode: one MatMul per group, each with its own 2-D weight.

``Transpose -> Split(last axis, g) -> g x MatMul(·, Wt_i [C/g, M/g]) -> Concat -> [Add(bias)]
-> Transpose``. Depthwise convs (one input channel per group) stay, with ``depthwise``; without
extended mode a grouped conv stays with ``grouped``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    NP_TYPES,
    all_initializers,
    assert_equivalent,
    conv_feeds,
    conv_model,
    fused_conv_model,
    op_types,
    run,
    with_z,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert
from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits
from onnx_conv2matmul.quantize.options import QuantizeOptions

EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)


def _group_weights(model: onnx.ModelProto, group: int) -> list[np.ndarray]:
    """The conv's weight cut into the ``[C/g, M/g]`` matrices the MatMuls should read."""
    w = numpy_helper.to_array(model.graph.initializer[0])
    rows = w.shape[0] // group
    return [w[i * rows : (i + 1) * rows].reshape(rows, w.shape[1]).T for i in range(group)]


def _check_graph(rewritten: onnx.ModelProto, original: onnx.ModelProto, group: int) -> None:
    """No conv left; each group's MatMul reads its own 2-D initializer, equal to its weights."""
    ops = op_types(rewritten)
    assert "Conv" not in ops and "FusedConv" not in ops
    assert ops.count("Split") == 1 and ops.count("Concat") == 1
    inits = all_initializers(rewritten.graph)
    matmuls = [n for n in rewritten.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == group
    split = next(n for n in rewritten.graph.node if n.op_type == "Split")
    assert [m.input[0] for m in matmuls] == list(split.output)
    for matmul, expected in zip(matmuls, _group_weights(original, group), strict=True):
        weight = inits[matmul.input[1]]
        assert len(weight.dims) == 2
        np.testing.assert_array_equal(numpy_helper.to_array(weight), expected)
    assert "W" not in inits, "the grouped weight is removed"


CASES = [
    # (id, spatial, channels in, out, group, attrs, opset)
    ("1d-g2", 1, 8, 6, 2, {}, 17),
    ("1d-g4", 1, 8, 8, 4, {}, 13),
    ("2d-g2", 2, 6, 4, 2, {}, 18),  # Split takes num_outputs from opset 18
    ("2d-g3", 2, 9, 6, 3, {}, 11),
    ("3d-g2", 3, 4, 6, 2, {}, 17),
    ("1d-g2-stride", 1, 8, 6, 2, {"strides": [2]}, 17),
    ("2d-g2-pads", 2, 6, 4, 2, {"pads": [1, 0, 0, 2]}, 17),
    ("2d-g2-pads-opset-10", 2, 6, 4, 2, {"pads": [1, 1, 0, 0]}, 10),
    ("2d-g4-same", 2, 8, 8, 4, {"auto_pad": "SAME_LOWER", "strides": [2, 1]}, 18),
]


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    ("case", "spatial", "cin", "cout", "group", "attrs", "opset"), CASES, ids=[c[0] for c in CASES]
)
def test_grouped_forms_are_exact(
    case: str,
    spatial: int,
    cin: int,
    cout: int,
    group: int,
    attrs: dict[str, object],
    opset: int,
    bias: bool,
    dtype: int,
) -> None:
    model = conv_model(
        spatial=spatial,
        in_channels=cin,
        out_channels=cout,
        group=group,
        attrs=attrs,
        bias=bias,
        opset=opset,
        dtype=dtype,
    )
    rewritten, report = convert(model, EXTENDED)
    onnx.checker.check_model(rewritten, full_check=True)
    (entry,) = report.entries
    assert (entry.status, entry.reason) == (Status.CONVERTED, None)
    assert entry.extra_ops[-2:] == ["Split", "Concat"]
    assert f"group {group}" in entry.detail
    assert entry.matmul == "pw/MatMul"
    assert {n.name for n in rewritten.graph.node if n.op_type == "MatMul"} == {
        "pw/MatMul",
        *(f"pw/MatMul_{i}" for i in range(1, group)),
    }
    _check_graph(rewritten, model, group)
    np_type = NP_TYPES[dtype]
    feeds = conv_feeds(cin, spatial, dtype=np_type, lengths=(1, 6, 17), batches=(1, 2))
    assert_equivalent(model, rewritten, feeds, dtype=np_type)


def test_a_weight_shared_by_two_grouped_convs_is_stored_once() -> None:
    model = conv_model(spatial=1, in_channels=8, out_channels=8, group=4)
    model.graph.node.append(helper.make_node("Conv", ["y", "W", "B"], ["y2"], name="pw2", group=4))
    model.graph.output[0].name = "y2"
    rewritten, report = convert(model, EXTENDED)
    assert [e.status for e in report.entries] == [Status.CONVERTED] * 2
    b_inputs = [n.input[1] for n in rewritten.graph.node if n.op_type == "MatMul"]
    assert len(b_inputs) == 8 and len(set(b_inputs)) == 4
    assert set(all_initializers(rewritten.graph)) == {*b_inputs, "B"}
    assert_equivalent(model, rewritten, conv_feeds(8, 1, lengths=(3, 10)))


def test_a_grouped_fusedconv_with_z_and_an_activation() -> None:
    model = fused_conv_model(
        activation="Clip", params=[-1.0, 1.5], z=True, spatial=2, in_channels=8, out_channels=4, group=2
    )
    rewritten, report = convert(model, EXTENDED)
    (entry,) = report.entries
    assert (entry.op_type, entry.status) == ("FusedConv", Status.CONVERTED)
    assert entry.extra_ops == ["Split", "Concat", "Clip"]
    _check_graph(rewritten, model, 2)
    assert [op for op in op_types(rewritten) if op != "Constant"][-3:] == ["Transpose", "Add", "Clip"]
    assert_equivalent(model, rewritten, with_z(conv_feeds(8, 2, lengths=(2, 9)), 4))


@pytest.mark.parametrize(
    ("options", "reason"),
    [(ConvertOptions(allow_added_transposes=True), SkipReason.GROUPED), (EXTENDED, None)],
    ids=["default", "extended"],
)
def test_extended_mode_converts_grouped_but_never_depthwise(
    options: ConvertOptions, reason: SkipReason | None
) -> None:
    grouped = conv_model(spatial=1, in_channels=4, out_channels=4, group=2, name="grouped")
    depthwise = conv_model(spatial=1, in_channels=4, out_channels=4, group=4, name="depthwise")
    grouped.graph.node.append(depthwise.graph.node[0])
    grouped.graph.node[1].input[:] = ["y", "W_dw"]
    grouped.graph.node[1].output[0] = "y2"
    dw = numpy_helper.to_array(depthwise.graph.initializer[0])
    grouped.graph.initializer.append(numpy_helper.from_array(dw, "W_dw"))
    grouped.graph.output[0].name = "y2"
    rewritten, report = convert(grouped, options)
    assert [(e.name, e.reason) for e in report.entries] == [
        ("grouped", reason),
        ("depthwise", SkipReason.DEPTHWISE),
    ]
    assert_equivalent(grouped, rewritten, conv_feeds(4, 1, lengths=(4, 11)))


def test_grouped_convs_between_the_models_transposes_break_even() -> None:
    """Transpose -> grouped pw -> Relu -> grouped pw -> Transpose: every Transpose cancels,
    by default, as for ungrouped convs."""
    rng = np.random.default_rng(3)
    c = 8
    inits = [
        numpy_helper.from_array((rng.standard_normal((c, c // g, 1)) / 2).astype(np.float32), f"w{g}")
        for g in (2, 4)
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
            helper.make_node("Conv", ["t", "w2"], ["a"], name="g2", group=2),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("Conv", ["r", "w4"], ["b"], name="g4", group=4),
            helper.make_node("Transpose", ["b"], ["y"], perm=[0, 2, 1]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", c])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, report = convert(model, ConvertOptions(extended=True))
    assert len(report.converted) == 2
    assert (report.transposes_before, report.transposes_after) == (2, 0)
    feeds = [{"x": rng.standard_normal((n, t, c)).astype(np.float32)} for n, t in ((1, 4), (3, 21))]
    assert_equivalent(model, rewritten, feeds)


def test_quantize_takes_every_group_weight_and_a_fusedconvs() -> None:
    """A grouped conv then a FusedConv(Relu): all three MatMul weights become MatMulNBits."""
    c = 64
    model = conv_model(spatial=1, in_channels=c, out_channels=c, group=2, name="grouped")
    fused = fused_conv_model(activation="Relu", in_channels=c, out_channels=c, name="fused", seed=1)
    node = fused.graph.node[0]
    node.input[:] = ["y", "W_fused", "B_fused"]
    node.output[0] = "y2"
    for tensor, name in zip(fused.graph.initializer, ("W_fused", "B_fused"), strict=True):
        model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(tensor) / 8, name))
    model.graph.node.append(node)
    model.graph.output[0].name = "y2"
    model.opset_import.extend(fused.opset_import[1:])
    rewritten, report = convert(model, EXTENDED)
    assert [(e.op_type, e.status) for e in report.entries] == [
        ("Conv", Status.CONVERTED),
        ("FusedConv", Status.CONVERTED),
    ]
    ir_model = ir.serde.deserialize_model(rewritten)
    quantize_matmul_nbits(ir_model, QuantizeOptions(bits=4, block_size=16))
    quantized = ir.serde.serialize_model(ir_model)
    ops = op_types(quantized)
    assert ops.count("MatMulNBits") == 3 and "MatMul" not in ops
    x = np.random.default_rng(0).standard_normal((2, c, 50)).astype(np.float32)
    (expected,), (actual,) = run(model, {"x": x}), run(quantized, {"x": x})
    cosine = float(
        np.dot(expected.ravel(), actual.ravel()) / np.linalg.norm(expected) / np.linalg.norm(actual)
    )
    assert cosine > 0.98


@pytest.mark.parametrize("groups", [(1, 2), (2, 4)], ids=["plain-and-grouped", "two-group-counts"])
def test_a_weight_read_with_two_group_counts_is_not_stored_twice(groups: tuple[int, int]) -> None:
    """W [8, 4, 1] read by convs of different ``group`` (4 and 8, or 8 and 16 input channels):
    each would store it in another form, so both stay, with ``weight_shared``."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 4, 1)).astype(np.float32), "W")
    inputs = [helper.make_tensor_value_info(f"x{g}", TensorProto.FLOAT, ["N", 4 * g, "T"]) for g in groups]
    outputs = [helper.make_tensor_value_info(f"y{g}", TensorProto.FLOAT, ["N", 8, "T"]) for g in groups]
    nodes = [helper.make_node("Conv", [f"x{g}", "W"], [f"y{g}"], name=f"conv{g}", group=g) for g in groups]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, report = convert(model, EXTENDED)
    assert [(e.status, e.reason) for e in report.entries] == [(Status.SKIPPED, SkipReason.WEIGHT_SHARED)] * 2
    assert op_types(rewritten) == ["Conv", "Conv"]
    assert [t.name for t in rewritten.graph.initializer] == ["W"]
    feeds = {f"x{g}": rng.standard_normal((2, 4 * g, 5)).astype(np.float32) for g in groups}
    for expected, actual in zip(run(model, feeds), run(rewritten, feeds), strict=True):
        np.testing.assert_array_equal(expected, actual)
