"""What a timing finds (:func:`onnx_conv2matmul.speed.timing.time_models`): each model's latency
per length, its ratio to the baseline's with a bootstrap interval, and how the runs were made."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.verify.options import VerifyOptions

BOOTSTRAP_DRAWS = 2000
DEFAULT_ROUNDS = 10
DEFAULT_WARMUP = 2


@dataclasses.dataclass(frozen=True)
class TimingOptions:
    """How models are timed.

    Attributes:
        lengths: The values every symbolic dim other than the batch takes in turn; None: chosen
            from the baseline model's inputs (:func:`default_lengths`).
        rounds: Timed runs of each model at each length (at least 3).
        warmup: Untimed runs of each model at each length first.
        threads: Intra-op threads of every session; 0 is onnxruntime's default (one per
            physical core).
        synthesis: How inputs are made (fixed input values, dims, the length input, seed), as
            for the accuracy check; its lengths and batch are ignored: batch 1, ``lengths``.
        memory_budget_bytes: Memory the sessions open together may take; None:
            :func:`default_budget` (a little more than the largest session, so the timing never
            holds the original and its candidates all at once when they are large).
        feeds: Inputs to time on instead of synthesised ones, each under the number the report
            gives it (its "length"); ``lengths`` and ``synthesis`` are then not used. Every
            model gets the arrays of its own inputs' names (see
            :mod:`onnx_conv2matmul.speed.inputs`, which takes them from ``--inputs`` or from the
            runs the accuracy check made).
        feeds_rule: Where ``feeds`` came from, for the report.
        settle_after: When given (at least 3, below ``rounds``), the timing stops after this
            many rounds or any later one once every ratio to the baseline is settled
            (:func:`settled`); ``rounds`` is then the most it runs.
    """

    lengths: tuple[int, ...] | None = None
    rounds: int = DEFAULT_ROUNDS
    warmup: int = DEFAULT_WARMUP
    threads: int = 0
    synthesis: VerifyOptions = dataclasses.field(default_factory=VerifyOptions)
    memory_budget_bytes: int | None = None
    feeds: tuple[tuple[int, Mapping[str, np.ndarray]], ...] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    feeds_rule: str = ""
    settle_after: int | None = None

    def __post_init__(self) -> None:
        if self.lengths is not None and (not self.lengths or any(n < 1 for n in self.lengths)):
            raise ValueError("bench lengths must be positive integers")
        if self.rounds < 3:
            raise ValueError(f"bench rounds must be at least 3, got {self.rounds}")
        if self.warmup < 0:
            raise ValueError(f"bench warm-up runs must be >= 0, got {self.warmup}")
        if self.threads < 0:
            raise ValueError(f"bench threads must be >= 0, got {self.threads}")
        if self.synthesis.feeds is not None:
            raise ValueError("timing synthesises its inputs: real inputs are not taken")
        if self.feeds is not None and not self.feeds:
            raise ValueError("no input to time on")
        if self.settle_after is not None and self.settle_after < 3:
            raise ValueError(f"timing settles after 3 rounds at the earliest, got {self.settle_after}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": None if self.lengths is None else list(self.lengths),
            "rounds": self.rounds,
            "warmup": self.warmup,
            "threads": self.threads,
            "batch": 1 if self.feeds is None else None,
            "inputs": "synthesised" if self.feeds is None else self.feeds_rule or "given",
            "settle_after": self.settle_after,
        }


class Mode(str, enum.Enum):
    """How the sessions are held while timing."""

    TOGETHER = "together"
    """All sessions open at once; every run interleaved with the other models' runs."""
    ONE_AT_A_TIME = "one_at_a_time"
    """One session open at a time: each round opens, warms up, times and closes each model."""
    APART = "apart"
    """Each model timed on its own, at another moment of the run (the default quantize times the
    original when it measures it and the result when it is written): not interleaved."""


@dataclasses.dataclass(frozen=True)
class Latency:
    """One model at one length: milliseconds of its timed runs and what they say.

    ``ratio`` is this model's median over the baseline's (lower is faster), with a 95% bootstrap
    interval ``[ratio_low, ratio_high]``; None for the baseline itself.
    """

    length: int
    samples_ms: tuple[float, ...]
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_ms))

    @property
    def q1_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 25))

    @property
    def q3_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 75))

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def measurably_slower(self) -> bool:
        """Slower than the baseline beyond the noise: the ratio's whole 95% interval above 1 (its
        median alone when there is no interval); never the baseline itself."""
        if self.ratio is None:
            return False
        low = self.ratio_low if self.ratio_low is not None else self.ratio
        return low > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "median_ms": self.median_ms,
            "q1_ms": self.q1_ms,
            "q3_ms": self.q3_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "ratio": self.ratio,
            "ratio_interval": None if self.ratio is None else [self.ratio_low, self.ratio_high],
            "samples_ms": list(self.samples_ms),
        }


@dataclasses.dataclass(frozen=True)
class ModelTiming:
    """One model's latencies, one per length, in the order of the lengths."""

    path: str
    label: str
    file_bytes: int
    latencies: tuple[Latency, ...]
    inputs: str = ""
    """The model's inputs: names, element types and shapes."""

    def at(self, length: int) -> Latency:
        for latency in self.latencies:
            if latency.length == length:
                return latency
        raise KeyError(length)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "label": self.label,
            "file_bytes": self.file_bytes,
            "inputs": self.inputs,
            "latencies": [latency.to_dict() for latency in self.latencies],
        }


@dataclasses.dataclass(frozen=True)
class TimingReport:
    """Several models timed side by side; ``baseline`` indexes ``models``."""

    models: tuple[ModelTiming, ...]
    baseline: int
    lengths: tuple[int, ...]
    lengths_rule: str
    options: TimingOptions
    mode: Mode
    cpu: str
    cpu_wait: float | None = None
    """The share of this process's CPUs other processes used while it timed (see
    :class:`onnx_conv2matmul.speed.machine.CpuWait`); None: not known."""

    def header(self) -> dict[str, Any]:
        """How the models were timed: the CPU, the options, the lengths and their rule, the mode
        (the head of this report's JSON and of the quantize report's ``latency``)."""
        return {
            "cpu": self.cpu,
            "options": self.options.to_dict(),
            "lengths": {"used": list(self.lengths), "rule": self.lengths_rule},
            "mode": self.mode.value,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "baseline": self.baseline,
            "models": [model.to_dict() for model in self.models],
        }


def ratio_interval(
    reference: Sequence[float], candidate: Sequence[float], draws: int = BOOTSTRAP_DRAWS
) -> tuple[float, float]:
    """95% bootstrap interval of median(candidate) / median(reference), resampling the rounds
    (sample ``i`` of both is round ``i``); seeded, so the same samples give the same interval."""
    a, b = np.asarray(reference, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if len(a) != len(b) or not len(a):
        raise ValueError("the samples must come in rounds: one of each per round")
    picks = np.random.default_rng(1).integers(0, len(a), size=(draws, len(a)))
    ratios = np.median(b[picks], axis=1) / np.median(a[picks], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


SETTLED_WIDTH = 0.05
"""A ratio is settled when its 95% interval lies within this share of it on either side."""


def settled(reference: Sequence[float], candidate: Sequence[float]) -> bool:
    """Whether more rounds would tell nothing new of ``candidate`` against ``reference`` (samples
    in rounds): the ratio's 95% interval lies wholly below or above 1 (faster or slower is
    known), or within :data:`SETTLED_WIDTH` of the ratio on both sides."""
    ratio = float(np.median(candidate) / np.median(reference))
    low, high = ratio_interval(reference, candidate)
    return high < 1 or low > 1 or (low >= ratio * (1 - SETTLED_WIDTH) and high <= ratio * (1 + SETTLED_WIDTH))
