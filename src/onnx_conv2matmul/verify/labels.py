"""Class scores: where a cosine floor is the wrong target.

A classifier's output is one row of class scores per sample (logits or probabilities), and what
its user reads from it is the label, the class with the largest score. A cosine similarity of
0.99 between two rows of two scores still lets the label change: a sample near the boundary
flips with a small error. On the user's own inputs, the check counts the labels that change
(:func:`label_flips`, per output row of the comparison); when the cosine floor is met but more
than :data:`MAX_FLIPPED` of the labels of an output changed, :func:`advice` says so, and that
the user's own metric (``--validate``) is the target for such a model. This module is the one
place that decides it: the check (``verify``, and ``quantize``'s check) adds its sentence to the
report's warnings, which the terminal prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class _Row(Protocol):
    """What :func:`advice` reads of a check's row (``verify.compare.OutputComparison``)."""

    output: str
    passed: bool
    labels: int
    label_flips: int


MAX_FLIPPED = 0.01
"""The share of labels that may change before the advice is given (the 99% top-1 of issue 28)."""

MAX_CLASSES = 100_000
"""An output wider than this is not read as class scores."""


def class_scores(shape: Sequence[int], samples: int) -> bool:
    """Whether a float output of ``shape`` looks like class scores: ``[samples, classes]``, one
    row per sample (batch row of the inputs) with 2 to :data:`MAX_CLASSES` classes."""
    return len(shape) == 2 and int(shape[0]) == max(1, samples) and 2 <= int(shape[1]) <= MAX_CLASSES


def label_flips(ref: np.ndarray, out: np.ndarray, samples: int) -> tuple[int, int] | None:
    """``(labels, flipped)`` for an output that looks like class scores (None otherwise): the
    samples, and those whose largest score is at another class in ``out`` than in ``ref``. A
    sample with a non-finite score counts as flipped (its label cannot be told)."""
    if ref.shape != out.shape or not np.issubdtype(ref.dtype, np.floating):
        return None
    if not class_scores(ref.shape, samples):
        return None
    finite = np.isfinite(ref).all(axis=1) & np.isfinite(out).all(axis=1)
    same = (np.argmax(ref, axis=1) == np.argmax(out, axis=1)) & finite
    return int(ref.shape[0]), int(ref.shape[0] - int(same.sum()))


def advice(rows: Sequence[_Row], min_cosine: float | None) -> list[str]:
    """The warnings for outputs whose rows passed a cosine floor while more than
    :data:`MAX_FLIPPED` of their labels changed (``rows``: the check's rows on real inputs)."""
    if min_cosine is None:
        return []
    totals: dict[str, list[int]] = {}
    for row in rows:
        if row.labels and row.passed:
            entry = totals.setdefault(row.output, [0, 0])
            entry[0] += row.labels
            entry[1] += row.label_flips
    found = []
    for output, (labels, flipped) in totals.items():
        if flipped > MAX_FLIPPED * labels:
            found.append(
                f"output {output!r} looks like class scores: every sample met the cosine floor"
                f" {min_cosine:g}, yet {flipped} of {labels} labels ({100 * flipped / labels:.1f}%)"
                f" changed on the given inputs. Cosine is the wrong target for this model: give"
                " --validate MODULE:FUNCTION with your task's metric (top-1 accuracy) and"
                " --max-drop to decide what may be written"
            )
    return found
