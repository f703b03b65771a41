"""What the MatMulNBits quantizer takes of a model and would make of it, from shapes alone.

A MatMul is quantizable when its input B is a constant 2-D float weight
(:func:`constant_2d_weight`); :func:`weight_stats` counts those weights' share of the model's,
and :func:`nbits_projection` works out the quantized model's tensor bytes in onnxruntime's
MatMulNBits layout (:func:`matmul_nbits_sizes`) without reading any tensor data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs
from onnx_conv2matmul.quantize.settings import QuantizeOptions

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


@dataclasses.dataclass
class WeightStats:
    """Weight bytes of a model and how many of them the MatMulNBits quantizer takes."""

    total_bytes: int = 0
    quantizable_bytes: int = 0
    quantizable_matmuls: int = 0

    @property
    def share(self) -> float:
        return self.quantizable_bytes / self.total_bytes if self.total_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "share": round(self.share, 4)}


def constant_2d_weight(node: ir.Node) -> ir.Value | None:
    """Input B when it is what MatMulNBits takes: a 2-D float initializer, not a graph input."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    b = node.inputs[1]
    if b is None or not b.is_initializer() or b.is_graph_input() or b.const_value is None:
        return None
    tensor = b.const_value
    if len(tensor.shape) != 2 or tensor.dtype not in _FLOATS:
        return None
    return b


def quantizable_matmuls(model: ir.Model) -> Iterator[tuple[ir.Graph, ir.Node, ir.Value]]:
    """Each MatMul that MatMulNBits takes, in every graph (subgraphs too) in graph order, with
    the graph it is in and its weight (:func:`constant_2d_weight`)."""
    for graph, _ in walk_graphs(model.graph):
        for node in graph:
            b = constant_2d_weight(node)
            if b is not None:
                yield graph, node, b


def weight_stats(model: ir.Model) -> WeightStats:
    """Float weight bytes in every scope, and the share on MatMul input B (quantizable)."""
    stats = WeightStats()
    seen: set[int] = set()
    for graph, _ in walk_graphs(model.graph):
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is not None and tensor.dtype.is_floating_point():
                stats.total_bytes += int(tensor.nbytes)
        for node in graph:
            if node.op_type == "Constant" and "value" in node.attributes:
                attr = node.attributes["value"]
                if attr.type == ir.AttributeType.TENSOR and attr.value.dtype.is_floating_point():
                    stats.total_bytes += int(attr.value.nbytes)
            b = constant_2d_weight(node)
            if b is not None:
                stats.quantizable_matmuls += 1
                if id(b) not in seen:
                    seen.add(id(b))
                    stats.quantizable_bytes += int(b.const_value.nbytes)  # type: ignore[union-attr]
    return stats


def matmul_nbits_sizes(k: int, n: int, scale_itemsize: int, options: QuantizeOptions) -> tuple[int, int, int]:
    """The bytes of the tensors MatMulNBits gets for a ``[K, N]`` weight: (packed, scales, zero points).

    onnxruntime's layout (``DefaultWeightOnlyQuantizer.qbits_block_quant``, QOperator format):
    K is padded to whole blocks; B is uint8 ``[N, blocks, block_size * bits / 8]``; the scales
    are ``[N, blocks]`` in the weight's float type (bfloat16 stays 2 bytes); the zero points,
    only when asymmetric, are uint8 ``[N, ceil(blocks / (8 / bits))]`` (two 4-bit points a byte).
    """
    blocks = -(-k // options.block_size)
    per_byte = 8 // options.bits
    packed = n * blocks * (-(-options.block_size // per_byte))
    scales = n * blocks * scale_itemsize
    zero_points = 0 if options.symmetric else n * (-(-blocks // per_byte))
    return packed, scales, zero_points


def nbits_projection(before: ir.Model, after: ir.Model, options: QuantizeOptions) -> NBitsProjection:
    """What :func:`~onnx_conv2matmul.quantize.nbits.quantize_matmul_nbits` would make of ``after``
    (``before`` rewritten), from shapes.

    Reads no tensor data. Every MatMul whose input B :func:`weight_stats` counts as
    quantizable gets MatMulNBits (the include and exclude patterns are not applied); a weight
    shared by several of them is quantized once, and its float bytes go when every reader
    is quantized.
    """
    from onnx_conv2matmul.files.load import tensor_bytes

    projection = NBitsProjection(
        bits=options.bits,
        block_size=options.block_size,
        symmetric=options.symmetric,
        weights_without_rewrite=weight_stats(before),
        weights_with_rewrite=weight_stats(after),
        tensor_bytes=tensor_bytes(after),
    )
    weights: dict[int, ir.Value] = {}
    readers: dict[int, int] = {}
    for _, _, b in quantizable_matmuls(after):
        weights[id(b)] = b
        readers[id(b)] = readers.get(id(b), 0) + 1
    for key, b in weights.items():
        tensor = b.const_value
        assert tensor is not None
        k, n = (int(d) for d in tensor.shape.numpy())
        packed, scales, zero_points = matmul_nbits_sizes(k, n, int(tensor.dtype.itemsize), options)
        projection.packed_bytes += packed
        projection.scale_bytes += scales
        projection.zero_point_bytes += zero_points
        if len(b.uses()) == readers[key] and not b.is_graph_output():
            projection.float_bytes_removed += int(tensor.nbytes)
    return projection


@dataclasses.dataclass
class NBitsProjection:
    """What MatMulNBits quantization would make of a model, worked out from shapes alone.

    Attributes:
        bits, block_size, symmetric: The quantizer's settings.
        weights_without_rewrite: Float weight bytes of the model as it is, and the share on
            MatMul input B (what the quantizer takes).
        weights_with_rewrite: The same after the rewrite.
        packed_bytes: The quantized weights, ``[N, ceil(K / block), block * bits / 8]`` uint8
            each.
        scale_bytes: The scales, ``[N, ceil(K / block)]`` in the weight's float type each.
        zero_point_bytes: The zero points (asymmetric only), ``[N, ceil(blocks * bits / 8)]``
            uint8 each.
        float_bytes_removed: The float weights the quantized ones replace (a weight another
            node also reads stays).
        tensor_bytes: Every tensor of the rewritten model, in bytes.
        projected_tensor_bytes: The same after quantization.
        model_bytes: The input's files (the ``.onnx`` and its external data).
        projected_model_bytes: The quantized model's files: ``projected_tensor_bytes`` plus
            what the input's files hold besides tensors (the graph, names, attributes).
    """

    bits: int
    block_size: int
    symmetric: bool
    weights_without_rewrite: WeightStats
    weights_with_rewrite: WeightStats
    packed_bytes: int = 0
    scale_bytes: int = 0
    zero_point_bytes: int = 0
    float_bytes_removed: int = 0
    tensor_bytes: int = 0
    model_bytes: int = 0

    @property
    def quantized_bytes(self) -> int:
        return self.packed_bytes + self.scale_bytes + self.zero_point_bytes

    @property
    def projected_tensor_bytes(self) -> int:
        return self.tensor_bytes - self.float_bytes_removed + self.quantized_bytes

    @property
    def projected_model_bytes(self) -> int:
        return self.projected_tensor_bytes + self.model_bytes - self.tensor_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "weights_without_rewrite": self.weights_without_rewrite.to_dict(),
            "weights_with_rewrite": self.weights_with_rewrite.to_dict(),
            "matmul_nbits": self.weights_with_rewrite.quantizable_matmuls,
            "packed_bytes": self.packed_bytes,
            "scale_bytes": self.scale_bytes,
            "zero_point_bytes": self.zero_point_bytes,
            "float_bytes_removed": self.float_bytes_removed,
            "tensor_bytes": self.tensor_bytes,
            "projected_tensor_bytes": self.projected_tensor_bytes,
            "model_bytes": self.model_bytes,
            "projected_model_bytes": self.projected_model_bytes,
        }
