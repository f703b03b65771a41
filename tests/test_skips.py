"""Every skip reason: the node is left exactly as it was and the reason is reported."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import ALL, conv_model, op_types
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert


def _skip(model: onnx.ModelProto, options: ConvertOptions, reason: SkipReason) -> str:
    before = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    rewritten, report = convert(model, options)
    convs = [e for e in report.entries if e.op_type != "Constant"]
    assert [e.status for e in convs] == [Status.SKIPPED]
    assert convs[0].reason is reason
    after = [(n.op_type, list(n.input), list(n.output)) for n in rewritten.graph.node]
    assert after == before, "a skipped node must stay untouched"
    assert {i.name for i in rewritten.graph.initializer} == {i.name for i in model.graph.initializer}
    return convs[0].detail


def test_kernel_not_pointwise() -> None:
    detail = _skip(
        conv_model(spatial=1, kernel=[3]),
        ConvertOptions(allow_added_transposes=True),
        SkipReason.KERNEL_NOT_POINTWISE,
    )
    assert "[3]" in detail


def test_kernel_2d_partly_pointwise() -> None:
    _skip(
        conv_model(spatial=2, kernel=[1, 3]),
        ConvertOptions(allow_added_transposes=True),
        SkipReason.KERNEL_NOT_POINTWISE,
    )


def test_grouped() -> None:
    model = conv_model(spatial=1, in_channels=3, out_channels=6, attrs={"group": 2})
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.GROUPED)


def test_depthwise_k9_is_kernel_not_pointwise() -> None:
    model = conv_model(spatial=1, in_channels=1, out_channels=6, kernel=[9], attrs={"group": 6})
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.KERNEL_NOT_POINTWISE)


def test_weight_not_constant() -> None:
    _skip(
        conv_model(spatial=1, weight_source="input"),
        ConvertOptions(allow_added_transposes=True),
        SkipReason.WEIGHT_NOT_CONSTANT,
    )


def test_weight_overridable() -> None:
    model = conv_model(spatial=1, weight_source="input_initializer")
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.WEIGHT_OVERRIDABLE)


def test_weight_computed_at_run_time() -> None:
    model = conv_model(spatial=1)
    # W -> Identity -> Conv: not a constant the rewrite can see through.
    model.graph.node.insert(0, helper.make_node("Identity", ["W"], ["W2"]))
    model.graph.node[1].input[1] = "W2"
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.WEIGHT_NOT_CONSTANT)


@pytest.mark.parametrize(
    "attrs",
    [{"strides": [2]}, {"pads": [1, 0]}, {"auto_pad": "VALID"}, {"auto_pad": "SAME_UPPER"}],
)
def test_needs_extended_mode(attrs: dict[str, object]) -> None:
    _skip(
        conv_model(spatial=1, attrs=attrs),
        ConvertOptions(allow_added_transposes=True),
        SkipReason.NEEDS_EXTENDED_MODE,
    )


def test_dilation_needs_opt_in() -> None:
    model = conv_model(spatial=1, attrs={"dilations": [2]})
    _skip(model, ConvertOptions(allow_added_transposes=True, extended=True), SkipReason.DILATION_NEEDS_OPT_IN)


def test_dilation_above_max() -> None:
    model = conv_model(spatial=2, attrs={"dilations": [1, 5]})
    options = ConvertOptions(allow_added_transposes=True, allow_non_unit_dilation=True, max_dilation=4)
    assert "5" in _skip(model, options, SkipReason.DILATION_ABOVE_MAX)
    _converted, report = convert(
        model, ConvertOptions(allow_added_transposes=True, allow_non_unit_dilation=True, max_dilation=5)
    )
    assert report.entries[0].status is Status.CONVERTED


def test_opset_unsupported_for_strides() -> None:
    model = conv_model(spatial=1, attrs={"strides": [2]}, opset=9)
    _skip(model, ConvertOptions(allow_added_transposes=True, extended=True), SkipReason.OPSET_UNSUPPORTED)


def test_unsupported_dtype() -> None:
    model = conv_model(spatial=1)
    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.int8)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "W"))
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.UNSUPPORTED_DTYPE)


def test_unsupported_rank() -> None:
    model = conv_model(spatial=1)
    w = numpy_helper.to_array(model.graph.initializer[0]).reshape(5, 6)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "W"))
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.UNSUPPORTED_RANK)


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [3]},
        {"strides": [1, 1]},
        {"pads": [-1, 0]},
        {"auto_pad": "SAME_UPPER", "pads": [0, 0]},
    ],
)
def test_invalid_attributes(attrs: dict[str, object]) -> None:
    model = conv_model(spatial=1, attrs=attrs)
    _skip(model, ConvertOptions(allow_added_transposes=True, extended=True), SkipReason.INVALID_ATTRIBUTES)


def test_bias_shape_mismatch() -> None:
    model = conv_model(spatial=1)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.zeros(3, np.float32), "B"))
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.INVALID_ATTRIBUTES)


@pytest.mark.parametrize(("op_type", "domain"), [("ConvInteger", ""), ("FusedConv", "com.microsoft")])
def test_unsupported_op(op_type: str, domain: str) -> None:
    model = conv_model(spatial=1, bias=False)
    node = model.graph.node[0]
    node.op_type = op_type
    node.domain = domain
    _skip(model, ConvertOptions(allow_added_transposes=True), SkipReason.UNSUPPORTED_OP)


def test_every_reason_is_documented_and_tested() -> None:
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    tests = pathlib.Path(__file__).read_text()
    for reason in SkipReason:
        assert f"`{reason.value}`" in readme, f"{reason.value} missing from README"
        assert f"SkipReason.{reason.name}" in tests, f"{reason.name} has no test"
        assert reason.description


def test_conv_without_type_info_in_a_mixed_model() -> None:
    """A model with a 3x1 conv and a pointwise one: only the pointwise one changes."""
    a = conv_model(spatial=1, kernel=[3], name="k3", attrs={"pads": [1, 1]})
    rng = np.random.default_rng(3)
    w2 = numpy_helper.from_array(rng.standard_normal((4, 5, 1)).astype(np.float32), "W2")
    a.graph.initializer.append(w2)
    a.graph.node.append(helper.make_node("Conv", ["y", "W2"], ["z"], name="pw"))
    a.graph.output[0].CopyFrom(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4, "T"]))
    rewritten, report = convert(a, ALL)
    assert [(e.name, e.status) for e in report.entries] == [
        ("k3", Status.SKIPPED),
        ("pw", Status.CONVERTED),
    ]
    assert op_types(rewritten) == ["Conv", "Transpose", "MatMul", "Transpose"]


def test_weight_shared_with_a_node_that_stays() -> None:
    """Converting would keep both W (for the 3x1 conv) and its transposed copy."""
    model = conv_model(spatial=1, bias=False, name="pw")
    model.graph.node.append(helper.make_node("Conv", ["x", "W"], ["z"], name="strided", strides=[2]))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 5, "T2"]))
    rewritten, report = convert(model, ALL)
    assert [(e.name, e.reason) for e in report.entries] == [
        ("pw", SkipReason.WEIGHT_SHARED),
        ("strided", SkipReason.NEEDS_EXTENDED_MODE),
    ]
    assert "strided" in report.entries[0].detail
    assert op_types(rewritten) == ["Conv", "Conv"]
    # With extended mode both convert and share one transposed weight.
    _, report = convert(model, ConvertOptions(allow_added_transposes=True, extended=True))
    assert [e.status for e in report.entries] == [Status.CONVERTED, Status.CONVERTED]


def test_ambiguous_weight_name_across_scopes() -> None:
    """A branch initializer named like a main-graph one: runtimes may pick either."""
    rng = np.random.default_rng(0)
    outer = numpy_helper.from_array(rng.standard_normal((4, 4, 1)).astype(np.float32), "w")
    inner = numpy_helper.from_array(rng.standard_normal((4, 4, 1)).astype(np.float32), "w")
    branch = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["b_out"], name="branch_conv")],
        "then",
        [],
        [helper.make_tensor_value_info("b_out", TensorProto.FLOAT, None)],
        [inner],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["y0"], name="main_conv"),
            helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, "T"]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y0", TensorProto.FLOAT, None),
        ],
        [outer],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, report = convert(model, ALL)
    assert {e.name: e.reason for e in report.entries} == {
        "main_conv": SkipReason.AMBIGUOUS_WEIGHT,
        "branch_conv": SkipReason.AMBIGUOUS_WEIGHT,
    }


def test_ir_version_3_cannot_take_new_initializers() -> None:
    model = conv_model(spatial=1, weight_source="constant", bias=False, opset=8)
    model.ir_version = 3
    rewritten, report = convert(model, ALL)
    assert report.entries[0].reason is SkipReason.OPSET_UNSUPPORTED
    assert "IR version 3" in report.entries[0].detail
    assert "Conv" in op_types(rewritten)


def test_conv_in_a_local_function_is_reported() -> None:
    function = helper.make_function(
        "local",
        "PwConv",
        ["x", "w"],
        ["y"],
        [helper.make_node("Conv", ["x", "w"], ["y"], name="fn_conv")],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = conv_model(spatial=1, bias=False)
    model.graph.node[0].op_type = "PwConv"
    model.graph.node[0].domain = "local"
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    _, report = convert(model, ALL)
    assert [(e.name, e.reason, e.scope) for e in report.entries] == [
        ("fn_conv", SkipReason.IN_FUNCTION, "function local::PwConv")
    ]


def test_adds_transposes() -> None:
    """A lone conv between a graph input and output: both of its Transposes would stay."""
    detail = _skip(conv_model(spatial=1), ConvertOptions(), SkipReason.ADDS_TRANSPOSES)
    assert "2 Transpose nodes" in detail and "--allow-added-transposes" in detail
