"""Where the time of a quantize run goes: each progress step belongs to one phase (load, rewrite,
kernel choice, quantize, search, save, check, timing, publish), and :class:`PhaseTimer` adds up the
seconds of each as the steps are announced. The report's ``seconds_by_phase`` comes from it, and
the command line's progress bar shows the phase in front of the step (:func:`phase_of`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from onnx_conv2matmul.files.progress import NullProgress, Progress

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("load", ("Loading", "Checking the input")),
    ("rewrite", ("Rewriting",)),
    (
        "kernel choice",
        (
            "Kernel choice",
            "Quantizing with block",
            "Measuring the candidates' accuracy",
            "Slower than the original",
        ),
    ),
    ("measure", ("Measuring the original",)),
    (
        "search",
        (
            "Below the accuracy criterion",
            "Saving the fp32 model for the search",
            "Measuring activations",
            "Measuring each weight",
            "Evaluating configuration",
            "Synthesising inputs",
            "Scoring the fp32 model",
        ),
    ),
    ("decide", ("Deciding",)),
    ("quantize", ("Quantizing",)),
    ("save", ("Saving",)),
    (
        "check",
        ("Checking the output", "Checking the candidate", "Measuring accuracy", "Verifying", "Scoring"),
    ),
    ("timing", ("Timing",)),
    ("publish", ("Publishing",)),
)
"""Each phase and the beginnings of its steps' names (the first phase that matches wins)."""


def phase_of(step: str) -> str:
    """The phase a progress step belongs to (``other`` when none is named for it)."""
    for phase, starts in PHASES:
        if step.startswith(starts):
            return phase
    return "other"


class PhaseTimer:
    """A :class:`Progress` that passes every step on to ``inner`` as it is, and adds up each
    phase's seconds (``clock``: seconds, monotonic)."""

    def __init__(self, inner: Progress | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner: Progress = inner or NullProgress()
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._since = clock()

    def phase(self, name: str) -> None:
        self._stop()
        self._current = phase_of(name)
        self.inner.phase(name)

    def advance(self, done: int, total: int) -> None:
        self.inner.advance(done, total)

    def close(self) -> None:
        self._stop()
        self._current = None
        self.inner.close()

    def _stop(self) -> None:
        now = self.clock()
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + now - self._since
        self._since = now

    def by_phase(self) -> dict[str, float]:
        """Seconds per phase so far, in the order of :data:`PHASES` (``other`` last)."""
        self._stop()
        order = [phase for phase, _ in PHASES] + ["other"]
        return {phase: round(self.seconds[phase], 3) for phase in order if phase in self.seconds}
