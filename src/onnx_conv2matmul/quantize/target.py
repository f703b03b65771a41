"""The search's target (see :mod:`onnx_conv2matmul.quantize.search`): what one evaluation
measured, whether that meets the options' minimum cosine and the user's score, the loss (1 is
the limit) the search steers by, and the words for a target missed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from onnx_conv2matmul.quantize.search_options import AutoOptions


@dataclasses.dataclass
class _Measured:
    """What one evaluation measured: see :class:`Evaluation`; ``cosines`` by feed index."""

    cosine: float | None = None
    score: float | None = None
    drop: float | None = None
    note: str = ""
    feeds_run: int = 0
    cosines: dict[int, float] = dataclasses.field(default_factory=dict)
    rows: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    """With the check's options (``_Target.check``): each feed's rows as the check compares them."""
    digest: str = ""
    """With the check's options: the candidate's :func:`~onnx_conv2matmul.quantize.digest.model_digest`."""


class _Target:
    """The options' target: whether a measurement meets it, and its loss (1 is the limit)."""

    def __init__(self, options: AutoOptions, original_score: float | None, check: Any = None) -> None:
        self.check = check  # the accuracy check's VerifyOptions: rows kept for it (None: not)
        self.min_cosine = options.min_cosine
        self.metric = options.metric
        self.original_score = original_score

    def cosine_passed(self, measured: _Measured) -> bool:
        return self.min_cosine is None or (measured.cosine is not None and measured.cosine >= self.min_cosine)

    def passed(self, measured: _Measured) -> bool:
        if not self.cosine_passed(measured):
            return False
        if self.metric is not None:
            assert self.original_score is not None
            return measured.score is not None and self.metric.meets(self.original_score, measured.score)
        return True

    def loss(self, measured: _Measured) -> float:
        """The largest of the measured losses, each over its limit: 1 - cosine over 1 - the
        minimum, the drop over the largest drop (an infinite loss where the limit is 0)."""
        losses = [0.0]
        if self.min_cosine is not None and measured.cosine is not None:
            losses.append(_over(1.0 - measured.cosine, 1.0 - self.min_cosine))
        if self.metric is not None and measured.drop is not None:
            losses.append(_over(max(0.0, measured.drop), self.metric.max_drop))
        return max(losses)

    def describe(self) -> str:
        parts = []
        if self.min_cosine is not None:
            parts.append(f"a minimum cosine similarity of {self.min_cosine:g}")
        if self.metric is not None:
            parts.append(f"a drop of the score of {self.metric.label} of at most {self.metric.max_drop_text}")
        return " and ".join(parts)


def _over(loss: float, limit: float) -> float:
    if limit > 0:
        return loss / limit
    return 0.0 if loss <= 0 else math.inf


def _unreachable(target: _Target, measured: _Measured, feeds: int) -> str:
    """Why even the all-float model fails the target."""
    found = []
    if target.min_cosine is not None and measured.cosine is not None and measured.cosine < target.min_cosine:
        found.append(f"worst cosine {_below(measured.cosine, target.min_cosine)} over {feeds} input(s)")
    if target.metric is not None and measured.score is not None:
        found.append(f"score {measured.score:.6g} against the original's {target.original_score:.6g}")
    if measured.note:
        found.append(measured.note)
    return f"{target.describe()} is not met even with every weight in float ({'; '.join(found)})"


def _below(value: float, target: float) -> str:
    """``value`` with enough digits to show that it is below ``target`` (0.9999999, not 1)."""
    for digits in range(6, 18):
        text = f"{value:.{digits}g}"
        if float(text) < target:
            return text
    return repr(value)
