"""Ways to rank the MatMuls by how much their quantization hurts, for the search to allocate bits.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.quantize.search_options import CRITERIA, FLOAT, Setting

NNCF_RANKERS = CRITERIA[2:]
"""NNCF's mixed-precision criteria, as rebuilt here."""

_EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass
class InputStats:
    """Statistics of one MatMul input over the runs that measured it (see :meth:`add`)."""

    runs: int = 0
    mean_square: float = 0.0  # summed over runs
    mean_variance: float = 0.0
    max_variance: float = 0.0
    mean_magnitude: float = 0.0

    def add(self, x: np.ndarray) -> None:
        """One run's input ``x`` (read as ``[..., tokens, channels]``)."""
        a = np.asarray(x, dtype=np.float64)
        if a.ndim < 2:
            a = a.reshape(1, -1)
        if a.size == 0:
            return
        variance = a.var(axis=-2)
        self.runs += 1
        self.mean_square += float(np.mean(a * a))
        self.mean_variance += float(variance.mean())
        self.max_variance += float(variance.max())
        self.mean_magnitude += float(np.abs(a).max(axis=-2).mean())

    def mean(self, field: str) -> float:
        return float(getattr(self, field)) / self.runs if self.runs else 0.0


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


def rescale(
    nodes: Sequence[Any], loss: Callable[[str, Setting], float]
) -> list[tuple[str, str, float, float]]:
    """Give each node's errors the scale ``loss(name, smallest setting)`` says, keeping the ratios
    between its settings; ``(node, setting, predicted, loss)`` per node that has a quantized setting.

    ``nodes`` are the search's nodes (``name`` and ``options``: setting to (error, bytes)).
    """
    found = []
    for node in nodes:
        quantized = {s: v for s, v in node.options.items() if s != FLOAT}
        if not quantized:
            continue
        smallest = min(quantized, key=lambda s: (quantized[s][1], quantized[s][0]))
        predicted = max(quantized[smallest][0], 1e-12)
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
# The search's error model (:mod:`onnx_conv2matmul.quantize.sensitivity`) predicts each node's
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
