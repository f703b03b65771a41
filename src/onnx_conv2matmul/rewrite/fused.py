"""``com.microsoft`` ``FusedConv``: a Conv with its activation, and optionally a sum, inside.

onnxruntime's graph optimizer writes it in place of ``Conv -> activation`` (and of
``Conv -> Add -> activation``). Its inputs are those of Conv plus an optional ``Z``, and
onnxruntime computes::

    Y = activation(Conv(X, W, B) + Z)

``Z`` is added before the activation, and must have Y's shape. The activation is the
attribute ``activation`` (absent: none), with ``activation_params``; onnxruntime reads
exactly as many parameters as the activation takes and refuses another count for the ones
that take some. As standard ops:

============  ==================  =====================================
activation    activation_params   standard op
============  ==================  =====================================
Relu          none                Relu
Tanh          none                Tanh
Sigmoid       none                Sigmoid
LeakyRelu     alpha               LeakyRelu(alpha)
HardSigmoid   alpha, beta         HardSigmoid(alpha, beta)
Clip          min, max            Clip (bounds as inputs from opset 11)
============  ==================  =====================================

The rewrite emits them after the conv's Transpose back to channels-first, as a model with
a ``Conv`` and its activation has them (see ``rewrite.py``); :func:`after_transpose_out`
says which ops come there, for the Transpose cost prediction in ``_layout.py``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

DOMAIN = "com.microsoft"
OP_TYPE = "FusedConv"
# How many activation_params each activation takes.
ACTIVATION_PARAMS = {"Relu": 0, "Tanh": 0, "Sigmoid": 0, "LeakyRelu": 1, "HardSigmoid": 2, "Clip": 2}
# onnxruntime implements FusedConv for these element types only.
DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})
# The activations' current signatures (no ``consumed_inputs``) start at opset 6.
MIN_OPSET_ACTIVATION = 6
MIN_OPSET_CLIP_INPUTS = 11  # Clip takes min and max as inputs from opset 11, as attributes before


@dataclasses.dataclass(frozen=True)
class Activation:
    """A FusedConv's activation: the standard op and its parameters, in order."""

    op_type: str
    params: tuple[float, ...]

    def __str__(self) -> str:
        return f"{self.op_type}({', '.join(f'{p:g}' for p in self.params)})" if self.params else self.op_type


def is_fused_conv(node: ir.Node) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def activation(node: ir.Node) -> tuple[Activation | None, str | None]:
    """The activation of a FusedConv (None when it has none), or why it has no exact
    standard-op form: an unknown activation, or a parameter count other than it takes."""
    attr = node.attributes.get("activation")
    if attr is None:
        return None, None
    if attr.type != ir.AttributeType.STRING:
        return None, f"activation attribute of type {attr.type.name}"
    name = attr.as_string()
    if name not in ACTIVATION_PARAMS:
        return None, f"activation {name!r} is not one of {', '.join(ACTIVATION_PARAMS)}"
    params_attr = node.attributes.get("activation_params")
    if params_attr is not None and params_attr.type != ir.AttributeType.FLOATS:
        return None, f"activation_params attribute of type {params_attr.type.name}"
    params = tuple(params_attr.as_floats()) if params_attr is not None else ()
    if len(params) != ACTIVATION_PARAMS[name]:
        return (
            None,
            f"activation {name} takes {ACTIVATION_PARAMS[name]} activation_params, node has {len(params)}",
        )
    return Activation(name, params), None


def sum_input(node: ir.Node) -> ir.Value | None:
    """The FusedConv's optional input Z, added to the conv's output before the activation."""
    return node.inputs[3] if len(node.inputs) > 3 else None


def after_transpose_out(node: ir.Node) -> list[str]:
    """The op types the rewrite of ``node`` emits after its Transpose out, in order."""
    if not is_fused_conv(node):
        return []
    ops = ["Add"] if sum_input(node) is not None else []
    act, _ = activation(node)  # a node whose activation has no form is never converted
    return [*ops, act.op_type] if act is not None else ops


def activation_attributes(act: Activation, opset: int) -> dict[str, float]:
    """The attributes of the standard op for ``act`` (Clip's bounds are inputs from opset 11)."""
    if act.op_type == "LeakyRelu":
        return {"alpha": act.params[0]}
    if act.op_type == "HardSigmoid":
        return {"alpha": act.params[0], "beta": act.params[1]}
    if act.op_type == "Clip" and opset < MIN_OPSET_CLIP_INPUTS:
        return {"min": act.params[0], "max": act.params[1]}
    return {}
