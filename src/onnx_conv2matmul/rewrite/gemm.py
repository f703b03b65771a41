"""Gemm with a constant weight: its plan and its MatMul form.

``Gemm(A, B, C)`` computes ``alpha * A' @ B' + beta * C`` (``A'`` is ``A`` or ``A^T`` by
``transA``, ``B'`` likewise by ``transB``; C broadcasts to ``[M, N]``). With B constant it
becomes::

    [Transpose(perm=[1, 0])] -> MatMul(·, W [K, N]) -> [Mul(alpha)] -> [Add(C or Mul(C, beta))]

The cases:

1. ``transB=1``: ``W`` is ``B^T``, a new 2-D initializer made lazily (nothing is read
   before saving), stored once for every Gemm that reads B.
2. ``transB=0``: ``W`` is B itself when B is an initializer (no copy); a weight held in a
   ``Constant`` node moves into an initializer, since MatMulNBits takes only those.
3. ``transA=1``: a Transpose of A. It is marked as made by the rewrite, so the cleanup
   cancels it against a Transpose above it (both are 2-D; chains of a conv's Transposes
   have rank 3 or more and never include it).
4. ``alpha`` other than 1: a ``Mul`` by alpha after the MatMul; ``beta`` other than 1: a
   ``Mul`` of C by beta. Both are one rounding, like Gemm's own scaling, and need no weight
   read. ``beta`` 0: C is not read, as onnxruntime's Gemm does not read it.
5. C of shape ``[]``, ``[1]``, ``[N]``, ``[1, N]``, ``[M, 1]`` or ``[M, N]``: ``Add``
   broadcasts it exactly as Gemm does (Gemm's C broadcasts one way to ``[M, N]``; ``Add``
   of an ``[M, N]`` tensor and any of these gives ``[M, N]`` with the same values).

Gemm before opset 7 (its ``broadcast`` attribute, and Add without numpy broadcasting) is
left alone, as are non-float types; a weight that is computed, overridable (an initializer
that is also a graph input) or shared with a node that stays is left alone as for a Conv.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvEntry
from onnx_conv2matmul.rewrite.weights import (
    _FLOAT_TYPES,
    MIN_OPSET_BFLOAT16_MATMUL,
    WeightPlan,
    _Skip,
    check_attribute_types,
    constant_tensor,
    constant_weight,
)

# Gemm-7 is the first without the ``broadcast`` attribute (and Add-7 the first with numpy
# broadcasting).
MIN_OPSET_GEMM = 7


@dataclasses.dataclass
class GemmPlan(WeightPlan):
    """How one Gemm is rewritten. Built by :func:`plan_gemm`, applied by :func:`apply_gemm`."""

    trans_a: bool
    trans_b: bool
    alpha: float
    beta: float
    c: ir.Value | None  # None when absent or not read (beta 0)

    @property
    def stored_form(self) -> str | None:
        """How the rewrite stores the weight anew: ``"transposed"``, ``"copied"`` (out of a
        Constant node into an initializer), or None (an initializer read as it is).

        A weight stored in no new form may also feed nodes that stay: nothing is stored twice.
        """
        if self.trans_b:
            return "transposed"
        return "copied" if self.weight_constant_node is not None else None


def is_gemm(node: ir.Node) -> bool:
    return node.op_type == "Gemm" and node.domain in ("", "ai.onnx")


def plan_gemm(node: ir.Node, graph: ir.Graph, entry: ConvEntry, opset: int | None) -> GemmPlan:
    """The plan for ``node``, or ``_Skip`` with the reason it stays."""
    if opset is None:
        raise _Skip(SkipReason.OPSET_UNSUPPORTED, "model imports no default-domain opset")
    check_attribute_types(node)
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None or len(node.outputs) != 1:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, "Gemm without input A or B, or not with one output")
    weight = node.inputs[1]
    tensor, constant_node, shape = constant_weight(weight, entry)
    if tensor.dtype not in _FLOAT_TYPES:
        raise _Skip(SkipReason.UNSUPPORTED_DTYPE, f"weight type {tensor.dtype.name}")
    if len(shape) != 2:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"weight shape {shape}: Gemm's B is 2-D")
    if weight.is_graph_input():
        raise _Skip(
            SkipReason.WEIGHT_OVERRIDABLE,
            f"weight {weight.name!r} is an initializer that is also a graph input",
        )
    if opset < MIN_OPSET_GEMM:
        raise _Skip(
            SkipReason.OPSET_UNSUPPORTED,
            f"Gemm before opset {MIN_OPSET_GEMM} (broadcast attribute), model has {opset}",
        )
    trans_a = node.attributes.get_int("transA", 0) != 0
    trans_b = node.attributes.get_int("transB", 0) != 0
    alpha = node.attributes.get_float("alpha", 1.0)
    beta = node.attributes.get_float("beta", 1.0)
    k, n = (shape[1], shape[0]) if trans_b else (shape[0], shape[1])
    c = node.inputs[2] if len(node.inputs) > 2 else None
    _check_operands(node, trans_a, k, n, c, tensor.dtype)
    if tensor.dtype == ir.DataType.BFLOAT16 and opset < MIN_OPSET_BFLOAT16_MATMUL:
        raise _Skip(SkipReason.OPSET_UNSUPPORTED, f"bfloat16 MatMul needs opset 13, model has {opset}")

    details = [name for name, on in (("transA", trans_a), ("transB", trans_b)) if on]
    details += [f"{name} {value:g}" for name, value in (("alpha", alpha), ("beta", beta)) if value != 1]
    if beta == 0 and c is not None:
        details.append("C not read")
        c = None
    entry.detail = ", ".join(details)
    owner = weight.graph  # a Constant's output belongs to the Constant's graph
    assert owner is not None
    return GemmPlan(
        node=node,
        graph=graph,
        entry=entry,
        weight=weight,
        weight_tensor=tensor,
        weight_owner=owner,
        weight_constant_node=constant_node,
        trans_a=trans_a,
        trans_b=trans_b,
        alpha=alpha,
        beta=beta,
        c=c,
    )


def _static_shape(value: ir.Value) -> list[int | str | None] | None:
    found = constant_tensor(value)
    if found is not None:
        return [int(d) for d in found[0].shape.numpy()]
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def _check_operands(
    node: ir.Node, trans_a: bool, k: int, n: int, c: ir.Value | None, dtype: ir.DataType
) -> None:
    """Reject Gemms whose A or C contradict the weight (the node is invalid as it is)."""
    a = node.inputs[0]
    assert a is not None
    m: int | None = None
    for what, value in (("input", a), ("C", c)):
        if value is not None and value.dtype is not None and value.dtype != dtype:
            raise _Skip(
                SkipReason.INVALID_ATTRIBUTES, f"{what} type {value.dtype.name} != weight type {dtype.name}"
            )
    if a.shape is not None:
        if len(a.shape) != 2:
            raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"input rank {len(a.shape)}: Gemm's A is 2-D")
        a_m, a_k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
        if isinstance(a_k, int) and a_k != k:
            raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"input K {a_k} != weight K {k}")
        m = a_m if isinstance(a_m, int) else None
    if c is None:
        return
    c_shape = _static_shape(c)
    if c_shape is None:
        return
    # C must broadcast one way to [M, N]: Add would otherwise broadcast both ways.
    wanted = [m, n][max(0, 2 - len(c_shape)) :]
    pairs = zip(c_shape, wanted, strict=False)
    if len(c_shape) > 2 or any(isinstance(d, int) and w is not None and d not in (1, w) for d, w in pairs):
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"C shape {c_shape} does not broadcast to [M, {n}]")
