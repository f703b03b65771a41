"""The search's model of the quantization error (see :mod:`onnx_conv2matmul.quantize.search`,
steps 2 and 3): the quantizable MatMuls, each one's error and size under every setting of the
ladder weighted by its input's activations, the other weights' int8 error, and the trade-offs at
which a node's cheapest setting changes.

Ways to rank the MatMuls by how much their quantization hurts, for the search to allocate bits.

The search (:mod:`onnx_conv2matmul.quantize.search`) gives each MatMul, per setting of its
ladder, a predicted error: the weight's quantization error weighted by the energy of its input
channels. A *criterion* replaces the scale of that error per node, keeping the ratios between a
node's own settings: the node's error at its smallest setting becomes the criterion's score of
the node, so the allocation spends bytes where the criterion says they matter most. Criteria:

- ``predicted``: the search's own prediction, unchanged;
- ``measured``: the loss measured with the node quantized alone on the inputs
  (:func:`calibrate`, below), the default with the user's inputs;
- the rankers of NNCF's weight compression (its mixed-precision criteria), rebuilt here from the
  statistics the search already collects: each scores a node by its weight's int8 round-to-nearest
  error (per output channel, asymmetric) and a statistic of its input, the activation ``x`` read as
  ``[..., tokens, channels]`` per run:

  - ``weight_error``: ``1 / e`` where ``e`` is the largest, over output channels, mean square
    int8 error (data-free: a weight that int8 already hurts ranks low and goes to 4 bits first, as
    NNCF's baseline does);
  - ``hawq``: the Frobenius norm of the int8 error times the mean over runs of
    ``2 * mean(x ** 2)`` (an average Hessian trace of a least-squares layer);
  - ``mean_variance``: ``1 / e`` times the mean over channels of the variance over tokens;
  - ``max_variance``: ``1 / e`` times the largest such variance;
  - ``mean_magnitude``: ``1 / e`` times the mean over channels of the largest ``|x|`` over tokens.

  A higher score keeps more bits. NNCF takes these to pick which layers stay at the backup
  precision for a fixed ratio; here they only rank, and the search still finds how many nodes the
  target lets go to fewer bits.

Which one measures best on trained models is in docs/quantize.md; ``measured`` is the default
with the user's inputs, ``predicted`` without.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import release_if_external
from onnx_conv2matmul.quantize import other_weights
from onnx_conv2matmul.quantize.blockwise import (
    _sampled_columns,
    _weighted_error,
    block_dequantize,
    block_quantize,
)
from onnx_conv2matmul.quantize.projection import quantizable_matmuls
from onnx_conv2matmul.quantize.reference import InputStats
from onnx_conv2matmul.quantize.search_options import CRITERIA, FLOAT, AutoOptions, Setting
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
        release_if_external(b.const_value)
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
        finite = bool(np.isfinite(array).all())
        if finite:
            q, scales = other_weights.quantize_data_int8(array, axis)
            approx = other_weights.dequantize_int8(q, scales, axis)
            diff = float(np.square(array.astype(np.float64) - approx).sum())
            norm = float(np.square(array.astype(np.float64)).sum())
        del array
        release_if_external(tensor)
        if not finite:
            continue
        error = diff / norm if norm > 0 else 0.0
        worst = error if worst is None else max(worst, error)
        kept += int(tensor.nbytes)
        stored += q.nbytes + scales.nbytes
    return None if worst is None else (worst, kept, stored)


# --------------------------------------------------------------------------- #
# Rankers
# --------------------------------------------------------------------------- #

NNCF_RANKERS = CRITERIA[2:]
"""NNCF's mixed-precision criteria, as rebuilt here."""

_EPS = float(np.finfo(np.float32).eps)


def int8_errors(weight: np.ndarray) -> tuple[float, float]:
    """The int8 round-to-nearest error of ``weight [K, N]`` quantized per output channel (column),
    asymmetric: the largest per-column mean square error and the Frobenius norm of the error."""
    w = np.asarray(weight, dtype=np.float64)
    low = np.minimum(w.min(axis=0), 0.0)
    high = np.maximum(w.max(axis=0), 0.0)
    scale = (high - low) / 255.0
    scale[scale == 0] = 1.0
    zero = np.round(-low / scale)
    q = np.clip(np.round(w / scale) + zero, 0, 255)
    diff = (q - zero) * scale - w
    return float((diff * diff).mean(axis=0).max()), float(np.sqrt((diff * diff).sum()))


def score(criterion: str, weight: np.ndarray, stats: InputStats | None) -> float:
    """A node's score under one of :data:`NNCF_RANKERS` (higher: keep more bits)."""
    max_mean, frobenius = int8_errors(weight)
    inverse = 1.0 / (max_mean + _EPS)
    if criterion == "weight_error":
        return inverse
    if stats is None or not stats.runs:
        return inverse if criterion != "hawq" else frobenius
    if criterion == "hawq":
        return frobenius * 2.0 * stats.mean("mean_square")
    if criterion in ("mean_variance", "max_variance", "mean_magnitude"):
        return inverse * stats.mean(criterion)
    raise ValueError(f"unknown criterion {criterion!r}; one of {', '.join(CRITERIA)}")


def smallest_setting(node: Any) -> Setting | None:
    """The quantized setting of ``node`` (``options``: setting to (error, bytes)) whose weights
    take the fewest bytes, the least error among those; None when it has no quantized one."""
    quantized: dict[Setting, tuple[float, int]] = {s: v for s, v in node.options.items() if s != FLOAT}
    if not quantized:
        return None
    return min(quantized, key=lambda s: (quantized[s][1], quantized[s][0]))


def rescale(
    nodes: Sequence[Any], loss: Callable[[str, Setting], float]
) -> list[tuple[str, str, float, float]]:
    """Give each node's errors the scale ``loss(name, smallest setting)`` says, keeping the ratios
    between its settings; ``(node, setting, predicted, loss)`` per node that has a quantized setting.

    ``nodes`` are the search's nodes (``name`` and ``options``: setting to (error, bytes)).
    """
    found = []
    for node in nodes:
        smallest = smallest_setting(node)
        if smallest is None:
            continue
        predicted = max(node.options[smallest][0], 1e-12)
        value = max(0.0, loss(node.name, smallest))
        node.options = {s: (error * value / predicted, size) for s, (error, size) in node.options.items()}
        found.append((node.name, smallest.label, predicted, value))
    return found


def rank(
    criterion: str,
    nodes: Sequence[Any],
    weights: Callable[[str], np.ndarray],
    stats: Mapping[str, InputStats],
) -> dict[str, float]:
    """Rescale ``nodes`` by one of :data:`NNCF_RANKERS`; each node's score by name.

    ``weights(name)`` is the node's weight ``[K, N]``; ``stats`` the statistics of the MatMul
    inputs by the input's name (a node whose input was not measured is scored by its weight alone).
    The scores are normalised to the sum of the nodes' predicted errors at their smallest
    setting (the search's steps are in the scale of the error).
    """
    if criterion not in NNCF_RANKERS:
        raise ValueError(f"unknown ranker {criterion!r}; one of {', '.join(NNCF_RANKERS)}")
    scores: dict[str, float] = {}
    for node in nodes:
        if any(s != FLOAT for s in node.options):
            scores[node.name] = score(criterion, weights(node.name), stats.get(node.a_name or ""))
    total = sum(scores.values())
    predicted = 0.0
    for node in nodes:
        quantized = [v for s, v in node.options.items() if s != FLOAT]
        if quantized:
            predicted += min(quantized, key=lambda v: (v[1], v[0]))[0]
    factor = predicted / total if total > 0 and predicted > 0 else 1.0
    normalised = {name: value * factor for name, value in scores.items()}
    rescale(nodes, lambda name, _setting: normalised[name])
    return normalised


# --------------------------------------------------------------------------- #
# Measured sensitivity
# --------------------------------------------------------------------------- #

# Sensitivity measured on the user's inputs: each MatMul quantized alone, its output error measured.
#
# The search's error model (above) predicts each node's
# error from its weights and the energy of its input channels. On a trained CNN the prediction
# can rank the nodes wrongly: the error a layer's weights make is not what the outputs show after
# the layers that follow (normalisations, activations, pooling) have taken it in. With real inputs
# (``--inputs``), :func:`calibrate` measures it instead: each quantizable MatMul is quantized alone
# at its smallest setting, the model is run on every feed, and the loss is ``1 -`` the worst
# per-sample cosine similarity of the float outputs to fp32. Each node's predicted errors (all its
# settings) are scaled by the ratio of that measured loss to its predicted error at that setting, so
# the allocation ranks nodes by what they do to the outputs, and the ratios between a node's own
# settings stay as predicted. One full-model run per node and feed: a few seconds per node on a
# 10 MiB recognizer with 50 lines, which is why it runs only on real inputs by default
# (``AutoOptions.measure``).


@dataclasses.dataclass(frozen=True)
class Measured:
    """One node quantized alone: its setting, the predicted error and the measured loss."""

    node: str
    setting: str
    predicted: float
    measured: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def calibrate(nodes: Sequence[Any], loss_alone: Callable[[str, Setting], float]) -> list[Measured]:
    """Scale each node's predicted errors by its measured loss (see the comment above).

    ``nodes`` are the search's nodes (``name`` and ``options``: setting to (error, bytes));
    ``loss_alone(name, setting)`` builds the model with only that node quantized and returns
    ``1 - worst cosine`` over the feeds. Nodes with no quantized setting are left as they are.
    """
    return [Measured(*row) for row in rescale(nodes, loss_alone)]
