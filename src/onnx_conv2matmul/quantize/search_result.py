"""What the search (:mod:`onnx_conv2matmul.quantize.search`) found: the per-node settings
(:class:`AutoConfig`), each full-model evaluation, each node's choice, and the result the
report carries; :func:`apply` quantizes a model with a found configuration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import onnx_ir as ir

from onnx_conv2matmul.quantize import other_weights
from onnx_conv2matmul.quantize.blockwise import (
    BlockCache,
)
from onnx_conv2matmul.quantize.metric import MetricTarget
from onnx_conv2matmul.quantize.nbits import NBitsResult, quantize_matmul_nbits
from onnx_conv2matmul.quantize.reference import Reference
from onnx_conv2matmul.quantize.search_options import Setting
from onnx_conv2matmul.quantize.settings import QuantizeOptions


@dataclasses.dataclass
class AutoConfig:
    """A chosen configuration: a setting per MatMul (by name) and the other weights' storage.

    :meth:`quantize_options` gives the equivalent options and :meth:`to_config` the settings
    file ``quantize --config`` reads; :func:`apply` quantizes a model with them.
    """

    nodes: dict[str, Setting]
    other_weights: bool = False
    accuracy_level: int = 0

    def quantize_options(self) -> QuantizeOptions:
        """The equivalent options: every candidate node named in ``nodes`` (which overrides
        the other settings), every other MatMul excluded, so it stays in float."""
        return QuantizeOptions(accuracy_level=self.accuracy_level).only(
            {name: setting.node_setting() for name, setting in sorted(self.nodes.items())},
            "int8" if self.other_weights else "keep",
        )

    def to_config(self) -> dict[str, Any]:
        """The equivalent options as a settings file holds them (``quantize --config``)."""
        return self.quantize_options().to_config()

    def counts(self) -> dict[str, int]:
        """How many nodes take each setting, by label."""
        counts: dict[str, int] = {}
        for setting in self.nodes.values():
            counts[setting.label] = counts.get(setting.label, 0) + 1
        return dict(sorted(counts.items()))


@dataclasses.dataclass
class Evaluation:
    """One full-model evaluation: the trade-off, the chosen weights' bytes, what was measured.

    ``min_cosine`` is the worst per-sample cosine over the feeds run (None when no minimum
    was asked for), ``feeds_run`` how many feeds ran before the first one below the
    minimum ended it; ``score`` and ``drop`` are the user's metric (None when not asked
    for, or not taken because the cosine failed already).
    """

    tradeoff: float
    weight_bytes: int
    min_cosine: float | None
    passed: bool
    seconds: float
    note: str = ""
    feeds_run: int = 0
    score: float | None = None
    drop: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """As JSON: the all-float trade-off (infinite) is null."""
        data = dataclasses.asdict(self)
        data["tradeoff"] = None if math.isinf(self.tradeoff) else self.tradeoff
        return data


@dataclasses.dataclass
class NodeChoice:
    """A MatMul in the result: its weight shape, setting, predicted error and bytes."""

    name: str
    k: int
    n: int
    setting: Setting
    error: float
    weight_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "k": self.k,
            "n": self.n,
            **self.setting.to_dict(),
            "label": self.setting.label,
            "predicted_error": self.error,
            "weight_bytes": self.weight_bytes,
        }


@dataclasses.dataclass
class AutoResult:
    """The search's outcome: the configuration, how it was found, and how long it took.

    ``reference`` is what the fp32 model gave on the feeds (its files live in the search's
    folder): the final accuracy check compares against it instead of running fp32 again.
    """

    min_cosine: float | None
    config: AutoConfig
    reached_cosine: float | None
    choices: list[NodeChoice]
    other_weights_error: float | None
    evaluations: list[Evaluation]
    feeds: int
    sensitivity_seconds: float = 0.0
    seconds: float = 0.0
    metric: MetricTarget | None = None
    original_score: float | None = None
    reached_score: float | None = None
    reference: Reference | None = dataclasses.field(default=None, repr=False, compare=False)
    cache: BlockCache | None = dataclasses.field(default=None, repr=False, compare=False)
    checked: tuple[str, list[Any]] | None = dataclasses.field(default=None, repr=False, compare=False)
    """The result's digest and the accuracy check's rows of its evaluation (when the search was
    given the check's options): :meth:`Reference.check` of a model with that digest uses them."""

    def to_dict(self) -> dict[str, Any]:
        metric = None
        if self.metric is not None:
            metric = {
                **self.metric.to_dict(),
                "original_score": self.original_score,
                "reached_score": self.reached_score,
            }
        return {
            "min_cosine": self.min_cosine,
            "reached_cosine": self.reached_cosine,
            "metric": metric,
            "feeds": self.feeds,
            "seconds": round(self.seconds, 2),
            "sensitivity_seconds": round(self.sensitivity_seconds, 2),
            "full_evaluations": len(self.evaluations),
            "evaluations": [e.to_dict() for e in self.evaluations],
            "settings": self.config.counts(),
            "other_weights": "int8" if self.config.other_weights else "keep",
            "other_weights_error": self.other_weights_error,
            "nodes": [c.to_dict() for c in self.choices],
            "config": self.config.to_config(),
        }


def apply(
    model: ir.Model, config: AutoConfig, cache: BlockCache | None = None
) -> tuple[NBitsResult, other_weights.OtherWeightsResult | None]:
    """Quantize ``model`` in place as ``config`` says, as ``quantize`` does with its options.

    Returns the MatMulNBits totals and, when the other weights are stored as int8, their result.
    ``cache`` keeps the quantized weights (the MatMuls' blocks, the other weights' int8) for the
    next model built (the same bytes).
    """
    options = config.quantize_options()
    result = quantize_matmul_nbits(model, options, cache=cache)
    others = None
    if options.other_weights == "int8":
        others = other_weights.quantize_other_weights(model, cache=cache)
    return result, others


def _graphs(model: ir.Model) -> list[tuple[ir.Graph, str]]:
    from onnx_conv2matmul._graphs import walk_graphs

    return list(walk_graphs(model.graph))
