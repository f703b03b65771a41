"""What every plan of the rewrite shares: the weight it reads, the skip it may raise, and the
checks of constant weights and attribute types that the Conv and the Gemm planners both apply.

Only reads the model.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvEntry

_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16})

MIN_OPSET_BFLOAT16_MATMUL = 13


@dataclasses.dataclass
class WeightPlan:
    """What every plan holds: the node, its report entry and its constant weight.

    The steps that settle plans against each other (shared weights, the form a weight is
    stored in) read only these fields, whatever the op.
    """

    node: ir.Node
    graph: ir.Graph
    entry: ConvEntry
    weight: ir.Value
    weight_tensor: ir.TensorProtocol
    weight_owner: ir.Graph
    weight_constant_node: ir.Node | None


class _Skip(Exception):
    def __init__(self, reason: SkipReason, detail: str) -> None:
        super().__init__(detail)  # pragma: no mutate (equivalent: analyze() reads .detail, never str())
        self.reason = reason
        self.detail = detail


def constant_tensor(value: ir.Value) -> tuple[ir.TensorProtocol, ir.Node | None] | None:
    """The constant behind ``value`` (initializer or Constant node), if it has one.

    Not ``ir.convenience.get_const_tensor``: that renames the tensor held by a Constant node
    after its output (this module only reads), raises on a malformed Constant (here: not a
    constant, the node is skipped), and does not say which Constant node holds the tensor,
    which the rewrite needs to remove it.
    """
    if value.is_initializer() and value.const_value is not None:
        return value.const_value, None
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.value, producer
    return None


# The type of each attribute the plans read (``activation`` and ``activation_params`` are
# checked in ``_fused``, with their own reason). The ONNX checker checks these for standard
# ops but knows no com.microsoft schema, and is optional.
_ATTRIBUTE_TYPES = {
    "group": ir.AttributeType.INT,
    "kernel_shape": ir.AttributeType.INTS,
    "strides": ir.AttributeType.INTS,
    "dilations": ir.AttributeType.INTS,
    "pads": ir.AttributeType.INTS,
    "auto_pad": ir.AttributeType.STRING,
    "transA": ir.AttributeType.INT,
    "transB": ir.AttributeType.INT,
    "alpha": ir.AttributeType.FLOAT,
    "beta": ir.AttributeType.FLOAT,
}


def check_attribute_types(node: ir.Node) -> None:
    """Skip a node with an attribute of another type than its op defines (invalid as it is)."""
    for name, attr in node.attributes.items():
        expected = _ATTRIBUTE_TYPES.get(name)
        if expected is not None and attr.type != expected:
            raise _Skip(
                SkipReason.INVALID_ATTRIBUTES,
                f"attribute {name} of type {attr.type.name}, not {expected.name}",
            )


def constant_weight(
    weight: ir.Value, entry: ConvEntry
) -> tuple[ir.TensorProtocol, ir.Node | None, list[int]]:
    """The constant tensor of a conv's or Gemm's weight input, the Constant node holding it (if
    any) and its shape, recorded on ``entry`` with its type and size; ``_Skip`` when it is not
    constant."""
    if weight.is_graph_input() and not weight.is_initializer():
        raise _Skip(SkipReason.WEIGHT_NOT_CONSTANT, f"weight {weight.name!r} is a graph input")
    found = constant_tensor(weight)
    if found is None:
        raise _Skip(SkipReason.WEIGHT_NOT_CONSTANT, f"weight {weight.name!r} is computed at run time")
    tensor, constant_node = found
    shape = [int(d) for d in tensor.shape.numpy()]
    entry.weight_shape = shape
    entry.weight_dtype = tensor.dtype.name
    entry.params = math.prod(shape)
    entry.weight_bytes = int(entry.params * tensor.dtype.itemsize)
    return tensor, constant_node, shape
