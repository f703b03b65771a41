"""The check stage of the one quantize pass: a candidate's session run once on every feed of the
reference, each feed's outputs compared as they arrive (nothing is run twice: the original's
outputs come from :mod:`onnx_conv2matmul.quantize.measure`).

The comparison is the accuracy check's own (:func:`onnx_conv2matmul.verify.check.compare_outputs`,
the plan's criterion), so the rows are those ``verify`` would report. The first candidate also
gives the activation statistics the decision needs: each MatMulNBits input's mean square per
channel, fetched on the feeds whose activations fit :data:`ACTIVATION_BYTES`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_conv2matmul.errors import OutOfMemory, first_line
from onnx_conv2matmul.quantize.search_runs import ACTIVATION_BYTES, ChannelEnergy, _run
from onnx_conv2matmul.verify.compare import worst_cosine
from onnx_conv2matmul.verify.feeds import feed_bytes
from onnx_conv2matmul.verify.labels import TaskResult, failed, task_results
from onnx_conv2matmul.verify.run import release_freed_memory

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.quantize.reference import Reference
    from onnx_conv2matmul.verify.check import OutputComparison, VerifyOptions


@dataclasses.dataclass(frozen=True)
class Runs:
    """The feeds a check runs: ``indices`` first, in their order. With ``only``, those alone, each
    to the end (the classes' short runs); else every other feed after them, and the first feed
    that misses ends the check (the candidate fails whatever the rest give)."""

    indices: tuple[int, ...]
    only: bool = False


@dataclasses.dataclass
class Checked:
    """One candidate against the reference: its rows per feed, whether all passed (the labels of
    the outputs that hold class scores included), the worst per-sample cosine, the first failure
    in words, and (when asked) the activation statistics."""

    rows: list[list[OutputComparison]]
    passed: bool
    worst_cosine: float | None
    failure: str
    seconds: float
    activations: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    labels: list[TaskResult] = dataclasses.field(default_factory=list)
    indices: list[int] = dataclasses.field(default_factory=list)
    """The feed of each entry of ``rows``."""
    stopped: bool = False
    """Stopped at the first feed that missed (see :class:`Runs`): ``rows`` hold
    the feeds run, ``worst_cosine`` is theirs, and no labels were counted."""
    samples: tuple[int, int] = (0, 0)
    """The samples the check ran, of those it would run."""

    def worst_first(self) -> Runs:
        """The feeds this check ran, the one of the lowest cosine first (a feed without one last),
        for a later candidate's check."""
        lowest = {index: worst_cosine(rows) for index, rows in zip(self.indices, self.rows, strict=True)}
        worst = {index: math.inf if cosine is None else cosine for index, cosine in lowest.items()}
        return Runs(tuple(sorted(worst, key=lambda index: (worst[index], index))))

    def flat_rows(self) -> list[OutputComparison]:
        return [row for rows in self.rows for row in rows]

    def loss(self, floor: float) -> float:
        """How far the candidate is from the criterion, 1 at its limit: the largest of the worst
        cosine's ``(1 - cosine) / (1 - floor)`` and each output's labels' share changed over the
        share allowed; inf when it could not be measured."""
        if self.worst_cosine is None or floor >= 1:
            return math.inf
        return max([(1.0 - self.worst_cosine) / (1.0 - floor), *(t.loss for t in self.labels)])


def check_model(
    plan: QuantizePlan,
    model: Any,
    reference: Reference,
    *,
    statistics: Sequence[str] = (),
    runs: Runs | None = None,
) -> Checked:
    """:func:`check` of a candidate held in memory (``model``, an onnx-ir model), opened in
    onnxruntime beside the input (its weights in files are read from the input's folder) and let
    go after. A run on every feed prepacks the weights, as a user's session does; a run on some
    of them (``runs.only``: the classes' short runs) does not, so that it opens at once on the float
    weights where they lie (see :func:`~onnx_conv2matmul.quantize.measure.session_options`)."""
    from onnx_conv2matmul.quantize.build import open_beside_input

    only = runs is not None and runs.only
    session = open_beside_input(plan, model, prepack=not only, extra_outputs=statistics)
    try:
        return check(session, reference, plan.verify, statistics, runs)
    finally:
        del session


def check(
    session: Any,
    reference: Reference,
    verify: VerifyOptions,
    statistics: Sequence[str] = (),
    runs: Runs | None = None,
) -> Checked:
    """Run ``session`` on every feed of ``reference`` (``runs``: those it says, in its order) and
    compare; ``statistics``: values (the session's outputs after the model's own) whose
    per-channel mean square to gather. A later candidate runs the feeds an earlier one found
    worst first (:meth:`Checked.worst_first`) and stops at the first that misses (PP-OCRv4 rec's
    mixes that missed: 1.8 s each on 35 lines); one that passes runs on every feed.

    A candidate that onnxruntime cannot run fails, with the reason as its failure.
    """
    started = time.perf_counter()
    names = reference.names
    output_indices = list(verify.output_indices) if verify.output_indices else None
    feeds, samples = reference.feeds.feeds, reference.feeds.samples
    energy = ChannelEnergy()
    rows: list[list[OutputComparison]] = []
    per_input_byte: float | None = None
    failure = ""
    indices: list[int] = []
    todo = list(range(len(feeds))) if runs is None else [i for i in runs.indices if i < len(feeds)]
    if runs is not None and not runs.only:
        listed = set(todo)
        todo += [i for i in range(len(feeds)) if i not in listed]
    stopped = False
    for index in todo:
        feed = feeds[index]
        input_bytes = feed_bytes(feed)
        fetch = bool(statistics) and (
            per_input_byte is None or per_input_byte * input_bytes <= ACTIVATION_BYTES
        )
        try:
            outputs = _run(session, feed, [*names, *statistics] if fetch else names)
        except OutOfMemory:
            raise
        except Exception as err:  # a candidate that does not run fails the check
            first = first_line(err)
            failure = (
                f"onnxruntime cannot run the candidate at length {reference.feeds.lengths[index]}: {first}"
            )
            rows, indices = [], []
            break
        if fetch:
            extra = outputs[len(names) :]
            if per_input_byte is None:
                per_input_byte = sum(int(np.asarray(a).nbytes) for a in extra) / max(1, input_bytes)
            for name, array in zip(statistics, extra, strict=True):
                energy.add(name, array)
            del extra
        rows.append(reference.compare(index, outputs[: len(names)], verify, output_indices))
        indices.append(index)
        del outputs
        if runs is not None and not runs.only and not all(row.passed for row in rows[-1]):
            stopped = len(indices) < len(todo)
            break
    release_freed_memory()
    by_feed = sorted(range(len(indices)), key=lambda i: indices[i])  # as verify reports them
    rows, indices = [rows[i] for i in by_feed], [indices[i] for i in by_feed]
    flat = [row for feed_rows in rows for row in feed_rows]
    bad = next((row for row in flat if not row.passed), None)
    # Labels counted on the feeds a stopped check ran would stand for none: not counted.
    labels = [] if stopped else task_results(flat, verify.min_cosine, verify.report_only)
    if not failure and bad is not None:
        failure = f"{bad.output} at length {bad.length}: {bad.note}" if bad.note else f"{bad.output}"
    moved = failed(labels)
    if not failure and moved is not None:
        failure = moved.text()
    return Checked(
        rows,
        passed=not failure,
        worst_cosine=worst_cosine(flat),
        failure=failure,
        seconds=time.perf_counter() - started,
        activations=energy.means(),
        labels=labels,
        indices=indices,
        stopped=stopped,
        samples=(sum(samples[i] for i in indices), sum(samples[i] for i in todo)),
    )
