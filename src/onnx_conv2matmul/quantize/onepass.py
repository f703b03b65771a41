"""The default quantize run as one pass: measure once, decide, build, check, publish.

When the floor applies (no settings given, no ``--auto``, MatMulNBits with the default
algorithm), the run is, in order, each stage entered once:

1. **measure** (:mod:`~onnx_conv2matmul.quantize.measure`): one session of the original plans
   the check's inputs, runs each once (the reference every candidate is compared with) and times
   the original at the timing's short length;
2. **build** (:mod:`~onnx_conv2matmul.quantize.build`): the uniform settings, quantized in memory
   and opened in onnxruntime without writing a model;
3. **check** (:mod:`~onnx_conv2matmul.quantize.check`): that candidate run once on every feed,
   compared as the outputs arrive; its run also gives each MatMul input's statistics;
4. only when it missed the criterion, **decide** (:mod:`~onnx_conv2matmul.quantize.decide`)
   chooses each layer's setting from predicted sensitivity (on a model of repeated blocks,
   scaled to the loss of each class of layers quantized alone, :mod:`~onnx_conv2matmul.quantize.classes`)
   and the measured loss, and the mix is built (its int4 blocks are those of the first build,
   spilled to the scratch folder and read back memory-mapped) and checked once;
5. the candidate that met the criterion is written once, timed at the same length, published.

A run made for one layout of the Transposes' trade (:mod:`~onnx_conv2matmul.quantize.transposes`)
times nothing: the trade times both layouts against the original, interleaved, and that timing
becomes the kept layout's latency line.

That is two quantizations and two candidate runs at most, besides the classes' short runs;
should the mix miss as well, a third is made: the same MatMuls with the other weights in float
when the mix stored them in int8 (:func:`~onnx_conv2matmul.quantize.decide.others_in_float`),
else aimed through both candidates' measured losses; after it the run falls back to the search
(:mod:`~onnx_conv2matmul.quantize.search`). :class:`OnePass` holds the run's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files.paths import folder_bytes
from onnx_conv2matmul.quantize import build as _build
from onnx_conv2matmul.quantize import check as _check
from onnx_conv2matmul.quantize import classes as _classes
from onnx_conv2matmul.quantize import decide as _decide
from onnx_conv2matmul.quantize import measure as _measure
from onnx_conv2matmul.quantize.blockwise import BlockCache, MemoryBlockCache
from onnx_conv2matmul.quantize.check_publish import confirm_held_out
from onnx_conv2matmul.quantize.kernel_plan import shortened
from onnx_conv2matmul.quantize.plan import peak_rss_bytes, wants_smallest
from onnx_conv2matmul.quantize.run_report import nbits_warnings, why_unchanged
from onnx_conv2matmul.quantize.search_options import Setting

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.plan import QuantizePlan, Run
    from onnx_conv2matmul.quantize.settings import QuantizeOptions
    from onnx_conv2matmul.rewrite.report import ConvertReport
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.speed.timing import ModelTiming, TimingOptions
    from onnx_conv2matmul.verify.check import VerifyReport


def applies(run: Run) -> bool:
    """Whether ``run`` is a default run the one pass serves: the floor's search below the criterion
    on, no ``--auto`` and no metric, MatMulNBits by the default algorithm, a cosine criterion, and
    the kernel settings chosen from their costs (``--bench full`` quantizes and times every
    candidate whole, as asked)."""
    plan = run.plan
    verify = plan.verify
    return (
        plan.search_below
        and (plan.speed is None or plan.speed.mode == "shapes")
        and run.auto is None
        and not plan.int8
        and plan.metric is None
        and run.quantize.algorithm == "default"
        and verify.min_cosine is not None
        and not verify.report_only
    )


@dataclasses.dataclass
class Shared:
    """The original's measurement for the runs of one Transposes' trade: the first run measures
    into ``directory`` (the trade's scratch, removed with it), the second reads it."""

    directory: str
    measurement: _measure.Measurement | None = None


@dataclasses.dataclass
class OnePass:
    """One default run's state as the stages fill it in."""

    run: Run
    rewrite: ConvertReport
    external: bool
    measurement: _measure.Measurement | None = None
    candidates: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    chosen: _build.Candidate | None = None
    checked: _check.Checked | None = None
    decision: _decide.Decision | None = None
    first_failure: str = ""
    """The first candidate's failure in words (the uniform settings'), when it missed."""
    order: _check.Runs | None = None
    """The feeds the first candidate's check found worst first: the order of the later ones'."""
    classes: list[_classes.ClassLoss] = dataclasses.field(default_factory=list)
    classes_note: str = ""
    classes_seconds: float = 0.0

    def execute(self, modes: tuple[int, int]) -> bool:
        """Run the stages into ``run.output``; False when the criterion was not met by any
        candidate of the pass (the caller falls back to the search)."""
        run = self.run
        plan, output = run.plan, run.output
        progress = plan.progress
        shared: Shared | None = plan.request.shared
        with contextlib.ExitStack() as stack:
            scratch = (
                shared.directory if shared is not None else stack.enter_context(output.scratch("reference"))
            )
            if shared is not None and shared.measurement is not None:
                self.measurement = shared.measurement  # the other layout of the trade measured it
            else:
                progress.phase("Measuring the original")
                os.makedirs(scratch, exist_ok=True)
                timing = None if plan.timed_by_trade else short_timing(plan.speed)
                self.measurement = _measure.measure(plan, scratch, timing, progress.phase)
                if shared is not None:
                    shared.measurement = self.measurement
            cache = MemoryBlockCache()
            progress.phase("Quantizing")
            first = _build.build(plan, run.quantize, cache)
            statistics = _matmul_inputs(first.model)
            progress.phase("Checking the candidate (uniform settings)")
            checked = self._checked(first, statistics, "uniform")
            smaller = None if checked.passed else _size_block(run)
            if smaller is not None:
                # --prefer size: the block of the fewest bytes, larger than the default's,
                # missed; the pass goes on at the default's, more accurate, for its mix.
                del first
                run.quantize = smaller
                run.report.options["quantize"] = smaller.to_dict()
                cache = MemoryBlockCache()
                progress.phase("Quantizing")
                first = _build.build(plan, run.quantize, cache)
                progress.phase(f"Checking the candidate (uniform settings, block {smaller.block_size})")
                checked = self._checked(first, statistics, f"uniform, block {smaller.block_size}")
            self.chosen, self.checked = first, checked
            if not checked.passed:
                self.chosen = None  # the model is not needed again
                del first
                # Its blocks go to the scratch folder: the classes' and the mix's builds read
                # those they take, memory-mapped, instead of all of them staying in memory.
                blocks = tempfile.mkdtemp(prefix="blocks-", dir=scratch)
                stack.callback(shutil.rmtree, blocks, ignore_errors=True)  # a trade's scratch outlives this
                if not self._mix(checked, cache.spill(blocks)):
                    return False
            del cache
            self._publish(modes, scratch)
        return True

    def _checked(self, candidate: _build.Candidate, statistics: list[str], label: str) -> _check.Checked:
        assert self.measurement is not None
        reference = self.measurement.reference
        # After the first candidate, the feeds it found worst go first and a miss stops the run;
        # not for one whose statistics and loss the mix is decided from (--prefer size's second
        # uniform candidate): those take every feed.
        order = None if statistics else self.order
        plan, memos = self.run.plan, self.run.plan.request.memos
        key = _uniform_key(plan, self.run.quantize, reference, statistics)
        checked = before = _failed_before(plan, key)
        if checked is None:
            checked = _check.check_model(plan, candidate.model, reference, statistics=statistics, runs=order)
            if key is not None and memos is not None and not checked.passed:  # key: a cosine floor
                memos.failed[key] = (plan.verify.min_cosine or 0.0, checked)
        if not self.candidates:
            self.first_failure, self.order = checked.failure, checked.worst_first()
        self.candidates.append(
            {
                "candidate": label,
                "settings": _counts(candidate),
                "worst_cosine": checked.worst_cosine,
                **({"stopped_after_samples": list(checked.samples)} if checked.stopped else {}),
                "labels": [t.to_dict() for t in checked.labels],
                "passed": checked.passed,
                "seconds": 0.0 if before is not None else round(checked.seconds, 3),
                **({"checked_before": True} if before is not None else {}),
            }
        )
        return checked

    def _mix(self, uniform: _check.Checked, cache: BlockCache) -> bool:
        """Decide the per-layer mix from the uniform candidate's loss, build and check it (and once
        more if it missed: its other weights in float, or aimed through both candidates' losses);
        whether one met the criterion."""
        run = self.run
        plan = run.plan
        progress = plan.progress
        floor = plan.verify.min_cosine
        assert floor is not None
        loss = uniform.loss(floor)
        progress.phase("Deciding each layer's setting from predicted sensitivity")
        speed_filter = None
        report = run.report
        if report.kernel_plan is not None and plan.speed is not None and not wants_smallest(plan.request):
            speed_filter = report.kernel_plan.speed_filter(run.quantize.accuracy_level, plan.speed.margin)
        fp32 = _build.load_rewritten(plan)
        sens = _decide.sensitivity(fp32, run.quantize, uniform.activations, speed_filter)
        groups = _classes.losses_of(sens, _classes.classes(fp32, [node.name for node in sens.nodes]))
        del fp32  # before the classes' builds: each holds its own rewritten weights
        self._measure_classes(sens, groups, loss, cache)
        decision, label = _decide.decide(sens, run.quantize, loss), "mix"
        for step in range(2):
            progress.phase("Quantizing the chosen mix")
            candidate = _build.build(plan, decision.options, cache)
            progress.phase(f"Checking the candidate (the chosen {label})")
            checked = self._checked(candidate, [], label)
            self.candidates[-1]["decision"] = decision.to_dict()  # each mix's, not only the last
            if checked.passed:
                self.chosen, self.checked, self.decision = candidate, checked, decision
                return True
            if step:
                break
            # The next: the same MatMuls with the other weights in float when the mix stored them
            # in int8 (their prediction is the least grounded), else aimed through both losses.
            kept = _decide.others_in_float(decision, sens)
            if kept is not None:
                decision, label = kept, "mix, other weights in float"
            else:
                missed = (decision.predicted_error, checked.loss(floor))
                decision = _decide.decide(sens, run.quantize, loss, missed=missed)
                label = "mix, aimed through both candidates"
        return False

    def _measure_classes(
        self, sens: _decide.Sensitivity, groups: list[_classes.ClassLoss], loss: float, cache: BlockCache
    ) -> None:
        """The classes measured (:func:`_classes.measure`) and the prediction scaled to them; not
        when the uniform candidate's loss is not finite."""
        assert self.measurement is not None
        run = self.run
        self.classes = groups
        if not math.isfinite(loss):
            self.classes_note = "not measured: the uniform candidate's loss is not finite"
            return
        started = time.perf_counter()
        note = _classes.measure(run.plan, run.quantize, groups, self.measurement.reference, cache)
        self.classes_seconds = time.perf_counter() - started
        if groups and all(group.measured is not None for group in groups):
            applied = _classes.calibrate(sens, groups)
            note += (
                ": the predicted errors scaled to their losses"
                if applied
                else ": not applied (no class lost anything measurable)"
            )
        self.classes_note = note

    def _publish(self, modes: tuple[int, int], scratch: str) -> None:
        """Write the chosen candidate once, report it, time it and publish it when it passed."""
        run = self.run
        plan, report, output = run.plan, run.report, run.output
        progress = plan.progress
        chosen, checked, measurement = self.chosen, self.checked, self.measurement
        assert chosen is not None and checked is not None and measurement is not None
        result = chosen.result
        report.matmuls = result.matmuls
        report.quantized_nodes = result.quantized
        report.excluded = result.excluded
        report.settings = result.settings
        report.other_weights = chosen.other_weights
        report.warnings.extend(nbits_warnings(result, chosen.options, decided=self.decision is not None))
        if self.decision is not None:
            first = self.candidates[0]
            worst, floor = first["worst_cosine"], plan.verify.min_cosine
            if worst is not None and floor is not None and worst < floor:
                below = f"worst cosine {worst:.4f} < {floor:g}"
            else:  # the labels, or an output judged another way (integer ids: agreement)
                below = next(
                    (_labels_text(t) for t in first["labels"] if not t["passed"]),
                    self.first_failure or "the check failed",
                )
            report.accuracy["fallback"] = {
                "reason": below,
                "settings": report.options["quantize"],
                "worst_cosine": first["worst_cosine"],
                "score": None,
            }
            counts = ", ".join(f"{n} {label}" for label, n in self.decision.counts.items())
            counts = counts or "every layer in float"
            report.warnings.append(
                f"the settings asked for fell below the accuracy criterion ({below}): per-layer"
                f" settings chosen from predicted sensitivity meet it instead ({counts})"
            )
            run.quantize = chosen.options
            report.options["quantize"] = chosen.options.to_dict()
        report.unchanged = why_unchanged(self.rewrite, report, result, chosen.options, plan.verify)
        report.one_pass = {
            "candidates": self.candidates,
            "decision": None if self.decision is None else self.decision.to_dict(),
            "classes": {
                "measured": [group.to_dict() for group in self.classes],
                "note": self.classes_note,
                "seconds": round(self.classes_seconds, 3),
            }
            if self.classes
            else None,
        }
        progress.phase("Saving")
        model = chosen.model
        self.chosen = None
        staged = output.stage(model, external=self.external, progress=progress.advance)
        del model
        with contextlib.ExitStack() as stack:
            stack.enter_context(staged)
            report.peak_rss_quantize_bytes = peak_rss_bytes()
            report.external_data = staged.data_path is not None
            report.output_bytes = staged.size
            report.bytes_written = staged.size + folder_bytes(scratch)
            if plan.run_checker:
                progress.phase("Checking the output")
                _io.run_checker(staged.onnx_path, "the quantized model")
            report.verification = verify_staged(measurement, plan, staged.onnx_path, checked)
            if report.passed and measurement.timing is not None:
                progress.phase("Timing the result against the original")
                slower = self._time(staged.onnx_path)
                speed = plan.speed
                retry = speed is not None and len(speed.levels) > 1 and report.kernel_plan is not None
                # --auto's default candidate: its caller tries them if it keeps it (check_publish.
                # level_of_kept_default), as the search's model is usually kept.
                if slower and retry and not plan.request.candidate:
                    # Chosen from per-shape costs and measurably slower than the original whole:
                    # the other accuracy levels are checked and timed (the level's attribute only).
                    from onnx_conv2matmul.quantize.check_publish import speed_step

                    staged = speed_step(run, staged, stack, measurement.timing_options, slower)
                    if report.kernel_choice is not None:
                        progress.phase("Checking the output at the level kept")
                        verification = measurement.reference.check(plan.src, staged.onnx_path, plan.verify)
                        verification.candidate = plan.dst
                        report.verification = verification
                else:
                    report.warnings.extend(slower)
            confirm_held_out(run, staged.onnx_path)
            if report.passed:
                progress.phase("Publishing")
                staged.publish(modes)
                report.output_path = plan.dst

    def _time(self, path: str) -> list[str]:
        """The result timed as the original was (same inputs and rounds) into the report's latency;
        a warning per length it is measurably slower at. Timed on a busy machine, the latency is
        kept with a warning that says so, and decides nothing (no other level is tried for it)."""
        from onnx_conv2matmul.speed.machine import is_busy
        from onnx_conv2matmul.speed.timing import time_models

        measurement = self.measurement
        assert measurement is not None and measurement.timing is not None
        assert measurement.timing_options is not None
        timed = time_models([path], measurement.timing_options, labels=["result"])
        latency, slower = latency_section(
            measurement.timing, timed.models[0], measurement.timing_options, measurement.timing_rule
        )
        self.run.report.latency = latency
        if timed.cpu_wait is not None and is_busy(timed.cpu_wait):
            from onnx_conv2matmul.quantize.kernel import busy_warning

            self.run.report.warnings.append(busy_warning(timed.cpu_wait))
            return []
        return slower


def verify_staged(
    measurement: _measure.Measurement, plan: QuantizePlan, path: str, checked: _check.Checked
) -> VerifyReport:
    """The accuracy check's report of the staged result: its rows are those of its check run in
    memory (the same nodes and weights), against the reference measured once."""
    verification = measurement.reference.check(
        plan.src, path, plan.verify, checked.flat_rows(), note=RAN_IN_MEMORY
    )
    verification.candidate = plan.dst
    return verification


RAN_IN_MEMORY = (
    "the candidate's outputs are those of its check run in memory, before it was written (the same"
    " nodes and weights): it was not run again"
)


def short_timing(speed: SpeedOptions | None) -> TimingOptions | None:
    """What the default latency line times: :func:`~.kernel_plan.shortened`, at the shortest of
    the default lengths (:func:`onnx_conv2matmul.quantize.measure.measure` picks it). None: not timed."""
    return None if speed is None else shortened(speed.timing)


def latency_section(
    original: ModelTiming, result: ModelTiming, options: TimingOptions, rule: str
) -> tuple[dict[str, Any], list[str]]:
    """The report's ``latency`` from the original timed in the measure stage and the result timed
    at the end (not interleaved: the report's mode says ``apart``), and a warning per length the
    result is measurably slower at."""
    from onnx_conv2matmul.speed.latency import Latency, Mode, ratio_interval
    from onnx_conv2matmul.speed.machine import cpu_name
    from onnx_conv2matmul.speed.timing import TimingReport

    latencies = []
    slower = []
    for base, own in zip(original.latencies, result.latencies, strict=True):
        rounds = min(len(base.samples_ms), len(own.samples_ms))
        a, b = base.samples_ms[:rounds], own.samples_ms[:rounds]
        ratio = float(np.median(b) / np.median(a))
        low, high = ratio_interval(a, b)
        latency = Latency(own.length, own.samples_ms, ratio, low, high)
        latencies.append(latency)
        if latency.measurably_slower:
            slower.append(
                f"the result is slower than the original at length {own.length}: {ratio:.2f}x its latency"
            )
    timed = dataclasses.replace(result, latencies=tuple(latencies))
    lengths = tuple(lat.length for lat in original.latencies)
    header = TimingReport((original, timed), 0, lengths, rule, options, Mode.APART, cpu_name()).header()
    section = {
        **header,
        "original": [lat.to_dict() for lat in original.latencies],
        "result": [lat.to_dict() for lat in latencies],
    }
    return section, slower


def _labels_text(result: dict[str, Any]) -> str:
    return (
        f"output {result['output']!r} keeps {result['agreement']:.2%} of {result['labels']} labels"
        f" < {result['floor']:.0%}"
    )


def _size_block(run: Run) -> QuantizeOptions | None:
    """With ``--prefer size``, the settings to go on with when the uniform candidate at the
    block of the fewest bytes (:meth:`~onnx_conv2matmul.quantize.kernel_plan.KernelPlan.for_size`)
    missed: the default block size when that one is larger, as its mix keeps more layers in 4
    bits (openWakeWord's hey jarvis: 0.27x from a mix at block 128, 0.16x at 64); None otherwise."""
    from onnx_conv2matmul.quantize.settings import QuantizeOptions

    base = QuantizeOptions().block_size
    if not wants_smallest(run.plan.request) or run.quantize.block_size <= base:
        return None
    return dataclasses.replace(run.quantize, block_size=base)


def _uniform_key(
    plan: QuantizePlan, quantize: QuantizeOptions, reference: Any, statistics: Sequence[str]
) -> tuple[Any, ...] | None:
    """What tells a uniform candidate's check (it gathers ``statistics``) from another of the same
    quantize: input, rewrite, settings, feeds; None for a mix, or without a cosine criterion or memos."""
    if not statistics or plan.request.memos is None or plan.verify.min_cosine is None:
        return None
    return (plan.src, repr(plan.convert), repr(quantize), reference.feeds.signature())


def _failed_before(plan: QuantizePlan, key: tuple[Any, ...] | None) -> _check.Checked | None:
    """An earlier attempt's check of the same uniform candidate, which missed a minimum cosine no
    stricter than this plan's: it misses this one too (a step back only raises it; PP-OCRv4 rec: 1.4 s)."""
    if key is None or plan.request.memos is None or plan.verify.min_cosine is None:
        return None
    floor, checked = plan.request.memos.failed.get(key, (None, None))
    return checked if floor is not None and floor <= plan.verify.min_cosine else None


def _matmul_inputs(model: Any) -> list[str]:
    """The main-graph inputs A of the MatMulNBits nodes (their statistics are gathered)."""
    names: list[str] = []
    for node in model.graph:
        if node.op_type == "MatMulNBits" and node.inputs and node.inputs[0] is not None:
            value = node.inputs[0]
            if value.name and not value.is_graph_input() and value.name not in names:
                names.append(value.name)
    return names


def _counts(candidate: _build.Candidate) -> dict[str, int]:
    """How many MatMuls took each setting, by the search's label of it."""
    counts: dict[str, int] = {}
    for setting in candidate.result.settings.values():
        label = Setting(setting.bits, setting.block_size, setting.symmetric).label
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items()))
