"""The search's model of the quantization error (see :mod:`onnx_conv2matmul.quantize.search`,
steps 2 and 3): the quantizable MatMuls, each one's error and size under every setting of the
ladder weighted by its input's activations, the other weights' int8 error, and the trade-offs at
which a node's cheapest setting changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import is_external
from onnx_conv2matmul.quantize import other_weights
from onnx_conv2matmul.quantize.blockwise import (
    _sampled_columns,
    _weighted_error,
    block_dequantize,
    block_quantize,
)
from onnx_conv2matmul.quantize.projection import quantizable_matmuls
from onnx_conv2matmul.quantize.search_options import FLOAT, AutoOptions, Setting
from onnx_conv2matmul.quantize.search_result import AutoConfig

# --------------------------------------------------------------------------- #
# Sensitivity
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class MatMulNode:
    """A quantizable MatMul: name, the input A's name, and per setting (error, bytes)."""

    name: str
    a_name: str | None
    k: int
    n: int
    float_bytes: int
    options: dict[Setting, tuple[float, int]] = dataclasses.field(default_factory=dict)

    def choose(self, tradeoff: float) -> tuple[Setting, float, int]:
        """The option with the least ``bytes + tradeoff * error`` (float: error 0); ties: fewer bytes.

        An infinite trade-off gives float.
        """
        if math.isinf(tradeoff):
            return FLOAT, 0.0, self.float_bytes
        best: tuple[Setting, float, int] = (FLOAT, 0.0, self.float_bytes)
        best_cost = float(self.float_bytes)
        for setting, (error, size) in self.options.items():
            cost = size + tradeoff * error
            if cost < best_cost or (cost == best_cost and size < best[2]):
                best, best_cost = (setting, error, size), cost
        return best


def _breakpoints(items: Sequence[MatMulNode]) -> list[float]:
    """The trade-offs at which some item's choice may change, ascending.

    An item switches from a smaller option to a larger, more accurate one where
    ``bytes + tradeoff * error`` is equal for both.
    """
    points: set[float] = set()
    for item in items:
        options = [(0.0, item.float_bytes), *item.options.values()]
        for error_a, bytes_a in options:
            for error_b, bytes_b in options:
                if bytes_a < bytes_b and error_a > error_b:
                    points.add((bytes_b - bytes_a) / (error_a - error_b))
    return sorted(points)


def _weight_bytes(nodes: Sequence[MatMulNode], config: AutoConfig) -> int:
    total = 0
    for node in nodes:
        setting = config.nodes[node.name]
        total += node.float_bytes if setting.bits is None else node.options[setting][1]
    return total


def _quantizable(model: ir.Model, options: AutoOptions) -> list[MatMulNode]:
    """The named MatMuls MatMulNBits takes that the options select, in graph order (names unique)."""
    nodes: dict[str, MatMulNode] = {}
    for graph, node, b in quantizable_matmuls(model):
        name = node.name or ""
        if not name or name in nodes or not options.selects(name):
            continue
        a = node.inputs[0]
        in_main = graph is model.graph and a is not None and not a.is_initializer()
        k, n = (int(d) for d in b.const_value.shape.numpy())  # type: ignore[union-attr]
        a_name = a.name if in_main and a is not None else None
        nodes[name] = MatMulNode(name, a_name, k, n, int(b.const_value.nbytes))  # type: ignore[union-attr]
    return list(nodes.values())


def _sensitivities(
    model: ir.Model,
    nodes: Sequence[MatMulNode],
    ladder: Sequence[Setting],
    activations: Mapping[str, np.ndarray],
    ladders: Mapping[str, Sequence[Setting]] | None = None,
) -> None:
    """Fill each node's (error, bytes) per setting of the ladder (of its own in ``ladders``, by
    name, when given there: a node whose ladder is empty stays float, its weight not read)."""
    by_name = {node.name: node for node in nodes}
    if ladders is not None:
        by_name = {name: node for name, node in by_name.items() if ladders.get(name, ladder)}
    for _, node, b in quantizable_matmuls(model):
        entry = by_name.get(node.name or "")
        if entry is None or entry.options:
            continue
        columns = _sampled_columns(entry.n)
        full = b.const_value.numpy()  # type: ignore[union-attr]
        weight = np.ascontiguousarray(full[:, columns])
        del full
        if is_external(b.const_value):
            b.const_value.release()  # type: ignore[union-attr,unused-ignore]
        h = activations.get(entry.a_name or "")
        if h is None or h.shape != (entry.k,):
            h = np.ones(entry.k)
        scaled = entry.n / len(columns)  # bytes are per column
        as_float = weight.astype(np.float32)
        for setting in ladder if ladders is None else ladders.get(entry.name, ladder):
            assert setting.bits is not None
            packed, scales, zero_points = block_quantize(weight, setting)
            approx = block_dequantize(packed, scales, zero_points, setting.bits, entry.k)
            size = packed.nbytes + scales.nbytes + (0 if zero_points is None else zero_points.nbytes)
            entry.options[setting] = (_weighted_error(as_float, approx, h), round(size * scaled))
        del weight, as_float


def _other_weights_error(model: ir.Model) -> tuple[float, int, int] | None:
    """The other weights' largest relative int8 error, their bytes, their bytes as int8 (None: none)."""
    worst: float | None = None
    kept = stored = 0
    for tensor, axis in other_weights.eligible_arrays(model):
        array = tensor.numpy()
        if not np.isfinite(array).all():
            continue
        q, scales = other_weights.quantize_data_int8(array, axis)
        approx = other_weights.dequantize_int8(q, scales, axis)
        diff = float(np.square(array.astype(np.float64) - approx).sum())
        norm = float(np.square(array.astype(np.float64)).sum())
        error = diff / norm if norm > 0 else 0.0
        worst = error if worst is None else max(worst, error)
        kept += int(tensor.nbytes)
        stored += q.nbytes + scales.nbytes
    return None if worst is None else (worst, kept, stored)
