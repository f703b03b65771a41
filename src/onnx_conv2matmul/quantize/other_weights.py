"""int8 storage for the float weights MatMulNBits does not take.

Tables (a relative positional encoding ``[1, 9999, 1024]``), the weights of convs that
stay, embeddings read by ``Gather``: every float initializer (or ``Constant`` tensor) of
at least :data:`MIN_BYTES` in any scope is stored as int8 with one scale per slice along
one axis, and read through a per-axis ``DequantizeLinear`` (opset 13), or below opset 13, where
``DequantizeLinear`` has no axis, through ``Mul(Cast(int8), scales)`` with the scales shaped to
broadcast along the axis: the same product of the same two numbers, so the same values. The scales and
the rounding are onnxruntime's own int8 weight quantization
(``onnxruntime.quantization.quant_utils.quantize_data``: symmetric, ``[-127, 127]``,
zero point 0), applied slice by slice as its per-channel quantizer does.

The axis follows the consumer: the output channels of a ``Conv`` (axis 0) or
``ConvTranspose`` (axis 1), the gathered axis of a ``Gather``, the output columns of a
``MatMul`` input B (last axis), and otherwise one scale per row of the last dimension
(axis ``rank - 2``). The ``DequantizeLinear`` sits where the tensor was, before its
consumers (a ``Gather`` reads the dequantized table): onnxruntime's ``GatherBlockQuantized``
would read the int8 rows directly, but takes only power-of-2 blocks along a row, uint8
data and its own domain, so it is not used.

MatMul weights that MatMulNBits can take (constant 2-D float input B) are never touched:
when they are still float they were left in float on purpose. Neither are the inputs of
operators outside the default domain (MatMulNBits' scales and the like).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import NameAllocator, default_opset, is_external, used_names, walk_graphs

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.blockwise import BlockCache

MIN_BYTES = 64 * 1024
"""Float tensors smaller than this are left as they are (not listed in the result)."""

# DequantizeLinear's output type is its scale's: float32 from opset 13, float16 from 19.
_MIN_OPSET = {ir.DataType.FLOAT: 13, ir.DataType.FLOAT16: 19}
CAST_MUL_OPSET = 7
"""Below opset 13, float32 tensors are read through ``Mul(Cast(int8), scales)``: Mul
broadcasts from opset 7."""


def read_through_cast_mul(dtype: ir.DataType, opset: int) -> bool:
    """Whether a tensor of ``dtype`` stored as int8 is read through ``Mul(Cast(int8), scales)``
    in a model of ``opset``: float32 where DequantizeLinear has no axis yet and Mul broadcasts."""
    return dtype is ir.DataType.FLOAT and CAST_MUL_OPSET <= opset < _MIN_OPSET[ir.DataType.FLOAT]


class KeptReason(str, enum.Enum):
    """Why a float tensor of at least :data:`MIN_BYTES` was left as it was.

    The values are part of the JSON report and are documented in docs/quantize.md: never
    rename one, only add new members.
    """

    OPSET_BELOW_13 = "opset_below_13"
    """No longer given: below opset 13 the int8 data is read through Cast and Mul (see
    :data:`CAST_MUL_OPSET`). Kept so that reports of earlier versions still parse."""
    OPSET_BELOW_7 = "opset_below_7"
    """The model's opset is below 7: no per-axis DequantizeLinear and no broadcasting Mul
    (raising the opset would change the meaning of other operators)."""
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    """Not float32, or float16 below opset 19 (DequantizeLinear outputs its scale's type)."""
    ONE_DIMENSIONAL = "one_dimensional"
    """A scalar or 1-D tensor (a bias): one scale per element saves nothing."""
    GRAPH_INPUT = "graph_input"
    """The initializer is also a graph input, so a caller may replace it."""
    NOT_FINITE = "not_finite"
    """It holds NaN or Inf, which int8 cannot represent."""
    IN_FUNCTION = "in_function"
    """Inside a model-local function (functions hold no initializers)."""

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS: dict[KeptReason, str] = {
    KeptReason.OPSET_BELOW_13: "opset below 13: no per-axis DequantizeLinear",
    KeptReason.OPSET_BELOW_7: "opset below 7: no per-axis DequantizeLinear, no broadcasting Mul",
    KeptReason.UNSUPPORTED_DTYPE: "not float32 (float16 needs opset 19)",
    KeptReason.ONE_DIMENSIONAL: "scalar or 1-D",
    KeptReason.GRAPH_INPUT: "initializer is also a graph input",
    KeptReason.NOT_FINITE: "holds NaN or Inf",
    KeptReason.IN_FUNCTION: "inside a model-local function",
}


@dataclasses.dataclass
class StoredTensor:
    """A tensor now stored as int8: its bytes before and after (int8 data plus scales)."""

    name: str
    shape: list[int]
    dtype: str
    axis: int
    bytes_before: int
    bytes_after: int

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "saved_bytes": self.saved_bytes}


@dataclasses.dataclass
class KeptTensor:
    """A float tensor of at least :data:`MIN_BYTES` left as it was, and why."""

    name: str
    shape: list[int]
    bytes: int
    reason: KeptReason

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": self.shape,
            "bytes": self.bytes,
            "reason": self.reason.value,
            "description": self.reason.description,
        }


@dataclasses.dataclass
class OtherWeightsResult:
    """What :func:`quantize_other_weights` did (``mode`` ``int8`` or ``keep``)."""

    mode: str = "keep"
    stored: list[StoredTensor] = dataclasses.field(default_factory=list)
    kept: list[KeptTensor] = dataclasses.field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(t.saved_bytes for t in self.stored)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "min_bytes": MIN_BYTES,
            "saved_bytes": self.saved_bytes,
            "stored": [t.to_dict() for t in self.stored],
            "kept": [t.to_dict() for t in self.kept],
        }


@dataclasses.dataclass
class _Candidate:
    """A float tensor to store as int8: an initializer (``value``) or a Constant (``node``)."""

    graph: ir.Graph
    value: ir.Value
    tensor: ir.TensorProtocol
    node: ir.Node | None = None


def quantize_data_int8(array: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 data and one scale per slice along ``axis``, by onnxruntime's ``quantize_data``.

    Symmetric int8 (``[-127, 127]``, zero point 0), as onnxruntime quantizes int8
    weights; a slice of zeros gets the scale 1. The scales have ``array``'s dtype.
    """
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    moved = np.moveaxis(array, axis, 0)
    rows = moved.reshape(moved.shape[0], -1)
    q = np.empty(rows.shape, dtype=np.int8)
    scales = np.empty(rows.shape[0], dtype=array.dtype)
    for i in range(rows.shape[0]):
        zero_point, scale, q[i] = quantize_data(rows[i], TensorProto.INT8, True)
        assert int(zero_point) == 0, "symmetric int8 has zero point 0"
        scales[i] = scale
    return np.ascontiguousarray(np.moveaxis(q.reshape(moved.shape), 0, axis)), scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray, axis: int) -> np.ndarray:
    """What DequantizeLinear computes: ``q * scale`` per slice along ``axis``, in the scale's type."""
    shape = [1] * q.ndim
    shape[axis] = -1
    result: np.ndarray = q.astype(scales.dtype) * scales.reshape(shape)
    return result


def choose_axis(value: ir.Value, rank: int) -> int:
    """The axis that gets one scale per slice, from the tensor's consumers.

    Conv: output channels (0); ConvTranspose: output channels (1); Gather: the gathered
    axis; MatMul input B: the output columns (last); otherwise, and when consumers
    disagree, one scale per row of the last dimension (``rank - 2``).
    """
    axes = set()
    for use in value.uses():
        node, index = use.node, use.idx
        op = node.op_type if node.domain in ("", "ai.onnx") else ""
        if op == "Conv" and index == 1:
            axes.add(0)
        elif op == "ConvTranspose" and index == 1:
            axes.add(1)
        elif op == "Gather" and index == 0:
            attr = node.attributes.get("axis")
            axis = attr.as_int() if attr is not None else 0
            axes.add(axis % rank)
        elif op == "MatMul" and index == 1:
            axes.add(rank - 1)
        else:
            axes.add(rank - 2)
    return axes.pop() if len(axes) == 1 else rank - 2


def _is_nbits_weight(value: ir.Value) -> bool:
    """Input B of a MatMul that MatMulNBits can take (left float on purpose when still float),
    or an input of an operator outside the default domain (MatMulNBits' own scales: such
    kernels may need constant inputs)."""
    from onnx_conv2matmul.quantize.projection import constant_2d_weight

    return any(
        (use.idx == 1 and constant_2d_weight(use.node) is value) or use.node.domain not in ("", "ai.onnx")
        for use in value.uses()
    )


def _candidates(model: ir.Model, min_bytes: int) -> list[_Candidate]:
    found: list[_Candidate] = []
    for graph, _ in walk_graphs(model.graph):
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is None or not tensor.dtype.is_floating_point() or tensor.nbytes < min_bytes:
                continue
            if not _is_nbits_weight(value):
                found.append(_Candidate(graph, value, tensor))
        for node in graph:
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
                continue
            attr = node.attributes.get("value")
            if attr is None or attr.is_ref() or attr.type != ir.AttributeType.TENSOR:
                continue
            tensor = attr.as_tensor()
            big = tensor.dtype.is_floating_point() and tensor.nbytes >= min_bytes
            if big and not _is_nbits_weight(node.outputs[0]):
                found.append(_Candidate(graph, node.outputs[0], tensor, node))
    return found


def eligible_arrays(model: ir.Model, min_bytes: int = MIN_BYTES) -> list[tuple[ir.TensorProtocol, int]]:
    """Each tensor :func:`quantize_other_weights` would store as int8, with its axis."""
    opset = default_opset(model) or 0
    return [
        (c.tensor, choose_axis(c.value, len(c.tensor.shape)))
        for c in _candidates(model, min_bytes)
        if _reason(c, opset) is None
    ]


def _reason(candidate: _Candidate, opset: int) -> KeptReason | None:
    tensor = candidate.tensor
    if opset < CAST_MUL_OPSET:
        return KeptReason.OPSET_BELOW_7
    needed = _MIN_OPSET.get(tensor.dtype)
    if needed is None or (opset < needed and not read_through_cast_mul(tensor.dtype, opset)):
        return KeptReason.UNSUPPORTED_DTYPE
    if len(tensor.shape) < 2:
        return KeptReason.ONE_DIMENSIONAL
    if candidate.node is None and candidate.value.is_graph_input():
        return KeptReason.GRAPH_INPUT
    return None


def quantize_other_weights(
    model: ir.Model,
    *,
    min_bytes: int = MIN_BYTES,
    skip: frozenset[str] = frozenset(),
    cache: BlockCache | None = None,
) -> OtherWeightsResult:
    """Store every eligible float tensor of at least ``min_bytes`` as int8, in place.

    ``skip`` names tensors to leave alone (not listed). Local functions are not
    changed; their large float Constants are listed as kept. ``cache``: the int8 data and scales
    of the tensors quantized before (the same model's, by name), read back instead of quantized
    again: the search builds several models from the same weights, and onnxruntime's
    ``quantize_data`` runs once per slice (PP-OCRv4 rec: 4,700 slices, 0.3 s a model).
    """
    result = OtherWeightsResult(mode="int8")
    opset = default_opset(model) or 0
    names = NameAllocator(used_names(model))
    for function in model.functions.values():
        for node in function:
            attr = node.attributes.get("value") if node.op_type == "Constant" else None
            if attr is not None and not attr.is_ref() and attr.type == ir.AttributeType.TENSOR:
                tensor = attr.as_tensor()
                if tensor.dtype.is_floating_point() and tensor.nbytes >= min_bytes:
                    name = node.outputs[0].name or ""
                    result.kept.append(
                        KeptTensor(name, list(tensor.shape.numpy()), tensor.nbytes, KeptReason.IN_FUNCTION)
                    )
    for candidate in _candidates(model, min_bytes):
        name = candidate.value.name or ""
        if name in skip:
            continue
        tensor = candidate.tensor
        shape = [int(d) for d in tensor.shape.numpy()]
        reason = _reason(candidate, opset)
        if reason is not None:
            result.kept.append(KeptTensor(name, shape, int(tensor.nbytes), reason))
            continue
        axis = choose_axis(candidate.value, len(shape))
        key = f"int8|{name}|{shape}|{tensor.dtype.name}|{axis}"
        cached = cache.get(key) if cache is not None else None
        if cached is not None:  # quantized before: it was finite then
            q, scales = np.asarray(cached[0]), np.asarray(cached[1])
        else:
            array = tensor.numpy()
            if not np.isfinite(array).all():
                result.kept.append(KeptTensor(name, shape, int(tensor.nbytes), KeptReason.NOT_FINITE))
                continue
            q, scales = quantize_data_int8(array, axis)
            del array
            if cache is not None:
                cache.put(key, q, scales, np.zeros(0, dtype=np.int8))
        _replace(candidate, q, scales, axis, names, opset)
        result.stored.append(
            StoredTensor(
                name, shape, tensor.dtype.name.lower(), axis, int(tensor.nbytes), q.nbytes + scales.nbytes
            )
        )
        if is_external(tensor):
            tensor.release()
    return result


def _replace(
    candidate: _Candidate, q: np.ndarray, scales: np.ndarray, axis: int, names: NameAllocator, opset: int
) -> None:
    """Put ``DequantizeLinear(q, scales, axis)`` where the float tensor was, under its name;
    below the opset of a per-axis ``DequantizeLinear`` for its type, ``Mul(Cast(q), scales)``
    with the scales shaped to broadcast along ``axis``."""
    graph, old = candidate.graph, candidate.value
    name = old.name or "weight"
    q_value = _initializer(graph, names.new(f"{name}_int8"), q)
    out = ir.Value(name=names.new(f"{name}_dequantized"), type=old.type, shape=old.shape)
    if not read_through_cast_mul(candidate.tensor.dtype, opset):
        s_value = _initializer(graph, names.new(f"{name}_scale"), scales)
        nodes = [
            ir.node(
                "DequantizeLinear",
                [q_value, s_value],
                attributes={"axis": axis},
                outputs=[out],
                name=names.new(f"{name}/DequantizeLinear"),
            )
        ]
    else:
        shape = [1] * q.ndim
        shape[axis] = -1
        s_value = _initializer(graph, names.new(f"{name}_scale"), scales.reshape(shape))
        cast_out = ir.Value(name=names.new(f"{name}_cast"), type=old.type, shape=ir.Shape(list(q.shape)))
        cast = ir.node(
            "Cast",
            [q_value],
            attributes={"to": int(candidate.tensor.dtype)},
            outputs=[cast_out],
            name=names.new(f"{name}/Cast"),
        )
        mul = ir.node("Mul", [cast_out, s_value], outputs=[out], name=names.new(f"{name}/Mul"))
        nodes = [cast, mul]
    anchor = candidate.node if candidate.node is not None else (graph[0] if len(graph) > 0 else None)
    if anchor is not None:
        graph.insert_before(anchor, nodes)
    else:
        graph.extend(nodes)
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    if candidate.node is not None:
        graph.remove(candidate.node, safe=True)
    else:
        graph.initializers.pop(name)
    out.name = name


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.type = ir.TensorType(value.const_value.dtype)  # type: ignore[union-attr]
    value.shape = ir.Shape(list(array.shape))
    graph.register_initializer(value)
    return value
