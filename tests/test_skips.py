"""Every skip reason: the reason is reported and the model is left exactly as it was.

``EXAMPLES`` holds, for every member of :class:`SkipReason`, small models whose only
conv is skipped for that reason (and for no other), with the options that make it so.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    ALL,
    bfloat16_conv_model,
    conv_in_function_model,
    conv_model,
    fused_conv_model,
    gemm_model,
    op_types,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert

EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)
DILATED = ConvertOptions(allow_added_transposes=True, extended=True, allow_non_unit_dilation=True)


@dataclasses.dataclass
class Example:
    id: str
    build: Callable[[], onnx.ModelProto]
    options: ConvertOptions = ALL
    detail: str = ""  # a part of the entry's detail


def _with_weight(model: onnx.ModelProto, array: np.ndarray) -> onnx.ModelProto:
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(array, "W"))
    return model


def _weight(model: onnx.ModelProto) -> np.ndarray:
    return numpy_helper.to_array(model.graph.initializer[0])


def _retyped(op_type: str, domain: str) -> onnx.ModelProto:
    model = conv_model(spatial=1, bias=False)
    model.graph.node[0].op_type = op_type
    if domain:
        model.graph.node[0].domain = domain
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def _conv_integer() -> onnx.ModelProto:
    """A valid ConvInteger (uint8 data, int8 weight): pointwise, still not a Conv."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.integers(-8, 8, (5, 6, 1), dtype=np.int8), "W")
    graph = helper.make_graph(
        [helper.make_node("ConvInteger", ["x", "W"], ["y"], name="pw")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", 6, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["N", 5, "T"])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weight_through_identity() -> onnx.ModelProto:
    model = conv_model(spatial=1)
    model.graph.node.insert(0, helper.make_node("Identity", ["W"], ["W2"]))
    model.graph.node[1].input[1] = "W2"
    return model


def _ir_version_3(spatial: int, bias: bool) -> onnx.ModelProto:
    """IR 3: the weight must be a Constant (an initializer would have to be an input too)."""
    model = conv_model(spatial=spatial, weight_source="constant", bias=False, opset=8)
    if bias:
        b = numpy_helper.from_array(np.ones(5, np.float32), "B")
        model.graph.node.insert(0, helper.make_node("Constant", [], ["B"], value=b))
        model.graph.node[-1].input.append("B")
    model.ir_version = 3
    return model


def _no_default_opset() -> onnx.ModelProto:
    model = conv_model(spatial=1)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _input_declared(
    shape: list[int | str], elem_type: int = TensorProto.FLOAT
) -> Callable[[], onnx.ModelProto]:
    """A pointwise conv whose input is declared with ``shape`` (the weight is [5, 6, 1])."""

    def build() -> onnx.ModelProto:
        model = conv_model(spatial=1)
        model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", elem_type, shape))
        return model

    return build


def _weight_also_read_by(op_type: str) -> onnx.ModelProto:
    model = conv_model(spatial=1)
    model.graph.node.append(helper.make_node(op_type, ["W"], ["w_out"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT, None))
    return model


def _if_defining(name: str, *, conv_inside: bool) -> onnx.ModelProto:
    """A conv reading ``W`` and an If whose then-branch defines another ``name``.

    ``conv_inside``: the conv is in the branch (reading the branch's own ``W``) and
    the main graph defines ``W`` as the output of an Identity.
    """
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((6, 6, 1)).astype(np.float32), "W")
    if conv_inside:
        then_nodes = [helper.make_node("Conv", ["x", name], ["t_out"], name="pw")]
        then_inits = [w]
        main_nodes = [helper.make_node("Identity", ["x"], ["W"], name="main_w")]
        main_inits: list[onnx.TensorProto] = []
        outputs = ["y", "W"]
    else:
        then_nodes = [
            helper.make_node("Relu", ["x"], [name]),
            helper.make_node("Identity", [name], ["t_out"]),
        ]
        then_inits = []
        main_nodes = [helper.make_node("Conv", ["x", "W"], ["conv_out"], name="pw")]
        main_inits = [w]
        outputs = ["y", "conv_out"]
    then_branch = helper.make_graph(
        then_nodes, "then", [], [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)], then_inits
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [
            *main_nodes,
            helper.make_node(
                "If", ["c"], ["y"], name="if0", then_branch=then_branch, else_branch=else_branch
            ),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, "T"]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        main_inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _between(before: str | None, after: str | None, spatial: int = 1) -> onnx.ModelProto:
    """A pointwise conv with ``before`` on its input and ``after`` on its output: ops
    that need channels-first data, so that its Transposes would stay."""
    model = conv_model(spatial=spatial)
    nodes = list(model.graph.node)
    if before == "Transpose":  # one that does not undo ours: they merge, ours stays as one
        nodes.insert(0, helper.make_node("Transpose", ["x0"], ["x"], perm=[0, 2, 1, 3]))
        model.graph.input[0].name = "x0"
    if after == "Softmax":
        nodes.append(helper.make_node("Softmax", ["y"], ["z"], axis=1))
        model.graph.output[0].name = "z"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _fused_conv(
    *,
    group: int = 1,
    in_channels: int = 6,
    out_channels: int = 6,
    dtype: int = TensorProto.FLOAT,
    opset: int = 17,
    **fused: object,
) -> onnx.ModelProto:
    """A com.microsoft FusedConv: 2-D when grouped (``in_channels`` per group), else 1-D."""
    return fused_conv_model(
        spatial=2 if group > 1 else 1,
        in_channels=in_channels * group,
        out_channels=out_channels,
        group=group,
        dtype=dtype,
        opset=opset,
        **fused,  # type: ignore[arg-type]
    )


def _fused_conv_activation_not_a_string() -> onnx.ModelProto:
    model = _fused_conv()
    model.graph.node[-1].attribute.append(helper.make_attribute("activation", [1.0]))
    return model


def _with_attribute(model: onnx.ModelProto, name: str, value: object) -> onnx.ModelProto:
    """``model`` with its last node's attribute ``name`` set to ``value`` (of another type than
    the op defines: the ONNX checker refuses it for a standard op, is optional, and does not
    know com.microsoft ops)."""
    node = model.graph.node[-1]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute(name, value)])
    return model


def _fused_conv_params_not_floats() -> onnx.ModelProto:
    """``activation_params`` as integers: the ONNX checker knows no com.microsoft schema."""
    model = _fused_conv(activation="LeakyRelu")
    model.graph.node[-1].attribute.append(helper.make_attribute("activation_params", [1]))
    return model


def _grouped_input_declared(shape: list[int | str]) -> Callable[[], onnx.ModelProto]:
    """A group-2 conv of weight [6, 3, 1] (6 input channels) whose input is declared ``shape``."""

    def build() -> onnx.ModelProto:
        model = conv_model(spatial=1, in_channels=3, out_channels=6, attrs={"group": 2})
        model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, shape))
        return model

    return build


def _gemm_weight(array: np.ndarray, **kwargs: object) -> onnx.ModelProto:
    """A Gemm without C whose weight B is ``array``."""
    model = gemm_model(c=None, **kwargs)  # type: ignore[arg-type]
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(array, "B"))
    return model


def _gemm_weight_through_identity() -> onnx.ModelProto:
    model = gemm_model()
    model.graph.node.insert(0, helper.make_node("Identity", ["B"], ["B2"]))
    model.graph.node[1].input[1] = "B2"
    return model


def _gemm_weight_also_read_by(op_type: str, weight_source: str, trans_b: bool) -> onnx.ModelProto:
    model = gemm_model(weight_source=weight_source, trans_b=trans_b)
    model.graph.node.append(helper.make_node(op_type, ["B"], ["w_out"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT, None))
    return model


def _gemm_in_if(*, gemm_inside: bool) -> onnx.ModelProto:
    """A Gemm reading ``B`` while another scope defines another ``B`` (see :func:`_if_defining`)."""
    model = _if_defining("W", conv_inside=gemm_inside)
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32), "W")
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.op_type == "Conv":
                node.op_type = "Gemm"
                del node.input[0]
                node.input.insert(0, "a")
        for i, tensor in enumerate(graph.initializer):
            if tensor.name == "W":
                graph.initializer[i].CopyFrom(w)
    model.graph.input.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", 6]))
    return model


def _gemm_in_function() -> onnx.ModelProto:
    function = helper.make_function(
        "local",
        "Linear",
        ["a", "w"],
        ["y"],
        [helper.make_node("Gemm", ["a", "w"], ["y"], name="fn_gemm", transB=1)],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = gemm_model(c=None)
    model.graph.node[0].op_type = "Linear"
    model.graph.node[0].domain = "local"
    del model.graph.node[0].attribute[:]
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    return model


def _gemm_ir_version_3(c: str | None) -> onnx.ModelProto:
    model = gemm_model(weight_source="constant", c=None, opset=8)
    if c is not None:
        value = numpy_helper.from_array(np.ones(5, np.float32), "C")
        model.graph.node.insert(0, helper.make_node("Constant", [], ["C"], value=value))
        model.graph.node[-1].input.append("C")
    model.ir_version = 3
    return model


def _gemm_bfloat16() -> onnx.ModelProto:
    w = helper.make_tensor("B", TensorProto.BFLOAT16, [5, 6], np.ones(30).tolist())
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "B"], ["y"], name="fc", transB=1)],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.BFLOAT16, ["M", 6])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["M", 5])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def _gemm_input_declared(
    shape: list[int | str], elem_type: int = TensorProto.FLOAT, trans_a: bool = False
) -> onnx.ModelProto:
    model = gemm_model(trans_a=trans_a)
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("a", elem_type, shape))
    return model


def _gemm_c(shape: list[int | str], m: int | str = "M") -> onnx.ModelProto:
    """A Gemm [m, 6] x [6, 5] whose C is a graph input of ``shape``."""
    model = gemm_model(c="N", c_source="input")
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, 6]))
    model.graph.input[1].CopyFrom(helper.make_tensor_value_info("C", TensorProto.FLOAT, shape))
    return model


EXAMPLES: dict[SkipReason, list[Example]] = {
    SkipReason.UNSUPPORTED_OP: [
        Example("conv-integer", _conv_integer),
        Example(
            "ms-nhwc-fused-conv", lambda: _retyped("NhwcFusedConv", "com.microsoft"), detail="com.microsoft"
        ),
        Example("fused-conv-default-domain", lambda: _retyped("FusedConv", ""), detail="ai.onnx::FusedConv"),
        Example("qlinear-conv-retyped", lambda: _retyped("QLinearConv", "")),
    ],
    SkipReason.WEIGHT_NOT_CONSTANT: [
        Example("graph-input", lambda: conv_model(spatial=1, weight_source="input"), detail="graph input"),
        Example("through-identity", _weight_through_identity, detail="run time"),
        Example("constant-of-shape", lambda: _weight_of_shape(), detail="run time"),
        Example("gemm-graph-input", lambda: gemm_model(weight_source="input"), detail="graph input"),
        Example("gemm-through-identity", _gemm_weight_through_identity, detail="run time"),
    ],
    SkipReason.WEIGHT_OVERRIDABLE: [
        Example("1d", lambda: conv_model(spatial=1, weight_source="input_initializer")),
        Example("2d", lambda: conv_model(spatial=2, weight_source="input_initializer")),
        Example("gemm", lambda: gemm_model(weight_source="input_initializer")),
        Example("gemm-untransposed", lambda: gemm_model(weight_source="input_initializer", trans_b=False)),
    ],
    SkipReason.UNSUPPORTED_RANK: [
        Example(
            "2-d", lambda: _with_weight(conv_model(spatial=1), _weight(conv_model(spatial=1)).reshape(5, 6))
        ),
        Example("6-d", lambda: _with_weight(conv_model(spatial=1), np.ones((5, 6, 1, 1, 1, 1), np.float32))),
    ],
    SkipReason.KERNEL_NOT_POINTWISE: [
        Example("k3", lambda: conv_model(spatial=1, kernel=[3]), detail="[3]"),
        Example("1x3", lambda: conv_model(spatial=2, kernel=[1, 3])),
        Example(
            "depthwise-k9",
            lambda: conv_model(spatial=1, in_channels=1, out_channels=6, kernel=[9], attrs={"group": 6}),
        ),
    ],
    SkipReason.GROUPED: [
        Example(
            "group2-1d",
            lambda: conv_model(spatial=1, in_channels=3, out_channels=6, attrs={"group": 2}),
            detail="group 2",
        ),
        Example(
            "group3-3d",
            lambda: conv_model(spatial=3, in_channels=2, out_channels=6, attrs={"group": 3}),
            detail="group 3",
        ),
        Example("fused-group2-2d", lambda: _fused_conv(group=2, activation="Relu"), detail="group 2"),
    ],
    SkipReason.DEPTHWISE: [
        Example(
            "depthwise-1x1",
            lambda: conv_model(spatial=2, in_channels=1, out_channels=6, attrs={"group": 6}),
            EXTENDED,
            detail="group 6, one input channel per group",
        ),
        Example(
            "depthwise-multiplier-1d",
            lambda: conv_model(spatial=1, in_channels=1, out_channels=6, attrs={"group": 3}),
            ConvertOptions(),
            detail="group 3",
        ),
        Example(
            "fused-depthwise-2d",
            lambda: _fused_conv(group=6, in_channels=1, out_channels=6, activation="Relu"),
            EXTENDED,
        ),
    ],
    SkipReason.UNSUPPORTED_ACTIVATION: [
        Example("unknown-name", lambda: _fused_conv(activation="Gelu"), detail="'Gelu' is not one of"),
        Example("empty-name", lambda: _fused_conv(activation=""), detail="activation ''"),
        Example(
            "leaky-relu-without-alpha",
            lambda: _fused_conv(activation="LeakyRelu"),
            detail="LeakyRelu takes 1 activation_params, node has 0",
        ),
        Example(
            "clip-one-bound",
            lambda: _fused_conv(activation="Clip", params=[0.0]),
            detail="Clip takes 2 activation_params, node has 1",
        ),
        Example("relu-with-params", lambda: _fused_conv(activation="Relu", params=[1.0]), detail="takes 0"),
        Example(
            "hard-sigmoid-3-params", lambda: _fused_conv(activation="HardSigmoid", params=[0.2, 0.5, 1.0])
        ),
        Example("activation-as-floats", _fused_conv_activation_not_a_string, detail="of type FLOATS"),
        Example(
            "params-as-ints", _fused_conv_params_not_floats, detail="activation_params attribute of type INTS"
        ),
    ],
    SkipReason.UNSUPPORTED_DTYPE: [
        Example("int8", lambda: _with_weight(conv_model(spatial=1), _weight(conv_model()).astype(np.int8))),
        Example("int32", lambda: _with_weight(conv_model(spatial=1), _weight(conv_model()).astype(np.int32))),
        Example(
            "uint8-2d",
            lambda: _with_weight(conv_model(spatial=2), np.ones((5, 6, 1, 1), np.uint8)),
            detail="UINT8",
        ),
        Example(
            "fused-double",
            lambda: _fused_conv(activation="Relu", dtype=TensorProto.DOUBLE),
            detail="FusedConv for FLOAT and FLOAT16 only",
        ),
        Example("gemm-int32", lambda: _gemm_weight(np.ones((5, 6), np.int32)), detail="INT32"),
        Example("gemm-int64", lambda: _gemm_weight(np.ones((6, 5), np.int64), trans_b=False), detail="INT64"),
    ],
    SkipReason.INVALID_ATTRIBUTES: [
        Example("kernel-shape", lambda: conv_model(spatial=1, attrs={"kernel_shape": [3]})),
        Example("strides-length", lambda: conv_model(spatial=1, attrs={"strides": [1, 1]}), EXTENDED),
        Example("negative-pads", lambda: conv_model(spatial=1, attrs={"pads": [-1, 0]}), EXTENDED),
        Example("zero-dilation", lambda: conv_model(spatial=1, attrs={"dilations": [0]}), DILATED),
        Example("unknown-auto-pad", lambda: conv_model(spatial=1, attrs={"auto_pad": "FOO"}), EXTENDED),
        Example(
            "auto-pad-and-pads",
            lambda: conv_model(spatial=1, attrs={"auto_pad": "SAME_UPPER", "pads": [0, 0]}),
            EXTENDED,
        ),
        Example(
            "bias-shape",
            lambda: _bias_of(np.zeros(3, np.float32)),
            detail="bias shape [3] != [5]",
        ),
        # The input's declared shape or type contradicts the weight [5, 6, 1].
        Example("input-channels", _input_declared(["N", 4, "T"]), detail="input channels 4 != 6"),
        Example("input-rank", _input_declared(["N", 6, "H", "W"]), detail="input rank 4 != weight rank 3"),
        Example("input-rank-2", _input_declared(["N", 6]), detail="input rank 2 != weight rank 3"),
        # The bias's shape known only from a Constant node, or only from its declaration.
        Example("bias-shape-constant", lambda: _bias_from("constant"), detail="bias shape [3] != [5]"),
        Example("bias-shape-input", lambda: _bias_from("input"), detail="bias shape [3] != [5]"),
        Example(
            "input-type",
            _input_declared(["N", 6, "T"], TensorProto.FLOAT16),
            detail="input type FLOAT16 != weight type FLOAT",
        ),
        Example(
            "group-not-dividing-outputs",
            lambda: conv_model(spatial=1, in_channels=3, out_channels=5, attrs={"group": 2}),
            EXTENDED,
            detail="group 2 for 5 output channels",
        ),
        Example("group-0", lambda: conv_model(spatial=1, attrs={"group": 0}), detail="group 0"),
        Example(
            "grouped-input-channels",
            _grouped_input_declared(["N", 3, "T"]),
            EXTENDED,
            detail="input channels 3 != 6",
        ),
        Example(
            "fused-z-type",
            lambda: _fused_conv(activation="Relu", z_type=TensorProto.FLOAT16),
            detail="input Z type FLOAT16 != weight type FLOAT",
        ),
        # A Gemm's operands contradict its weight B [5, 6] (transB=1: K 6, N 5).
        Example("gemm-weight-rank", lambda: _gemm_weight(np.ones((5, 6, 1), np.float32)), detail="is 2-D"),
        Example("gemm-input-rank", lambda: _gemm_input_declared(["N", "T", 6]), detail="input rank 3"),
        Example("gemm-input-k", lambda: _gemm_input_declared(["M", 4]), detail="input K 4 != weight K 6"),
        Example(
            "gemm-input-k-trans-a", lambda: _gemm_input_declared([4, "M"], trans_a=True), detail="input K 4"
        ),
        Example(
            "gemm-input-type",
            lambda: _gemm_input_declared(["M", 6], TensorProto.DOUBLE),
            detail="input type DOUBLE",
        ),
        Example("gemm-c-n", lambda: _gemm_c([3]), detail="C shape [3]"),
        Example(
            "fused-group-float",
            lambda: _with_attribute(_fused_conv(activation="Relu"), "group", 1.0),
            detail="attribute group of type FLOAT, not INT",
        ),
        Example(
            "conv-strides-floats",
            lambda: _with_attribute(conv_model(spatial=1), "strides", [1.0]),
            detail="attribute strides of type FLOATS, not INTS",
        ),
        Example(
            "gemm-alpha-int",
            lambda: _with_attribute(gemm_model(alpha=2.0), "alpha", 2),
            detail="attribute alpha of type INT, not FLOAT",
        ),
        Example("gemm-c-rank-3", lambda: _gemm_c([1, 1, 5]), detail="C shape [1, 1, 5]"),
        Example("gemm-c-m", lambda: _gemm_c([3, 5], m=2), detail="C shape [3, 5]"),
    ],
    SkipReason.NEEDS_EXTENDED_MODE: [
        Example("strides", lambda: conv_model(spatial=1, attrs={"strides": [2]}), detail="strides [2]"),
        Example("pads", lambda: conv_model(spatial=1, attrs={"pads": [1, 0]})),
        Example(
            "valid-strided",
            lambda: conv_model(spatial=1, attrs={"auto_pad": "VALID", "strides": [2]}),
            detail="strides [2], auto_pad VALID",
        ),
        Example(
            "same-upper-2d-strided",
            lambda: conv_model(spatial=2, attrs={"auto_pad": "SAME_UPPER", "strides": [1, 2]}),
        ),
    ],
    SkipReason.DILATION_NEEDS_OPT_IN: [
        Example("1d", lambda: conv_model(spatial=1, attrs={"dilations": [2]}), EXTENDED),
        Example("2d", lambda: conv_model(spatial=2, attrs={"dilations": [1, 3]}), EXTENDED),
    ],
    SkipReason.DILATION_ABOVE_MAX: [
        Example(
            "2d-5-over-4",
            lambda: conv_model(spatial=2, attrs={"dilations": [1, 5]}),
            dataclasses.replace(DILATED, max_dilation=4),
            detail="above max 4",
        ),
        Example(
            "1d-3-over-2-strided",
            lambda: conv_model(spatial=1, attrs={"dilations": [3], "strides": [2]}),
            dataclasses.replace(DILATED, max_dilation=2),
            detail="dilations [3]",
        ),
        Example(
            "3d-any-over-1",
            lambda: conv_model(spatial=3, attrs={"dilations": [1, 2, 1]}),
            dataclasses.replace(DILATED, max_dilation=1),
        ),
    ],
    SkipReason.OPSET_UNSUPPORTED: [
        Example("strides-opset-9", lambda: conv_model(spatial=1, attrs={"strides": [2]}, opset=9), EXTENDED),
        Example("pads-opset-1", lambda: conv_model(spatial=1, attrs={"pads": [1, 1]}, opset=1), EXTENDED),
        Example("bfloat16-opset-12", lambda: bfloat16_conv_model(12), detail="bfloat16"),
        Example(
            "fused-relu-opset-5", lambda: _fused_conv(activation="Relu", opset=5), detail="Relu needs opset 6"
        ),
        Example("no-default-opset", _no_default_opset, detail="no default-domain opset"),
        Example("ir-3-1d", lambda: _ir_version_3(1, bias=False), detail="IR version 3"),
        Example("ir-3-2d-bias", lambda: _ir_version_3(2, bias=True), detail="IR version 3"),
        Example("gemm-opset-6", lambda: gemm_model(opset=6), detail="Gemm before opset 7"),
        Example("gemm-opset-1", lambda: gemm_model(opset=1, trans_b=False), detail="Gemm before opset 7"),
        Example("gemm-bfloat16-opset-12", _gemm_bfloat16, detail="bfloat16"),
        Example("gemm-ir-3", lambda: _gemm_ir_version_3(None), detail="IR version 3"),
        Example("gemm-ir-3-c", lambda: _gemm_ir_version_3("N"), detail="IR version 3"),
    ],
    SkipReason.WEIGHT_SHARED: [
        Example("shape-reads-weight", lambda: _weight_also_read_by("Shape"), detail="Shape 'reader'"),
        Example("relu-reads-weight", lambda: _weight_also_read_by("Relu"), detail="Relu 'reader'"),
        Example(
            "gemm-transposed",
            lambda: _gemm_weight_also_read_by("Relu", "initializer", trans_b=True),
            detail="Relu 'reader'",
        ),
        Example(
            "gemm-constant-node",
            lambda: _gemm_weight_also_read_by("Shape", "constant", trans_b=False),
            detail="Shape 'reader'",
        ),
    ],
    SkipReason.AMBIGUOUS_WEIGHT: [
        Example("branch-defines-weight-name", lambda: _if_defining("W", conv_inside=False)),
        Example("conv-in-branch", lambda: _if_defining("W", conv_inside=True)),
        Example("gemm-branch-defines-weight-name", lambda: _gemm_in_if(gemm_inside=False)),
        Example("gemm-in-branch", lambda: _gemm_in_if(gemm_inside=True)),
    ],
    SkipReason.IN_FUNCTION: [
        Example("conv1d", lambda: conv_in_function_model(1), detail="model-local"),
        Example("conv2d", lambda: conv_in_function_model(2)),
        Example("gemm", _gemm_in_function, detail="Gemm nodes inside model-local"),
    ],
    SkipReason.ADDS_TRANSPOSES: [
        Example("alone", lambda: conv_model(spatial=1), ConvertOptions(), detail="2 Transpose nodes"),
        Example("before-softmax", lambda: _between(None, "Softmax", 2), ConvertOptions()),
        Example(
            "after-other-transpose", lambda: _between("Transpose", None, 2), ConvertOptions(), "1 Transpose"
        ),
    ],
}


def _bias_from(source: str) -> onnx.ModelProto:
    """A bias of shape [3] (the conv has 5 outputs) from a Constant node or a graph input
    (mutation testing: ``_check_shapes``)."""
    model = conv_model(spatial=1)
    bias = model.graph.initializer.pop()
    assert bias.name == "B"
    if source == "constant":
        value = numpy_helper.from_array(np.zeros(3, np.float32), "B")
        model.graph.node.insert(0, helper.make_node("Constant", [], ["B"], value=value))
    else:
        model.graph.input.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [3]))
    return model


def _weight_of_shape() -> onnx.ModelProto:
    """The weight is ConstantOfShape's output: computed, though its op has a tensor
    attribute ``value`` (mutation testing: ``constant_tensor``)."""
    model = conv_model(spatial=1, bias=False)
    weight = model.graph.initializer.pop()
    shape = numpy_helper.from_array(np.array(weight.dims, np.int64), "W_shape")
    model.graph.initializer.append(shape)
    fill = numpy_helper.from_array(np.ones(1, np.float32), "fill")
    model.graph.node.insert(0, helper.make_node("ConstantOfShape", ["W_shape"], ["W"], value=fill))
    return model


def _bias_of(bias: np.ndarray) -> onnx.ModelProto:
    model = conv_model(spatial=1)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(bias, "B"))
    return model


CASES = [(reason, example) for reason, examples in EXAMPLES.items() for example in examples]


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            found.extend(g for sub in [attr.g, *attr.graphs] if sub.ByteSize() for g in _graphs(sub))
    return found


def _normalized(model: onnx.ModelProto) -> bytes:
    """The model's bytes, less the value_info of initializers (the serializer adds those)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for graph in _graphs(copy.graph):
        names = {t.name for t in graph.initializer}
        kept = [v for v in graph.value_info if v.name not in names]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    for field in ("ir_version", "producer_name", "producer_version"):
        copy.ClearField(field)
    return copy.SerializeToString(deterministic=True)


def test_the_table_covers_every_reason_with_several_examples() -> None:
    assert set(EXAMPLES) == set(SkipReason)
    for reason, examples in EXAMPLES.items():
        assert len(examples) >= 2, f"{reason.name} has one example"
        assert len({e.id for e in examples}) == len(examples)
    ir_3 = [e for e in EXAMPLES[SkipReason.OPSET_UNSUPPORTED] if e.detail == "IR version 3"]
    assert len(ir_3) >= 2


@pytest.mark.parametrize(
    ("reason", "example"), CASES, ids=[f"{reason.value}-{example.id}" for reason, example in CASES]
)
def test_exactly_that_reason_and_nothing_changes(reason: SkipReason, example: Example) -> None:
    model = example.build()
    rewritten, report = convert(model, example.options)
    assert [(e.status, e.reason) for e in report.entries] == [(Status.SKIPPED, reason)]
    assert report.skip_counts == {reason.value: 1}
    assert example.detail in report.entries[0].detail
    assert _normalized(rewritten) == _normalized(model), "a skipped conv's model must stay as it was"
    assert rewritten.ir_version == model.ir_version
    assert report.transposes_after == report.transposes_before and report.tensors_removed == 0


def test_every_reason_is_documented() -> None:
    page = (pathlib.Path(__file__).parents[1] / "docs" / "rewrite.md").read_text()
    codes = page.split("## Skip reason codes", 1)[1].split("\n## ", 1)[0]
    for reason in SkipReason:
        assert f"`{reason.value}`" in codes, (
            f"{reason.value} missing from docs/rewrite.md's skip reason codes"
        )
        assert reason.description


def test_dilation_at_the_max_converts() -> None:
    model = conv_model(spatial=2, attrs={"dilations": [1, 5]})
    _, report = convert(model, dataclasses.replace(DILATED, max_dilation=5))
    assert report.entries[0].status is Status.CONVERTED


def test_input_channels_unknown_or_matching_convert() -> None:
    """The check that rejects contradicting channels accepts what does not contradict."""
    for shape in (["N", 6, "T"], ["N", "C", "T"], None):
        model = conv_model(spatial=1)
        model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, shape))
        _, report = convert(model, ALL)
        assert report.entries[0].status is Status.CONVERTED, shape


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
    _, report = convert(model, EXTENDED)
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


def test_conv_in_a_local_function_is_reported_with_its_scope() -> None:
    _, report = convert(conv_in_function_model(1), ALL)
    assert [(e.name, e.reason, e.scope) for e in report.entries] == [
        ("fn_conv", SkipReason.IN_FUNCTION, "function local::PwConv")
    ]
    assert [(e.op_type, e.domain) for e in report.entries] == [("Conv", "")]


def _without_input(index: int) -> Callable[[], onnx.ModelProto]:
    def build() -> onnx.ModelProto:
        model = conv_model(spatial=1, bias=False)
        if index == 0:
            model.graph.node[0].input[0] = ""
        else:
            del model.graph.node[0].input[1:]
        return model

    return build


@pytest.mark.parametrize(
    ("build", "options", "reason", "detail"),
    [
        (_no_default_opset, ALL, SkipReason.OPSET_UNSUPPORTED, "model imports no default-domain opset"),
        (
            lambda: conv_model(spatial=1, attrs={"strides": [2], "pads": [1, 0]}),
            ALL,
            SkipReason.NEEDS_EXTENDED_MODE,
            "strides [2], pads [1, 0]",
        ),
        (_conv_integer, ALL, SkipReason.UNSUPPORTED_OP, "ai.onnx::ConvInteger is not rewritten"),
        (_without_input(0), ALL, SkipReason.INVALID_ATTRIBUTES, "Conv without input or weight"),
        (_without_input(1), ALL, SkipReason.INVALID_ATTRIBUTES, "Conv without input or weight"),
    ],
    ids=["no-default-opset", "strides-and-pads", "conv-integer", "no-input", "no-weight"],
)
def test_the_skip_detail_in_full(
    build: Callable[[], onnx.ModelProto], options: ConvertOptions, reason: SkipReason, detail: str
) -> None:
    """The whole detail, not a part of it (mutation testing: ``_plan``)."""
    model = build()
    rewritten, report = convert(model, options)
    assert [(e.status, e.reason, e.detail) for e in report.entries] == [(Status.SKIPPED, reason, detail)]
    assert _normalized(rewritten) == _normalized(model)
