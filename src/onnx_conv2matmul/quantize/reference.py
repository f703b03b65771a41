"""What the fp32 model gives on the search's inputs, measured once and compared against as runs arrive.

The search (:mod:`onnx_conv2matmul.quantize.search`) runs the fp32 model once per feed. Its
outputs are written to the search's folder as ``.npy`` files and read back memory-mapped
when a candidate is compared, so the memory held does not grow with the number of feeds:
one feed's outputs at a time, the candidate's as they come out of onnxruntime. The same
reference serves every evaluation of the search and the final accuracy check of the model
that is published (:meth:`Reference.check`), so the fp32 model runs once in all.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import (
    Hint,
    ModelLoadError,
    ModelRunError,
    OutOfMemory,
    first_line,
    is_out_of_memory,
)
from onnx_conv2matmul.verify import run as runs
from onnx_conv2matmul.verify.check import (
    OutputComparison,
    VerifyOptions,
    VerifyReport,
    compare_outputs,
    feed_samples,
    judge_rows,
)
from onnx_conv2matmul.verify.labels import TaskResult, add_labels
from onnx_conv2matmul.verify.run import release_freed_memory


@dataclasses.dataclass
class FeedSet:
    """The inputs of the search and of the check: the feeds, and how the report describes them.

    Attributes:
        feeds: One mapping of input name to array per run.
        lengths: The report's length of each run (the synthesised length, or the feed's number from 1).
        rule: How the lengths were chosen.
        not_run: Default lengths the model could not run at, with why.
        how: How each input was made.
        samples: The samples (batch rows) each run's inputs hold.
        dims: What each symbolic dim took, and why (the check's report).
        runs: Every dim's value in each run.
        warnings: What the check could not tell.
        output_sizes: How the outputs' sizes were known.
        replan: Set when the synthesised runs were planned without running the model: the
            inputs as the check makes them after running each (spares replacing lengths the
            model cannot run at), for when a planned run fails.
        tasks: The outputs that hold class scores, and how their labels are counted
            (:func:`onnx_conv2matmul.verify.labels.output_tasks`).
    """

    feeds: Sequence[Mapping[str, np.ndarray]]
    lengths: list[int]
    rule: str
    not_run: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    how: dict[str, str] = dataclasses.field(default_factory=dict)
    samples: list[int] = dataclasses.field(default_factory=list)
    dims: list[Any] = dataclasses.field(default_factory=list)
    runs: list[Any] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    output_sizes: str = ""
    replan: Callable[[], FeedSet] | None = dataclasses.field(default=None, repr=False, compare=False)
    tasks: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [feed_samples(feed) for feed in self.feeds]

    def signature(self) -> tuple[Any, ...]:
        """What tells this set of feeds from another planned for the same model within one
        quantize, without reading them: how they were made and planned, each run's length, samples
        and dims (the same inputs planned again give the same)."""
        how = tuple(sorted(self.how.items()))
        return (self.rule, how, tuple(self.lengths), tuple(self.samples), repr(self.runs))


def feed_set(path: str, options: VerifyOptions, *, run: bool = False, session: Any = None) -> FeedSet:
    """The inputs the accuracy check of the model at ``path`` runs on with ``options``, with
    what its report says of them (the plan of :class:`onnx_conv2matmul.verify.check.Reference`).

    The given feeds (checked against the model and the memory budget), or the synthesised
    inputs of every planned run. Without ``run`` the plan is not run: the search's own first
    pass runs it (and calls ``replan`` when a run fails); with ``run`` the original runs each
    planned run first, as the check does, a spare replacing a length it cannot run at, and
    its outputs are dropped at once. ``session``: the original's session made already (see
    :func:`onnx_conv2matmul.verify.run.open_model`), which plans and probes instead of a new one.

    Raises:
        ModelRunError, InputError, OutOfMemory: as :func:`onnx_conv2matmul.verify.check.verify_models`.
    """
    from onnx_conv2matmul.verify.check import Reference as Plan
    from onnx_conv2matmul.verify.check import run_samples, synthesise_inputs

    replan = None
    if options.feeds is not None:
        from onnx_conv2matmul.verify.stream import Chunk, ChunkedFeeds

        plan = Plan(path, options, run=False, session=session)
        runs = list(plan.plan.runs)
        # The files' samples in the chunks the memory budget allows, each read when it runs.
        chunks = [
            Chunk(r.length - 1, *(r.rows or (0, feed_samples(options.feeds[r.length - 1]))), r.cut)
            for r in runs
        ]
        feeds: Sequence[Mapping[str, np.ndarray]] = ChunkedFeeds(options.feeds, chunks)
        how = {spec.name: "from the input files" for spec in plan.specs}
        lengths = [r.length for r in runs]
        samples = [chunk.samples for chunk in chunks]
    else:
        plan = Plan(path, options, run=run, session=session)
        options = plan.options  # with the sizes and values found before the check
        if run:
            for index, (done, _) in enumerate(plan.done):
                plan.done[index] = (done, [])
            release_freed_memory()
            runs = [done for done, _ in plan.done]
        else:
            runs = list(plan.plan.runs)
            if options.lengths is None:
                runs.sort(key=lambda r: (r.long, r.length))  # as the check lists them
            replan = functools.partial(feed_set, path, options, run=True, session=session)
        made = [synthesise_inputs(plan.specs, r.length, options, r.dims, plan.plan.roles) for r in runs]
        feeds = [feed for feed, _ in made]
        how = made[0][1] if made else {}
        lengths = [r.length for r in runs]
        samples = [run_samples(r, options, plan.plan.roles) for r in runs]
    return FeedSet(
        feeds,
        lengths,
        plan.plan.rule,
        list(plan.not_run),
        how,
        samples,
        list(plan.plan.roles.dims),
        runs,
        plan.warnings(),
        plan.sizes_how,
        replan,
        dict(plan.tasks),
    )


SEARCHED_ROWS = (
    "the candidate's outputs are those of the search's evaluation of the same model"
    " (the same nodes and weights): it was not run again"
)
"""The check's warning when the rows of the search's evaluation stand for the candidate's runs."""


class Reference:
    """The fp32 outputs per feed (files in ``directory``), and per quantizable MatMul the mean
    square of each channel of its input (``activations``, by the input's name)."""

    def __init__(self, directory: str, names: Sequence[str], feeds: FeedSet) -> None:
        self.directory = directory
        self.names = list(names)
        self.feeds = feeds
        self.activations: dict[str, np.ndarray] = {}
        self.statistics: dict[str, InputStats] = {}  # the same inputs' statistics for the rankers
        self._held: dict[tuple[int, int], Any] = {}

    def _path(self, feed: int, output: int) -> str:
        return os.path.join(self.directory, f"reference-{feed}-{output}.npy")

    def put(self, feed: int, outputs: Sequence[Any]) -> None:
        """Keep the fp32 outputs of one feed: numeric tensors on disk, anything else in memory.

        Raises:
            ModelRunError: a float output is empty or NaN or Inf everywhere: no candidate can be
                judged against it (see :func:`onnx_conv2matmul.verify.compare.cannot_compare`).
        """
        for index, value in enumerate(outputs):
            self._comparable(feed, index, value)
        for index, value in enumerate(outputs):
            if isinstance(value, np.ndarray) and value.dtype != object:
                np.save(self._path(feed, index), value, allow_pickle=False)
            else:
                self._held[(feed, index)] = value

    def _comparable(self, feed: int, index: int, value: Any) -> None:
        if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
            return
        from onnx_conv2matmul.verify.compare import samples_without_finite

        bad = int(value.size - np.count_nonzero(np.isfinite(value)))
        samples = self.feeds.samples[feed]
        blank = samples_without_finite(value, value, samples) if bad else []
        if value.size and bad < value.size and not blank:
            return  # NaN or Inf at some places only: the candidate must have them there too
        files = any(how == "from the input files" for how in self.feeds.how.values())
        where = f"input file {feed + 1}" if files else f"the inputs of length {self.feeds.lengths[feed]}"
        if not value.size:
            what = "an empty output"
        elif blank:
            what = f"NaN or Inf at every element of sample {blank[0]} (of {samples})"
        else:
            what = f"NaN or Inf at every one of its {value.size} elements"
        raise ModelRunError(
            f"the original model gives {what} in {self.names[index]!r} on {where}: the accuracy"
            " check cannot compare anything there",
            hint=Hint.INPUT_FILES if files else Hint.VERIFY_INPUTS,
        )

    def get(self, feed: int) -> list[Any]:
        """The fp32 outputs of one feed (tensors memory-mapped)."""
        return [
            self._held[(feed, index)]
            if (feed, index) in self._held
            else np.load(self._path(feed, index), mmap_mode="r")
            for index in range(len(self.names))
        ]

    def compare(
        self, feed: int, outputs: Sequence[Any], options: VerifyOptions, indices: Sequence[int] | None = None
    ) -> list[OutputComparison]:
        """One feed's candidate outputs against the reference, one row per output compared."""
        reference = self.get(feed)
        rows = [
            compare_outputs(
                reference[index],
                outputs[index],
                options,
                length=self.feeds.lengths[feed],
                name=self.names[index],
                samples=self.feeds.samples[feed],
                task=self.feeds.tasks.get(self.names[index], ""),
            )
            for index in (range(len(self.names)) if indices is None else indices)
        ]
        del reference
        return rows

    def worst_cosine(
        self, feed: int, outputs: Sequence[Any], labels: dict[str, TaskResult] | None = None
    ) -> tuple[float, str]:
        """The smallest per-sample cosine of one feed's float outputs; -1 and a note when an
        output that must match exactly differs (or NaN/Inf differ). ``labels``: the labels of the
        outputs that hold class scores, by output, added to (see
        :func:`~onnx_conv2matmul.verify.labels.add_labels`)."""
        worst = 1.0
        for row in self.compare(feed, outputs, VerifyOptions(report_only=True)):
            if not row.passed:
                return -1.0, f"{row.output} on feed {feed}: {row.note}"
            cosine = row.worst_cosine
            if cosine is not None:
                worst = min(worst, cosine)
            if labels is not None:
                add_labels(labels, (row,))
        return worst, ""

    def check(
        self,
        original: str,
        candidate: str,
        options: VerifyOptions,
        rows: Sequence[Any] | None = None,
        note: str = SEARCHED_ROWS,
    ) -> VerifyReport:
        """The accuracy check of ``candidate`` on the reference's feeds, as
        :func:`onnx_conv2matmul.verify.check.verify_models` reports it, without running the
        original again; a candidate that cannot be loaded or run fails. ``rows``: the rows of
        the search's evaluation of the same model (the same digest), which stand for the
        candidate's runs (the report's warnings say so)."""
        report = VerifyReport(original, candidate, options, dict(self.feeds.how))
        report.lengths = list(self.feeds.lengths)
        report.lengths_rule = self.feeds.rule
        report.lengths_not_run = list(self.feeds.not_run)
        report.dims, report.runs = list(self.feeds.dims), list(self.feeds.runs)
        report.warnings, report.output_sizes = list(self.feeds.warnings), self.feeds.output_sizes
        indices = list(options.output_indices) if options.output_indices else None
        if rows is not None:
            report.results.extend(rows)
            report.warnings.append(note)
            judge_rows(report)
            return report
        try:
            session = runs.session(candidate, options)
        except Exception as err:  # a candidate that does not load fails the check (memory aside)
            if is_out_of_memory(err):
                raise OutOfMemory(
                    f"out of memory loading the candidate model: {first_line(err)}",
                    hint=Hint.VERIFY_OUT_OF_MEMORY,
                ) from err
            failure = ModelLoadError(f"onnxruntime cannot load the candidate model: {first_line(err)}")
            report.results.append(OutputComparison.failure(0, "*", str(failure)))
            return report
        names = [o.name for o in session.get_outputs()]
        if names != self.names:
            report.results.append(
                OutputComparison.failure(
                    0, "*", f"the two models have different outputs: {self.names} vs {names}"
                )
            )
            return report
        try:
            for feed, inputs in enumerate(self.feeds.feeds):
                where = f"at length {self.feeds.lengths[feed]}"
                outputs = runs.run_feeds(session, inputs, "candidate", where, None)
                report.results.extend(self.compare(feed, outputs, options, indices))
                del outputs
        except ModelRunError as err:
            report.results.append(OutputComparison.failure(0, "*", str(err)))
        finally:
            del session
            release_freed_memory()
        judge_rows(report)
        return report


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
