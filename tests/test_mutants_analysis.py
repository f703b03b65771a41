"""Tests written to kill mutants of the analysis, rewrite and cleanup that survived (docs/mutation.md).

Each pins a boundary or a text the other tests left free: the lowest opset at which an
emitted op exists, and the details that name an unnamed node or a model-local function.
Opset-2 and bfloat16 models cannot run in onnxruntime on CPU, so these check the plan and
the graph, not the numbers.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import (
    ALL,
    assert_equivalent,
    bfloat16_conv_model,
    conv_in_function_model,
    conv_model,
    op_types,
    unnamed_conv_output,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, convert
from onnx_conv2matmul.rewrite.report import Status

EXTENDED_ALL = ConvertOptions(extended=True, allow_added_transposes=True)


def test_bfloat16_converts_from_opset_13_exactly() -> None:
    rewritten, report = convert(bfloat16_conv_model(13), ALL)
    assert [(e.status, e.reason) for e in report.entries] == [(Status.CONVERTED, None)]
    assert op_types(rewritten) == ["Transpose", "MatMul", "Transpose"]
    (weight,) = rewritten.graph.initializer
    assert weight.data_type == TensorProto.BFLOAT16 and list(weight.dims) == [6, 5]
    _, report = convert(bfloat16_conv_model(12), ALL)
    assert [e.reason for e in report.entries] == [SkipReason.OPSET_UNSUPPORTED]


def test_pads_convert_from_opset_2_exactly() -> None:
    """Pad exists from opset 2 (pads as an attribute); opset 1 has no Pad to emit."""
    model = conv_model(spatial=1, attrs={"pads": [1, 1]}, opset=2)
    rewritten, report = convert(model, EXTENDED_ALL)
    assert [(e.status, e.extra_ops) for e in report.entries] == [(Status.CONVERTED, ["Pad"])]
    (pad,) = [n for n in rewritten.graph.node if n.op_type == "Pad"]
    assert {a.name: helper.get_attribute_value(a) for a in pad.attribute}["pads"] == [0, 1, 0, 0, 1, 0]
    _, report = convert(conv_model(spatial=1, attrs={"pads": [1, 1]}, opset=1), EXTENDED_ALL)
    assert [e.reason for e in report.entries] == [SkipReason.OPSET_UNSUPPORTED]


def test_a_weight_shared_with_an_unnamed_node_says_so() -> None:
    model = conv_model(spatial=1, bias=False, name="pw")
    model.graph.node.append(helper.make_node("Relu", ["W"], ["r"]))  # no name
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [5, 6, 1]))
    _, report = convert(model, ALL)
    (entry,) = report.entries
    assert entry.reason is SkipReason.WEIGHT_SHARED
    assert entry.detail == "'W' also feeds Relu '(unnamed)', which stays"


def test_a_conv_in_a_local_function_has_a_fixed_detail() -> None:
    model = conv_in_function_model(1)
    _, report = convert(model, ALL)
    (entry,) = report.entries
    assert (entry.status, entry.reason) == (Status.SKIPPED, SkipReason.IN_FUNCTION)
    assert entry.detail == "Conv nodes inside model-local functions are not rewritten"


def test_nodes_made_for_a_conv_without_any_name_are_named_after_conv() -> None:
    """Only a model built in memory has an unnamed conv output; the new nodes still get names."""
    model = unnamed_conv_output(conv_model(spatial=1, bias=False, name=""))
    rewritten, report = convert(model, ALL)
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    made = [n.name for n in rewritten.graph if n.op_type != "Identity"]
    assert made and all(name is not None and name.startswith("Conv/") for name in made), made


def _two_chains() -> onnx.ModelProto:
    """Three convs, each ending in the model's Transpose to channels-last and a graph output.

    ``a`` reads ``x1`` channels-first (no Transpose above its chain); ``b`` and ``c`` both read
    ``x2`` through the model's Transpose to channels-first: two chains read through it, so it
    is removed only once both have collapsed.
    """
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array(rng.standard_normal((5, 6, 1)).astype(np.float32), name)
        for name in ("Wa", "Wb", "Wc")
    ]
    nodes = [
        helper.make_node("Conv", ["x1", "Wa"], ["ca"], name="a"),
        helper.make_node("Transpose", ["ca"], ["y1"], name="a_last", perm=[0, 2, 1]),
        helper.make_node("Transpose", ["x2"], ["t2"], name="b_first", perm=[0, 2, 1]),
        helper.make_node("Conv", ["t2", "Wb"], ["cb"], name="b"),
        helper.make_node("Transpose", ["cb"], ["y2"], name="b_last", perm=[0, 2, 1]),
        helper.make_node("Conv", ["t2", "Wc"], ["cc"], name="c"),
        helper.make_node("Transpose", ["cc"], ["y3"], name="c_last", perm=[0, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x1", TensorProto.FLOAT, ["N", 6, "T"]),
            helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["N", "T", 6]),
        ],
        [
            helper.make_tensor_value_info("y1", TensorProto.FLOAT, ["N", "T", 5]),
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["N", "T", 5]),
            helper.make_tensor_value_info("y3", TensorProto.FLOAT, ["N", "T", 5]),
        ],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_transpose_above_a_later_chain_goes_when_an_earlier_chain_has_none() -> None:
    model = _two_chains()
    rewritten, report = convert(model, ConvertOptions())
    assert [e.status for e in report.entries] == [Status.CONVERTED] * 3
    # a: ours in stays, ours out and a_last cancel. b and c: their Transposes cancel, then
    # b_first, which nothing reads any more.
    assert (report.transposes_before, report.transposes_after, report.transposes_cancelled) == (4, 1, 9)
    assert op_types(rewritten) == ["Transpose", "MatMul", "MatMul", "MatMul"]
    assert [o.name for o in rewritten.graph.output] == ["y1", "y2", "y3"]
    rng = np.random.default_rng(1)
    feeds = [
        {
            "x1": rng.standard_normal((2, 6, t)).astype(np.float32),
            "x2": rng.standard_normal((2, t, 6)).astype(np.float32),
        }
        for t in (3, 7)
    ]
    assert_equivalent(model, rewritten, feeds)


def test_a_converted_weight_that_is_a_graph_output_stays_and_the_next_one_goes() -> None:
    """The first weight is also a graph output, so it is kept; the second is still removed."""
    model = _two_chains()
    model.graph.output.append(helper.make_tensor_value_info("Wa", TensorProto.FLOAT, [5, 6, 1]))
    rewritten, report = convert(model, ConvertOptions())
    assert [e.status for e in report.entries] == [Status.CONVERTED] * 3
    names = sorted(i.name for i in rewritten.graph.initializer)
    assert "Wa" in names and "Wb" not in names and "Wc" not in names and len(names) == 4, names
    rng = np.random.default_rng(1)
    feeds = [
        {
            "x1": rng.standard_normal((2, 6, 4)).astype(np.float32),
            "x2": rng.standard_normal((2, 4, 6)).astype(np.float32),
        }
    ]
    assert_equivalent(model, rewritten, feeds)


def test_skipped_entries_list_no_extra_ops_and_know_their_weight_bytes() -> None:
    """A conv dropped for a shared weight lists no emitted ops; weight bytes are params x itemsize."""
    model = conv_model(spatial=1, bias=False, name="pw", dtype=TensorProto.FLOAT16)
    model.graph.node.append(helper.make_node("Relu", ["W"], ["r"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT16, [5, 6, 1]))
    _, report = convert(model, EXTENDED_ALL)
    (entry,) = report.entries
    assert (entry.reason, entry.extra_ops) == (SkipReason.WEIGHT_SHARED, [])
    assert (entry.params, entry.weight_bytes) == (30, 60)
    _, report = convert(conv_model(spatial=2, in_channels=3, out_channels=4), ALL)
    (entry,) = report.entries
    assert (entry.params, entry.weight_bytes) == (12, 48)


def test_an_unnamed_conv_in_a_local_function_is_reported_without_a_name() -> None:
    model = conv_in_function_model(1, conv_name="")
    _, report = convert(model, ALL)
    assert [(e.name, e.reason) for e in report.entries] == [("", SkipReason.IN_FUNCTION)]


@pytest.mark.parametrize("source", ["constant", "initializer"])
def test_every_dead_weight_is_counted(source: str) -> None:
    """Two convs with their own weights: both old weights go, and the report counts both."""
    model = conv_model(spatial=1, bias=False, name="a", weight_source=source)
    rng = np.random.default_rng(5)
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((5, 5, 1)).astype(np.float32), "W2")
    if source == "constant":
        model.graph.node.append(helper.make_node("Constant", [], ["W2"], value=w2))
    else:
        model.graph.initializer.append(w2)
    model.graph.node.append(helper.make_node("Conv", ["y", "W2"], ["z"], name="b"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 5, "o0"]))
    rewritten, report = convert(model, ALL)
    assert [e.status for e in report.entries] == [Status.CONVERTED] * 2
    assert report.tensors_removed == 2
    assert op_types(rewritten).count("Constant") == 0
    rng = np.random.default_rng(6)
    feeds = [{"x": rng.standard_normal((2, 6, t)).astype(np.float32)} for t in (3, 8)]
    assert_equivalent(model, rewritten, feeds)
