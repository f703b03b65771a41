"""The quantize workflow's speed step: choose the MatMulNBits kernel settings on this CPU, and time
the result against the original.

By default (``SpeedOptions.mode`` ``shapes``) the choice comes before the quantization
(:func:`plan_kernels`): every candidate block size and accuracy level is costed at the model's own
weight shapes and activation rows (:mod:`onnx_conv2matmul.quantize.speed_objective`), the model is
quantized once with the cheapest, and the result is timed against the original once. The same
costs keep the search (below the accuracy floor) from precisions slower than float.

With ``mode`` ``full`` (``--bench full``), the staged model is the first candidate. Each other
block size tried is the input loaded, rewritten and quantized again into a staging directory of
its own beside the destination; every accuracy level tried is an attribute-only copy of a
staged model beside it (:func:`onnx_conv2matmul.speed.choose.level_candidates`). The winner's
level is written into its ``.onnx``, and the winner is what the workflow checks and publishes;
the other staging directories are removed with the ``ExitStack`` the caller holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files.load import load_input
from onnx_conv2matmul.quantize.kernel_plan import KernelPlan as KernelPlan
from onnx_conv2matmul.quantize.kernel_plan import plan_kernels as plan_kernels
from onnx_conv2matmul.quantize.kernel_plan import timing_options as timing_options
from onnx_conv2matmul.quantize.nbits import NBitsResult, quantize_matmul_nbits
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.speed.choose import (
    AccuracyCheck,
    Candidate,
    KernelChoice,
    SpeedOptions,
    accuracy_levels,
    choose_kernel,
    level_candidates,
    reference_accuracy,
    set_accuracy_level,
)
from onnx_conv2matmul.speed.timing import Latency, TimingOptions, TimingReport, time_models
from onnx_conv2matmul.verify.run import open_model, release_freed_memory

if TYPE_CHECKING:
    import onnx_ir as ir

    from onnx_conv2matmul.files.output import Output, Staged
    from onnx_conv2matmul.files.progress import Progress
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.quantize.options import QuantizeOptions
    from onnx_conv2matmul.quantize.other_weights import OtherWeightsResult
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.verify.check import VerifyOptions


@dataclasses.dataclass(frozen=True)
class SpeedStep:
    """What the speed step reads of the run: the input, how it is rewritten and checked, the
    progress, the user's metric and the original's score (None: no metric), where candidates are
    staged and the stack that removes them, whether the run is int8 (only timed), and whether
    the caller times the result after (``timed_later``: the Transposes' trade times both layouts;
    a step with a single candidate that meets the target times nothing then), and the inputs the
    original's latency line was timed on (``timing``; None: chosen here, as it chooses them)."""

    src: str
    convert: ConvertOptions
    verify: VerifyOptions
    progress: Progress
    output: Output | None = None
    stack: contextlib.ExitStack | None = None
    int8: bool = False
    metric: MetricTarget | None = None
    original_score: float | None = None
    timed_later: bool = False
    timing: TimingOptions | None = None


@dataclasses.dataclass
class Variant:
    """One quantization of the model, staged: its block size, files and what the quantizer did."""

    block_size: int
    staged: Staged
    result: NBitsResult | None
    other_weights: OtherWeightsResult | None = None


@dataclasses.dataclass
class SpeedOutcome:
    """The variant kept (with the winner's level written into it), the options that replay it,
    what was chosen and the latency of the result against the original."""

    variant: Variant
    options: QuantizeOptions | None
    choice: KernelChoice | None
    timing: TimingReport | None
    """None: nothing was timed (the step's ``timed_later``)."""
    result_index: int

    def latency(self) -> dict[str, Any] | None:
        """The report's ``latency`` section: the original's and the result's latencies."""
        return None if self.timing is None else latency_of(self.timing, self.result_index)

    def slower(self) -> list[str]:
        """Warnings for every length at which the result is measurably slower than the original."""
        return [] if self.timing is None else slower_of(self.timing, self.result_index)


def busy_warning(cpu_wait: float) -> str:
    """The warning of a latency line timed on a busy machine (``cpu_wait``: the share of the CPUs
    other processes used meanwhile)."""
    from onnx_conv2matmul.speed.machine import busy_text

    return (
        f"the latency was measured on a busy machine ({busy_text(cpu_wait)}): its ratio may not hold"
        " on a quiet one, and decided nothing"
    )


def latency_of(timing: TimingReport, index: int) -> dict[str, Any]:
    """The report's ``latency`` section of the model ``timing`` timed at ``index`` against the
    original (its first model)."""
    original, result = timing.models[0], timing.models[index]
    return {
        **timing.header(),
        "original": [lat.to_dict() for lat in original.latencies],
        "result": [lat.to_dict() for lat in result.latencies],
    }


def slower_of(timing: TimingReport, index: int) -> list[str]:
    """Warnings for every length at which the model ``timing`` timed at ``index`` is measurably
    slower than the original (the whole 95% interval of the ratio above 1; the table shows every
    ratio)."""
    return [
        f"the result is slower than the original at length {lat.length}: {lat.ratio:.2f}x its latency"
        for lat in timing.models[index].latencies
        if measurably_slower(lat)
    ]


def measurably_slower(latency: Latency) -> bool:
    """:attr:`~onnx_conv2matmul.speed.timing.Latency.measurably_slower`, the rule's one place."""
    return latency.measurably_slower


def choose_settings(run: Any, model: ir.Model, for_size: bool) -> None:
    """The block size and accuracy level of ``run`` (a :class:`~onnx_conv2matmul.quantize.plan.Run`:
    this module is below the plan) chosen from their costs at ``model``'s weight shapes (``model``
    rewritten; the run's report keeps the plan). For the smallest model
    (``for_size``: ``--prefer size``, ``--auto``) nothing is chosen for speed (accuracy level 4 quantizes the
    activations too: PP-OCRv4's detector came out at 1.00x with it, 0.435x without): the one pass
    takes the block of the fewest bytes at level 0 (:meth:`KernelPlan.for_size`), a search
    chooses its own (nothing is costed for it)."""
    plan, report, speed = run.plan, run.report, run.plan.speed
    assert speed is not None
    if for_size and run.auto is not None:
        return
    plan.progress.phase("Kernel choice: timing each weight shape")
    report.kernel_plan = plan_kernels(plan.src, model, run.quantize, speed, plan.verify)
    if for_size:
        report.kernel_plan = report.kernel_plan.for_size()
    run.quantize = report.kernel_plan.options
    report.options["quantize"] = run.quantize.to_dict()
    if run.auto is not None and len(speed.levels) > 1:
        run.auto = dataclasses.replace(run.auto, accuracy_level=run.quantize.accuracy_level)


TIMED_INPUTS = "Timing: proving the inputs the original runs at"
"""The speed step's progress step while it runs the original at the lengths it may time."""

SETTLE_ROUNDS = 5
"""The result timed alone against the original stops after this many rounds, or any later one,
once its ratios are settled (see :func:`onnx_conv2matmul.speed.latency.settled`)."""


def run_speed_step(
    step: SpeedStep, first: Variant, options: QuantizeOptions, speed: SpeedOptions
) -> SpeedOutcome:
    """Choose among the speed options' candidates (when there are several and the model has a
    MatMulNBits node) and time the result.

    A candidate meets the accuracy target as the output must meet the workflow's criterion:
    every sample's cosine similarity at least ``step.verify.min_cosine`` and, with the step's
    metric, the score's drop from its original score at most the metric's ``max_drop`` (a
    candidate that misses it counts as cosine -1, with the score in its note)."""
    src, verify, progress = step.src, step.verify, step.progress
    chooses = not step.int8 and speed.chooses and bool(accuracy_levels(first.staged.onnx_path))
    if not chooses and step.timed_later:
        return SpeedOutcome(first, None, None, None, 1)
    # One checking session of the original proves the inputs timed and makes the candidates'
    # reference (the Parakeet-shaped encoder's 2.3 GiB original was opened three times for them).
    proves = step.timing is None and verify.feeds is None and speed.timing.lengths is None
    if proves:  # the original run at the lengths it may be timed at (counted as timing, not saving)
        progress.phase(TIMED_INPUTS)
    opened = open_model(src, "original", verify)[0] if chooses or proves else None
    # Chosen from per-shape costs (the default): timed at one short length, as the default latency
    # line is (the Parakeet-shaped encoder's two levels under --auto: 204 s at 200 and 1000 frames).
    # The full table is --bench full's.
    timing = step.timing or timing_options(speed, verify, src, short=speed.mode == "shapes", session=opened)
    check = None
    if chooses:
        progress.phase("Measuring the candidates' accuracy")
        check = reference_accuracy(src, verify, session=opened)
    del opened
    release_freed_memory()
    if not chooses:
        progress.phase("Timing the result against the original")
        if timing.rounds > SETTLE_ROUNDS:  # the result alone: rounds stop once its ratios settle
            timing = dataclasses.replace(timing, settle_after=SETTLE_ROUNDS)
        report = time_models([src, first.staged.onnx_path], timing, labels=["original", "result"])
        return SpeedOutcome(first, None, None, report, 1)
    variants = [first]
    for block in speed.block_sizes[1:]:
        progress.phase(f"Quantizing with block {block}")
        assert step.output is not None and step.stack is not None
        variant = quantize_variant(
            src, step.output, step.convert, dataclasses.replace(options, block_size=block), verify
        )
        step.stack.enter_context(variant.staged)
        variants.append(variant)
    several_blocks = len(variants) > 1
    with contextlib.ExitStack() as files:
        candidates: list[Candidate] = []
        for variant in variants:
            candidates += files.enter_context(
                level_candidates(
                    variant.staged.onnx_path,
                    speed.levels,
                    block_size=variant.block_size if several_blocks else None,
                )
            )
        choice = _checked_and_timed(step, candidates, speed, timing, check)
    winner = choice.chosen.candidate
    kept = next(v for v in variants if not several_blocks or v.block_size == winner.block_size)
    set_accuracy_level(kept.staged.onnx_path, winner.accuracy_level, kept.staged.onnx_path)
    chosen = dataclasses.replace(options, block_size=kept.block_size, accuracy_level=winner.accuracy_level)
    return _outcome(kept, chosen, choice)


def _checked_and_timed(
    step: SpeedStep, candidates: Any, speed: SpeedOptions, timing: Any, check: Any = None
) -> Any:
    """The candidates' accuracy against the original (``check``, made here when None; and the
    user's metric), then their timing against it: the kernel choice among them."""
    if check is None:
        step.progress.phase("Measuring the candidates' accuracy")
        check = reference_accuracy(step.src, step.verify)
    if step.metric is not None and step.original_score is not None:
        check = _with_metric(check, step.metric, step.original_score)
    if step.timed_later:  # the trade times the layouts after: timed here only to choose
        step.progress.phase(f"Checking {len(candidates)} candidates (timed only if several meet the target)")
    else:
        step.progress.phase(f"Timing {len(candidates)} candidates against the original")
    return choose_kernel(
        step.src,
        candidates,
        check,
        min_cosine=step.verify.min_cosine,
        timing=timing,
        min_gain=speed.min_gain,
        time_one=not step.timed_later,
    )


def retry_levels(
    step: SpeedStep,
    outcome: SpeedOutcome,
    options: QuantizeOptions,
    speed: SpeedOptions,
    levels: tuple[int, ...],
) -> SpeedOutcome:
    """A result chosen from per-shape costs and measured slower than the original is not handed
    over as it is: its other accuracy levels (attribute copies) are checked and timed with it,
    whole, and the fastest that meets the accuracy target is kept (the result itself when none
    is faster)."""
    current = options.accuracy_level
    order = (current, *(level for level in levels if level != current))
    kept = outcome.variant
    if len(order) < 2 or not accuracy_levels(kept.staged.onnx_path):
        return outcome  # nothing became MatMulNBits: no kernel setting to choose
    # On the inputs the result was just timed on (the user's, or shapes the check proved), or
    # those of the latency line that found it slower.
    timing = outcome.timing.options if outcome.timing is not None else step.timing
    assert timing is not None  # a result measured slower was timed
    with level_candidates(kept.staged.onnx_path, order) as candidates:
        step.progress.phase("Slower than the original: checking the other accuracy levels")
        choice = _checked_and_timed(step, candidates, speed, timing)
    winner = choice.chosen.candidate
    set_accuracy_level(kept.staged.onnx_path, winner.accuracy_level, kept.staged.onnx_path)
    chosen = dataclasses.replace(options, accuracy_level=winner.accuracy_level)
    return _outcome(kept, chosen, choice)


def _outcome(kept: Variant, chosen: QuantizeOptions, choice: KernelChoice) -> SpeedOutcome:
    """The step's outcome once ``choice`` is made: the winner's latency is the timing's row of its
    name (no timing when the choice needed none)."""
    if choice.timing is None:
        return SpeedOutcome(kept, chosen, choice, None, 0)
    labels = [model.label for model in choice.timing.models]
    return SpeedOutcome(kept, chosen, choice, choice.timing, labels.index(choice.chosen.candidate.name))


RETRY_MARGIN = 0.05
"""The most accurate level is tried on a result below the criterion only when its MatMuls cost at
most this much more than float's at the model's shapes: a slower one is no answer to give."""


def accurate_level(
    path: str,
    options: QuantizeOptions,
    speed: SpeedOptions,
    progress: Progress,
    plan: KernelPlan | None = None,
) -> int | None:
    """A staged result chosen from kernel costs fell below the accuracy criterion: the most
    accurate level tried (the first), written into it as an attribute when it is not its level
    already; None when there is none to try, or when ``plan``'s costs put that level's MatMuls
    more than :data:`RETRY_MARGIN` above float's (the search below the criterion is the answer
    then; ``plan.retry`` says so)."""
    level = speed.levels[0]
    if level == options.accuracy_level or not accuracy_levels(path):
        return None
    if plan is not None:
        cost = plan.relative(options.block_size, level)
        if cost is not None and cost > 1 + RETRY_MARGIN:
            plan.retry = (
                f"accuracy level {level} not tried: its MatMuls cost {cost:.2f}x the float ones' at"
                f" block {options.block_size} on this CPU (more than {RETRY_MARGIN:.0%} above)"
            )
            return None
    progress.phase(f"Kernel choice: below the accuracy criterion, trying accuracy level {level}")
    set_accuracy_level(path, level, path)
    return level


def _with_metric(check: AccuracyCheck, metric: MetricTarget, original_score: float) -> AccuracyCheck:
    """``check``, and the user's score of each candidate that passes it: one whose score dropped
    further than the metric allows fails (cosine -1)."""

    def checked(candidate: str) -> tuple[float, str]:
        cosine, note = check(candidate)
        if cosine <= -1.0:
            return cosine, note
        score = metric.score(candidate, "a kernel candidate")
        if not metric.meets(original_score, score):
            drop = metric.drop(original_score, score)
            return -1.0, f"score {score:.6g} against the original's {original_score:.6g} (drop {drop:.6g})"
        return cosine, note

    return checked


def quantize_variant(
    src: str,
    output: Output,
    convert_options: ConvertOptions,
    options: QuantizeOptions,
    verify: VerifyOptions,
) -> Variant:
    """The input loaded, rewritten and quantized with ``options`` again, staged beside the
    destination (the caller removes the staging directory)."""
    from onnx_conv2matmul.files.progress import NullProgress

    loaded = load_input(
        src, output.path, inplace=False, run_checker=False, progress=NullProgress(), timings={}
    )
    model = loaded.model
    rewrite_model(model, convert_options, for_quantization=True)
    external = loaded.has_external_data or _io.tensor_bytes(model) > _io.SINGLE_FILE_LIMIT_BYTES
    result = quantize_matmul_nbits(
        model, options, feeds=verify.feeds, scratch_dir=os.path.dirname(os.path.abspath(output.path))
    )
    other = None
    if options.other_weights == "int8":
        from onnx_conv2matmul.quantize.other_weights import quantize_other_weights

        other = quantize_other_weights(model)
    staged = output.stage(model, external=external)
    del model, loaded
    return Variant(options.block_size, staged, result, other)
