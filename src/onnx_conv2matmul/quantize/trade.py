"""The report types of the Transposes trade (see :mod:`onnx_conv2matmul.quantize.transposes`): the
preference, both models and the one kept, and the rule that keeps one (:func:`choose`). Apart from
the measuring code, so the quantize report can name them without importing what measures."""

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


def size_text(count: int) -> str:
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


MIN_SIZE_GAIN = 0.10
"""By default a model slower than another is kept for its size only when it is at least this much
smaller (as the margin lets it be at most 10% slower than the original)."""


def choose(
    layouts: Sequence[Layout], prefer: Prefer, margin: float, untimed: str = "not timed"
) -> tuple[int, str]:
    """The index of the layout kept, and why (see the module's description); ``untimed`` says
    why the layouts have no timings.

    A layout that misses the accuracy criterion is never kept while another meets it."""
    if not layouts:
        raise ValueError("no model to choose from")
    eligible = [i for i, layout in enumerate(layouts) if layout.passed] or list(range(len(layouts)))

    def size(i: int) -> tuple[int, int]:
        return layouts[i].bytes, i

    def speed(i: int) -> tuple[float, int]:
        value = layouts[i].speed
        return (math.inf if value is None else value), i

    def described(i: int) -> str:
        value = layouts[i].speed
        timing = "" if value is None else f", {value:.2f}x the original's latency"
        if layouts[i].as_original:
            timing = ", the original's graph"
        return f"{layouts[i].name} ({size_text(layouts[i].bytes)}{timing})"

    missed = [layouts[i].name for i in range(len(layouts)) if i not in eligible and not layouts[i].not_made]
    why_not = f"; {', '.join(missed)} missed the accuracy criterion" if missed else ""
    why_not += "".join(f"; {layout.name}: {layout.not_made}" for layout in layouts if layout.not_made)
    if prefer is Prefer.SIZE:
        best = min(eligible, key=size)
        return best, f"--prefer size: {described(best)} is the smallest{why_not}"
    timed = [i for i in eligible if layouts[i].speed is not None]
    if prefer is Prefer.SPEED:
        if not timed:
            best = eligible[0]
            return best, f"--prefer speed, {untimed}: {described(best)} adds no Transposes{why_not}"
        best = min(timed, key=speed)
        return best, f"--prefer speed: {described(best)} is the fastest{why_not}"
    if not timed:
        best = eligible[0]
        return (
            best,
            f"{untimed}: {described(best)} adds no Transposes (--prefer size keeps the smaller){why_not}",
        )
    within = [i for i in timed if (layouts[i].speed or math.inf) <= 1 + margin]
    if within:
        best = min(within, key=size)
        faster = [i for i in within if speed(i) < speed(best)]
        quickest = min(faster, key=speed) if faster else None
        if quickest is not None and layouts[best].bytes > (1 - MIN_SIZE_GAIN) * layouts[quickest].bytes:
            gain = 1 - layouts[best].bytes / layouts[quickest].bytes
            return quickest, (
                f"{described(quickest)} is the fastest not slower than the original by more than"
                f" {margin:.0%}; {described(best)} is smaller by only {gain:.0%} (a slower model must be"
                f" {MIN_SIZE_GAIN:.0%} smaller){why_not}"
            )
        slower = [described(i) for i in timed if i not in within and layouts[i].bytes < layouts[best].bytes]
        over = f"; {', '.join(slower)} is slower by more than that" if slower else ""
        return best, (
            f"{described(best)} is the smallest not slower than the original by more than"
            f" {margin:.0%}{over}{why_not}"
        )
    best = min(timed, key=speed)
    return best, (
        f"every model is slower than the original by more than {margin:.0%}: {described(best)} is the"
        f" fastest (--prefer size keeps the smaller){why_not}"
    )
