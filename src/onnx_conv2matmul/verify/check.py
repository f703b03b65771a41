"""Prove two models compute the same thing, by running both in onnxruntime.

The check is split by concern:

- :mod:`~onnx_conv2matmul.verify.options`: what is asked (criterion, inputs, memory budget);
- :mod:`~onnx_conv2matmul.verify.roles`: which dims are batch and which are sequence;
- :mod:`~onnx_conv2matmul.verify.given`, :mod:`~onnx_conv2matmul.verify.ranges` and
  :mod:`~onnx_conv2matmul.verify.feeds`: real inputs, and the synthesised inputs;
- :mod:`~onnx_conv2matmul.verify.plan` and :mod:`~onnx_conv2matmul.verify.sizes`: the runs,
  each dim's value in each, within the budget;
- :mod:`~onnx_conv2matmul.verify.run`: sessions and runs, memory exhaustion;
- :mod:`~onnx_conv2matmul.verify.compare` and :mod:`~onnx_conv2matmul.verify.tally`: the
  numbers of each output and the verdict.

This module runs them in order (:func:`verify_models`) and holds the report
(:class:`VerifyReport`); the names other modules and users import from here stay here.
The original runs every planned run first, then the candidate, one run at a time: each
run's outputs are compared as the candidate's arrive and freed before the next run.
"""

# pragma: no mutate start
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import Hint, InputError, ModelLoadError, OutOfMemory
from onnx_conv2matmul.errors import ModelRunError as ModelRunError  # its home before errors.py
from onnx_conv2matmul.verify import run as runs
from onnx_conv2matmul.verify.compare import (
    OutputComparison as OutputComparison,
)
from onnx_conv2matmul.verify.compare import (
    compare_arrays as compare_arrays,
)
from onnx_conv2matmul.verify.compare import (
    compare_outputs as compare_outputs,
)
from onnx_conv2matmul.verify.compare import (
    compare_sequences as compare_sequences,
)
from onnx_conv2matmul.verify.compare import (
    sample_cosines as sample_cosines,
)
from onnx_conv2matmul.verify.compare import (
    thresholds as thresholds,
)
from onnx_conv2matmul.verify.compare import worst_cosine
from onnx_conv2matmul.verify.discover import discover, graph_specs, needs_probes, read_graph
from onnx_conv2matmul.verify.feeds import feed_samples as feed_samples
from onnx_conv2matmul.verify.feeds import synthesise_inputs as synthesise_inputs
from onnx_conv2matmul.verify.given import Feed as Feed
from onnx_conv2matmul.verify.given import check_feeds as check_feeds
from onnx_conv2matmul.verify.given import check_feeds_for_graph as check_feeds_for_graph
from onnx_conv2matmul.verify.given import check_names
from onnx_conv2matmul.verify.given import load_inputs as load_inputs
from onnx_conv2matmul.verify.labels import TaskResult, failed, output_tasks, refuse_synthesised, task_results
from onnx_conv2matmul.verify.options import DEFAULT_LENGTHS as DEFAULT_LENGTHS
from onnx_conv2matmul.verify.options import DEFAULT_MAX_ABS as DEFAULT_MAX_ABS
from onnx_conv2matmul.verify.options import DEFAULT_MEAN_ABS as DEFAULT_MEAN_ABS
from onnx_conv2matmul.verify.options import DEFAULT_MEMORY as DEFAULT_MEMORY
from onnx_conv2matmul.verify.options import IMAGE_LENGTHS as IMAGE_LENGTHS
from onnx_conv2matmul.verify.options import LONG_LENGTH as LONG_LENGTH
from onnx_conv2matmul.verify.options import Criterion as Criterion
from onnx_conv2matmul.verify.options import VerifyOptions as VerifyOptions
from onnx_conv2matmul.verify.options import feed_source, format_size
from onnx_conv2matmul.verify.plan import LengthPlan, Planner, Run, plan_lengths
from onnx_conv2matmul.verify.ranges import input_value_ranges as input_value_ranges
from onnx_conv2matmul.verify.roles import DimRole, InputSpec, Role, Roles, dim_roles
from onnx_conv2matmul.verify.run import release_freed_memory
from onnx_conv2matmul.verify.stream import Spill, merge_rows
from onnx_conv2matmul.verify.tally import element_scales as element_scales


@dataclasses.dataclass
class VerifyReport:
    """Two models compared: the options, how inputs were made, one row per output and run.

    ``passed`` when there is at least one row and every row passed; ``to_dict()`` is the
    ``verification`` section of a report (the verify command's report wraps it, see
    :class:`onnx_conv2matmul.verify.report.VerifyCommandReport`). ``runs`` gives every
    dim's value in each run made; ``dims`` what each dim took (batch, sequence, fixed)
    and why; ``warnings`` what the check could not tell.
    """

    original: str
    candidate: str
    options: VerifyOptions
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    results: list[OutputComparison] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    lengths_rule: str = ""
    lengths_not_run: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    dims: list[DimRole] = dataclasses.field(default_factory=list)
    runs: list[Run] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    output_sizes: str = ""
    labels: list[TaskResult] = dataclasses.field(default_factory=list)

    @property
    def input_files(self) -> list[dict[str, Any]]:
        """The real inputs used, one per run: file (or ``feed <n>``) and each input's shape."""
        return [
            {"file": feed_source(feed, i), "shapes": {name: list(a.shape) for name, a in feed.items()}}
            for i, feed in enumerate(self.options.feeds or ())
        ]

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results) and failed(self.labels) is None

    @property
    def worst_cosine(self) -> float | None:
        """The lowest cosine the check measured (None: it measured none)."""
        return worst_cosine(self.results)

    @property
    def failures(self) -> list[OutputComparison]:
        return [r for r in self.results if not r.passed]

    @property
    def return_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "original": self.original,
            "candidate": self.candidate,
            "criterion": self.options.criterion_dict(),
            "scaling": (
                "each difference divided by the smallest max(1, max|reference|) among the"
                " slices of the output that hold it (one slice per index of every axis longer than 1)"
            ),
            "options": self.options.to_dict(),
            "inputs": self.inputs,
            "input_files": self.input_files,
            "lengths": {
                "used": self.lengths,
                "rule": self.lengths_rule,
                "not_run": [{"length": n, "error": error} for n, error in self.lengths_not_run],
                "dims": [d.to_dict() for d in self.dims],
                "runs": [r.to_dict() for r in self.runs],
                "memory_budget": self.options.memory,
                "output_sizes": self.output_sizes,
            },
            "warnings": self.warnings,
            "labels": [t.to_dict() for t in self.labels],
            "results": [r.to_dict() for r in self.results],
            "failures": [
                {
                    "output": r.output,
                    "length": r.length,
                    "max_abs": r.max_abs,
                    "mean_abs": r.mean_abs,
                    "rel_err": r.rel_err,
                    "note": r.note,
                }
                for r in self.failures
            ],
        }


def verify_models(
    original: str, candidate: str, options: VerifyOptions | None = None, *, candidate_given: bool = False
) -> VerifyReport:
    """Run both models on the same inputs and compare their outputs.

    The candidate runs at the runs the original ran at (see
    :func:`onnx_conv2matmul.verify.plan.plan_lengths`); a candidate that onnxruntime cannot
    load or run gives a failed report, except that with ``candidate_given`` (a file the user
    named, not one this package wrote) a candidate it cannot load at all is an error, as an
    original it cannot load is.

    Raises:
        ModelRunError: the original cannot be loaded, or run on the synthesised inputs
            (the inputs need fixing); with ``candidate_given``, the candidate cannot be
            loaded (:class:`ModelLoadError`).
        InputError: an option names no input or dim of the model, an output index is
            out of range, the models' inputs or outputs differ, or the check does not fit
            the memory budget.
        OutOfMemory: memory ran out during the check (whichever model, whatever step).
    """
    options = options or VerifyOptions()
    try:
        return _verify(original, candidate, options, candidate_given)
    except MemoryError as err:
        raise OutOfMemory(
            f"out of memory during the check (memory budget {format_size(options.memory)})",
            hint=Hint.VERIFY_OUT_OF_MEMORY,
        ) from err


def _verify(original: str, candidate: str, options: VerifyOptions, candidate_given: bool) -> VerifyReport:
    reference = Reference(original, options)
    try:
        report = _compare(reference, original, candidate, candidate_given)
    finally:
        reference.close()
    judge_rows(report)
    return report


def judge_rows(report: VerifyReport) -> None:
    """The check's last step, once every row is in: on the user's inputs one row per output and
    file (:func:`merged_rows`); then the labels of the outputs that hold class scores, judged
    over all the rows (:func:`onnx_conv2matmul.verify.labels.task_results`)."""
    options = report.options
    if options.feeds is not None:
        report.results = merged_rows(report.results)
    report.labels = task_results(report.results, options.min_cosine, options.report_only)


def merged_rows(results: list[OutputComparison]) -> list[OutputComparison]:
    """One row per output and inputs file: the rows of its chunks merged (see
    :func:`onnx_conv2matmul.verify.stream.merge_rows`)."""
    groups: dict[tuple[int, str], list[OutputComparison]] = {}
    for row in results:
        groups.setdefault((row.length, row.output), []).append(row)
    # A file's chunks hold the samples its per-sample outputs count, chunk by chunk.
    samples: dict[int, list[int]] = {}
    for (length, _), rows in groups.items():
        counts = samples.setdefault(length, [1] * len(rows))
        for index, row in enumerate(rows[: len(counts)]):
            counts[index] = max(counts[index], row.samples)
    return [merge_rows(rows, samples[length]) for (length, _), rows in groups.items()]


def _compare(reference: Reference, original: str, candidate: str, candidate_given: bool) -> VerifyReport:
    options = reference.options  # with what was found before the check (see discover)
    report = VerifyReport(original, candidate, options, reference.how())
    report.lengths = [run.length for run, _ in reference.done]
    report.lengths_rule, report.lengths_not_run = reference.plan.rule, reference.not_run
    report.dims, report.runs = list(reference.plan.roles.dims), [run for run, _ in reference.done]
    report.warnings, report.output_sizes = reference.warnings(), reference.sizes_how
    try:
        opened, _, names = runs.open_model(candidate, "candidate", options, reference.specs)
    except ModelLoadError as err:
        if candidate_given:
            raise
        report.results.append(OutputComparison.failure(0, "*", str(err)))
        return report
    if names != reference.names:
        raise InputError(f"the two models have different outputs: {reference.names} vs {names}")
    indices = list(options.output_indices) if options.output_indices else list(range(len(names)))
    roles = reference.plan.roles
    try:
        for run, ref_outputs, cand_outputs in runs.candidate_runs(
            opened, reference.specs, reference.done, options, roles
        ):
            samples = run_samples(run, options, roles)
            for index in indices:
                report.results.append(
                    compare_outputs(
                        ref_outputs[index],
                        cand_outputs[index],
                        options,
                        length=run.length,
                        name=names[index],
                        samples=samples,
                        task=reference.tasks.get(names[index], ""),
                    )
                )
            del ref_outputs, cand_outputs  # before the next run is made
    except ModelRunError as err:
        report.results.append(OutputComparison.failure(0, "*", str(err)))
    del opened
    release_freed_memory()
    return report


def run_samples(run: Run, options: VerifyOptions, roles: Roles) -> int:
    """How many samples (batch rows) the inputs of ``run`` hold: its batch dims' value, or the
    first dim the float inputs of a real input file share (see :func:`feed_samples`)."""
    if run.rows is not None:
        return run.rows[1] - run.rows[0]
    if options.feeds is not None:
        return feed_samples(options.feeds[run.length - 1])
    values = {run.dims[key] for key in roles.keys(Role.BATCH) if key in run.dims}
    return values.pop() if len(values) == 1 else 1


class Reference:
    """The original model's side of a check: its inputs, dims, plan and outputs per run.

    The session is closed before the constructor returns; ``done`` holds each run with the
    original's outputs until the candidate's are compared.
    """

    def __init__(self, path: str, options: VerifyOptions, *, run: bool = True, session: Any = None) -> None:
        opened, self.specs, self.names = runs.open_model(path, "original", options, opened=session)
        options = discover(path, options, self.specs, functools.partial(runs.probe_run, opened))
        self.options = options
        self.tasks = output_tasks(read_graph(path), options.labels) if options.min_cosine is not None else {}
        refuse_synthesised(self.tasks, options)
        roles = dim_roles(self.specs, options)
        sizes = runs.measure_outputs(opened, self.specs, roles, options, runs.output_sizes(opened))
        self.sizes_how = sizes.how
        self.plan: LengthPlan = plan_lengths(self.specs, options, roles, sizes)
        planner = Planner(self.specs, roles, sizes, options)
        planner.step = self.plan.step
        self.done: list[tuple[Run, list[Any]]] = []
        self.not_run: list[tuple[int, str]] = list(self.plan.left_out)
        self.spill: Spill | None = None
        if run:
            self.spill = Spill() if self.plan.spill else None
            try:
                self.done, self.not_run = runs.reference_runs(
                    opened, self.specs, self.plan, options, planner.fit, self.spill
                )
            except BaseException:
                self.close()
                raise
        if options.lengths is None and options.feeds is None:
            self.done.sort(key=lambda item: (item[0].long, item[0].length))
        del opened
        release_freed_memory()

    def close(self) -> None:
        """Remove the reference outputs kept on disk, if any."""
        if self.spill is not None:
            self.spill.close()
            self.spill = None

    def how(self) -> dict[str, str]:
        """How each input is synthesised (the same in every run)."""
        run = self.done[0][0]
        values = run.dims if self.options.feeds is None else None
        return synthesise_inputs(self.specs, run.length, self.options, values, self.plan.roles)[1]

    def warnings(self) -> list[str]:
        found = list(self.plan.roles.warnings)
        if self.options.lengths is not None and not self.plan.roles.sequence:
            found.append("the lengths given were not used: no dim takes a length")
        return found

    def feeds(self) -> list[Mapping[str, np.ndarray]]:
        """The inputs of every run, as :func:`verify_models` makes them."""
        return [
            synthesise_inputs(
                self.specs,
                run.length,
                self.options,
                run.dims if self.options.feeds is None else None,
                self.plan.roles,
            )[0]
            for run, _ in self.done
        ]


def discover_inputs(path: str, options: VerifyOptions) -> VerifyOptions:
    """``options`` with the input values and sizes the model at ``path`` takes, found in its
    graph and by probing it (see :mod:`onnx_conv2matmul.verify.discover`), and ``found`` set.

    Every step that synthesises inputs from the options it returns (the check, the search, the
    latency step) feeds the same shapes and values, so they are looked for once. As they are
    with real inputs, when already looked for, or when the model cannot be read or loaded here
    (the check then reports why).

    Raises:
        OutOfMemory: memory ran out while probing.
    """
    if options.feeds is not None or options.found is not None:
        return options
    model = read_graph(path)
    specs = graph_specs(model) if model is not None else None
    if specs is None:
        return options
    try:
        check_names(specs, options)
    except InputError:
        return options  # the check refuses them with the message
    if not needs_probes(specs, options):
        return discover(path, options, specs, _no_run, model)
    try:
        opened, specs, _ = runs.open_model(path, "original", options)
    except (ModelLoadError, InputError):
        return options
    try:
        return discover(path, options, specs, functools.partial(runs.probe_run, opened), model)
    finally:
        del opened
        release_freed_memory()


def _no_run(feeds: Mapping[str, np.ndarray]) -> None:  # pragma: no cover - never called
    raise AssertionError("no probe runs without two sequence dims")


def planned_feeds(path: str, options: VerifyOptions) -> list[Mapping[str, np.ndarray]]:
    """The inputs the check of the model at ``path`` feeds it, one set per run.

    Synthesised inputs: the original runs each planned run (to replace the lengths it
    cannot run at), and its outputs are dropped at once. Real inputs (``options.feeds``)
    are returned as they are, once the plan has found that they fit the memory budget.

    Raises:
        ModelRunError, InputError, OutOfMemory: as :func:`verify_models`.
    """
    if options.feeds is not None:
        Reference(path, options, run=False)
        return list(options.feeds)
    reference = Reference(path, options)
    for index, (run, _) in enumerate(reference.done):
        reference.done[index] = (run, [])
    return reference.feeds()


__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_MAX_ABS",
    "DEFAULT_MEAN_ABS",
    "DEFAULT_MEMORY",
    "IMAGE_LENGTHS",
    "LONG_LENGTH",
    "Criterion",
    "Feed",
    "InputSpec",
    "ModelRunError",
    "OutputComparison",
    "VerifyOptions",
    "VerifyReport",
    "check_feeds",
    "check_feeds_for_graph",
    "compare_arrays",
    "compare_outputs",
    "compare_sequences",
    "discover_inputs",
    "element_scales",
    "feed_samples",
    "input_value_ranges",
    "judge_rows",
    "load_inputs",
    "merged_rows",
    "planned_feeds",
    "run_samples",
    "sample_cosines",
    "synthesise_inputs",
    "thresholds",
    "verify_models",
]

# pragma: no mutate end
