"""The report types of the Transposes trade (see :mod:`onnx_conv2matmul.quantize.transposes`): the
preference, both models and the one kept. Apart from the measuring code, so the quantize report
can name them without importing what measures."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

MIN_SHARE = 0.01
"""Convs that add Transposes and hold less than this share of the float weights are not weighed:
the rewrite leaves them (quantizing them would change the size by less than the noise of a
measurement changes the latency)."""

DEFAULT_MARGIN = 0.10
"""By default the model kept may be at most this much slower than the original (a latency ratio
of at most 1.10, geometric mean over the inputs timed)."""

BEYOND = 1.5
"""A smaller model timed beyond the margin by less than this many margins (against the original)
is timed twice more before it is left (see ``transposes._hinges_on_the_margin``)."""


class Prefer(str, enum.Enum):
    """What the choice of ``--prefer`` favours."""

    SIZE = "size"
    SPEED = "speed"
    BALANCED = "balanced"


@dataclasses.dataclass(frozen=True)
class TransposeOptions:
    """The preference, the margin of the default, and (for tests) the timing's clock and sessions."""

    prefer: Prefer = Prefer.BALANCED
    margin: float = DEFAULT_MARGIN
    clock: Callable[[], float] | None = dataclasses.field(default=None, compare=False)
    session_factory: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 10:
            raise ValueError(f"the latency margin must be in [0, 10), got {self.margin}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One of the two models: with or without the convs that add Transposes."""

    name: str
    with_transposes: bool
    bytes: int
    passed: bool
    ratios: tuple[float, ...] | None = None
    quantized_nodes: int = 0
    not_made: str = ""
    """Why the model was not made (it could not be the one kept); empty when it was."""
    none_quantized: str = ""
    """Why a model made with no quantized node has none (its run's own reason); empty otherwise."""
    as_original: bool = False
    """Made with no node rewritten or quantized: the original's graph, whose latency is the
    original's (1.0) without timing it."""

    @property
    def speed(self) -> float | None:
        """The geometric mean of the latency ratios (None when not timed; 1.0 for a model that is
        the original's graph)."""
        if self.as_original:
            return 1.0
        if not self.ratios:
            return None
        return math.exp(sum(math.log(r) for r in self.ratios) / len(self.ratios))

    def to_dict(self, original_bytes: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "with_transposes": self.with_transposes,
            "bytes": self.bytes,
            "size_ratio": round(self.bytes / original_bytes, 4) if original_bytes else None,
            "quantized_nodes": self.quantized_nodes,
            "meets_criterion": self.passed,
            "latency_ratios": None if self.ratios is None else [round(r, 4) for r in self.ratios],
            "latency_ratio": None if self.speed is None else round(self.speed, 4),
            "not_made": self.not_made or None,
            "none_quantized": self.none_quantized or None,
            "as_original": self.as_original,
        }


@dataclasses.dataclass(frozen=True)
class TransposeTrade:
    """What the convs that add Transposes weigh, both models, and the one kept."""

    convs: int
    weight_share: float
    original_bytes: int
    layouts: tuple[Layout, ...]
    prefer: Prefer
    margin: float
    kept: int
    reason: str
    timed_on: str = ""

    @property
    def chosen(self) -> Layout:
        return self.layouts[self.kept]

    def to_dict(self) -> dict[str, Any]:
        return {
            "convs": self.convs,
            "weight_share": round(self.weight_share, 4),
            "prefer": self.prefer.value,
            "margin": self.margin,
            "models": [layout.to_dict(self.original_bytes) for layout in self.layouts],
            "kept": self.chosen.name,
            "with_transposes": self.chosen.with_transposes,
            "reason": self.reason,
            "timed_on": self.timed_on,
        }


def median_of(rounds: Sequence[Layout]) -> Layout:
    """The last of ``rounds`` (the same layout timed three times) with, at each input, the median
    of its latency ratios; the median of the three as a whole when they were not timed at the
    same inputs."""
    last = rounds[-1]
    if all(layout.ratios and len(layout.ratios) == len(last.ratios or ()) for layout in rounds):
        columns = zip(*(layout.ratios or () for layout in rounds), strict=True)
        return dataclasses.replace(last, ratios=tuple(sorted(column)[len(rounds) // 2] for column in columns))
    return sorted(rounds, key=lambda layout: layout.speed or 0.0)[len(rounds) // 2]
