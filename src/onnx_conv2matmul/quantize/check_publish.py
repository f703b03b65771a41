"""The quantize workflow's last steps on a staged model: check it against the plan's criterion,
time it and choose its kernel settings (with ``speed``), and publish it when it passes; and the
publishing of a model the Transposes' trade kept as it was made."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.quantize.run_report import below_text
from onnx_conv2matmul.verify.check import verify_models

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Sequence

    from onnx_conv2matmul.quantize.plan import QuantizePlan, Run
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.transposes import Made
    from onnx_conv2matmul.speed.choose import KernelChoice
    from onnx_conv2matmul.speed.timing import TimingOptions


def check_and_publish(
    run: Run, staged: _output.Staged, stack: contextlib.ExitStack, modes: tuple[int, int]
) -> None:
    """Check (and with ``speed``, time) the staged model; publish it when it meets the criterion.
    A candidate bigger than the model it must beat (the request's ``larger_than``) is left as it
    is: its size is in the report, and nothing else is done with it."""
    plan, report = run.plan, run.report
    speed = plan.speed
    if plan.request.larger_than is not None and staged.size > plan.request.larger_than:
        report.output_bytes = staged.size
        return

    def timed(staged: _output.Staged) -> _output.Staged:
        return speed_step(run, staged, stack)

    def checked(staged: _output.Staged) -> None:
        report.external_data = staged.data_path is not None
        report.output_bytes = staged.size
        if plan.run_checker:
            plan.progress.phase("Checking the output")
            _io.run_checker(staged.onnx_path, "the quantized model")
        plan.progress.phase("Measuring accuracy")
        reference = report.auto.reference if report.auto is not None else None
        if reference is not None:
            assert report.auto is not None
            rows, report.auto.checked = (report.auto.checked or (None, None))[1], None  # once
            result_v = reference.check(plan.src, staged.onnx_path, plan.verify, rows)
        elif run.checked is not None:
            from onnx_conv2matmul.quantize.int8_step import CHECKED_BEFORE

            reference, made_rows = run.checked
            result_v = reference.check(
                plan.src, staged.onnx_path, plan.verify, made_rows, note=CHECKED_BEFORE
            )
        else:
            result_v = verify_models(plan.src, staged.onnx_path, plan.verify)
        result_v.candidate = plan.dst
        report.verification = result_v
        if plan.metric is not None and result_v.passed:
            assert run.original_score is not None
            plan.progress.phase("Scoring the quantized model")
            score = plan.metric.score(staged.onnx_path, "the quantized model")
            report.accuracy["metric"].update(
                score=score,
                drop=plan.metric.drop(run.original_score, score),
                passed=plan.metric.meets(run.original_score, score),
            )

    # Settings chosen from kernel costs: the result is timed only once it passed the check
    # (one that fails is not timed for nothing), and checked again if its level changed.
    timed_after = speed is not None and report.kernel_plan is not None
    if speed is not None and not timed_after:
        staged = timed(staged)
    checked(staged)
    if timed_after and not report.passed and speed is not None:
        from onnx_conv2matmul.quantize.kernel import accurate_level

        level = accurate_level(staged.onnx_path, run.quantize, speed, plan.progress, report.kernel_plan)
        if level is not None:
            below = below_text(report)
            checked(staged)
            if report.passed:
                report.warnings.append(
                    f"accuracy level {run.quantize.accuracy_level}, the cheapest, fell below the"
                    f" accuracy criterion ({below}): level {level} meets it and is kept"
                )
            run.quantize = dataclasses.replace(run.quantize, accuracy_level=level)
            report.options["quantize"] = run.quantize.to_dict()
    if timed_after and report.passed and not plan.timed_by_trade:
        staged = timed(staged)
        if report.kernel_choice is not None:
            checked(staged)
    confirm_held_out(run, staged.onnx_path)
    if report.passed:
        plan.progress.phase("Publishing")
        staged.publish(modes)
        report.output_path = plan.dst


def confirm_held_out(run: Run, path: str) -> None:
    """The result that passed on the inputs it was chosen on, checked on the held-out ones (the
    plan's ``held_out``); the report's ``accuracy.held_out`` says what they gave, and a miss
    fails the run (nothing is written)."""
    plan, report = run.plan, run.report
    if plan.held_out is None or not report.passed:
        return
    plan.progress.phase("Checking the held-out inputs")
    held = verify_models(plan.src, path, plan.held_out)
    entry = report.accuracy["held_out"]
    entry.update(
        passed=held.passed,
        worst_cosine=held.worst_cosine,
        labels=[t.to_dict() for t in held.labels],
    )
    if not held.passed:
        bad = next((r for r in held.results if not r.passed), None)
        moved = next((t for t in held.labels if not t.passed), None)
        if bad is not None:
            what = f"{bad.output}: {bad.note or 'worst cosine ' + format(bad.worst_cosine or 0.0, '.4f')}"
        else:
            what = moved.text() if moved is not None else "the check failed"
        entry["note"] = (
            f"met the criterion on the {entry['chosen_on_samples']} samples it was chosen on, not on the"
            f" {entry['held_out_samples']} held out ({what})"
        )


def speed_step(
    run: Run,
    staged: _output.Staged,
    stack: contextlib.ExitStack,
    timing: TimingOptions | None = None,
    slower: Sequence[str] = (),
) -> _output.Staged:
    """Choose the kernel settings and time the result (see :mod:`onnx_conv2matmul.quantize.kernel`);
    the staged model to check and publish. A candidate meets the accuracy target when it meets
    the output's criterion: every sample's cosine at least ``verify.min_cosine`` (the floor by
    default) and, with ``metric``, a score that dropped by at most its ``max_drop``. ``timing``:
    the inputs the original's latency line was timed on (None: the step chooses them);
    ``slower``: that line's warnings where the result measured slower, whose other accuracy
    levels are then checked and timed at once (the report's latency is that line's when there is
    no level to try)."""
    from onnx_conv2matmul.quantize import kernel

    plan, report = run.plan, run.report
    assert plan.speed is not None
    speed, quantize_options = plan.speed, run.quantize
    if report.auto is not None:
        quantize_options = report.auto.config.quantize_options()
        # The search chose every node's block size: only the accuracy level is left to time.
        speed = dataclasses.replace(speed, block_sizes=(quantize_options.block_size,))
    chosen_by_cost = report.kernel_plan is not None
    tried_levels = speed.levels
    if chosen_by_cost:  # chosen before the quantization: the result is only timed
        speed = dataclasses.replace(
            speed, block_sizes=(quantize_options.block_size,), levels=(quantize_options.accuracy_level,)
        )
    first = kernel.Variant(quantize_options.block_size, staged, None, report.other_weights)
    step = kernel.SpeedStep(
        plan.src,
        plan.convert,
        plan.verify,
        plan.progress,
        output=run.output,
        stack=stack,
        int8=plan.int8,
        metric=plan.metric,
        original_score=run.original_score,
        timed_later=plan.timed_by_trade,
        timing=timing,
    )
    if slower:  # the latency line timed it: not timed again before its other levels
        outcome, first_slower = kernel.SpeedOutcome(first, None, None, None, 1), list(slower)
    else:
        outcome = kernel.run_speed_step(step, first, quantize_options, speed)
        first_slower = outcome.slower()
    if chosen_by_cost and first_slower and len(tried_levels) > 1:
        outcome = kernel.retry_levels(step, outcome, quantize_options, speed, tried_levels)
        if outcome.choice is not None:  # None: nothing became MatMulNBits, no level to try
            report.warnings.append(levels_tried(first_slower[0], outcome.choice))
    if slower and outcome.timing is None:
        report.warnings.extend(slower)  # the latency line stays the report's
    else:
        report.latency = outcome.latency()
        report.warnings.extend(outcome.slower())
    report.kernel_choice = None if outcome.choice is None else outcome.choice.to_dict()
    level = None if outcome.options is None else outcome.options.accuracy_level
    if report.auto is not None and level is not None and level != quantize_options.accuracy_level:
        # The search evaluated another level: its rows are not this model's, which is checked.
        report.auto.checked = None
    if outcome.choice is not None:
        report.warnings.extend(w for w in outcome.choice.warnings if "slower than the original" not in w)
    if outcome.options is not None:
        report.options["quantize"] = outcome.options.to_dict()
    kept = outcome.variant
    if kept.result is not None:  # another block size won: its quantizer's record replaces the first's
        report.matmuls = kept.result.matmuls
        report.quantized_nodes = kept.result.quantized
        report.excluded = kept.result.excluded
        report.settings = kept.result.settings
        report.other_weights = kept.other_weights
    return kept.staged


def publish_made(
    plan: QuantizePlan, output: _output.Output, made: Made, *, kept_default: bool = False
) -> QuantizeReport:
    """Publish the model the trade kept, as made in its scratch folder; its report, now of the output.
    ``kept_default``: ``--auto`` keeps its default candidate (see :func:`level_of_kept_default`)."""
    if kept_default:
        level_of_kept_default(plan, made)
    data = os.path.join(os.path.dirname(made.path), output.data_name)
    modes = _output.file_modes(made.path, [data] if os.path.exists(data) else [])
    plan.progress.phase("Publishing")
    with output.stage_made(made.path) as staged:
        staged.publish(modes)
    report: QuantizeReport = made.report
    report.output_path = plan.dst
    if report.verification is not None:
        report.verification.candidate = plan.dst
    return report


def levels_tried(slower: str, choice: KernelChoice) -> str:
    """The warning of a result measured slower (``slower``) whose other accuracy levels were then
    checked and timed (``choice``)."""
    return (
        f"{slower}: the other accuracy levels were checked and timed, and"
        f" {choice.chosen.candidate.name} kept ({choice.reason})"
    )


SLOWER = "the result is slower than the original"
"""How a latency line's warning that the result measured slower begins (see
:func:`~onnx_conv2matmul.quantize.kernel.slower_of`)."""


def level_of_kept_default(plan: QuantizePlan, made: Made) -> None:
    """``--auto`` kept the default run's model, made as its candidate: without the other accuracy
    levels checked and timed when its latency line measured it slower (the search's model, timed
    on its own levels, is the one usually kept: on the Parakeet-shaped encoder that step of the
    candidate took 41 s of a 190 s run). They are now, as the default run does it, and the fastest
    that meets the criterion, on the check's inputs and the held-out ones, is written into it."""
    from onnx_conv2matmul.quantize import kernel
    from onnx_conv2matmul.speed.choose import (
        accuracy_levels,
        choose_kernel,
        level_candidates,
        reference_accuracy,
        set_accuracy_level,
    )

    report, speed = made.report, plan.speed
    slower = [w for w in report.warnings if w.startswith(SLOWER)]
    if speed is None or not slower or report.kernel_plan is None or not accuracy_levels(made.path):
        return
    current = int(report.options["quantize"]["accuracy_level"])
    order = (current, *(level for level in speed.levels if level != current))
    if len(order) < 2:
        return
    timing = kernel.timing_options(speed, plan.verify, plan.src, short=speed.mode == "shapes")
    plan.progress.phase("Slower than the original: checking the other accuracy levels")
    with level_candidates(made.path, order) as candidates:
        check = reference_accuracy(plan.src, plan.verify)
        floor, gain = plan.verify.min_cosine, speed.min_gain
        choice = choose_kernel(plan.src, candidates, check, min_cosine=floor, timing=timing, min_gain=gain)
    winner = choice.chosen.candidate.accuracy_level
    if winner == current or choice.timing is None:
        return
    set_accuracy_level(made.path, winner, made.path)
    plan.progress.phase("Checking the output at the level kept")
    checks = [verify_models(plan.src, made.path, plan.verify)]
    if plan.held_out is not None and checks[0].passed:
        checks.append(verify_models(plan.src, made.path, plan.held_out))
    if not all(c.passed for c in checks):  # the cosine held, the criterion (labels) did not
        set_accuracy_level(made.path, current, made.path)
        return
    checks[0].candidate = plan.dst
    report.verification = checks[0]
    report.kernel_choice = choice.to_dict()
    report.options["quantize"]["accuracy_level"] = winner
    index = [model.label for model in choice.timing.models].index(choice.chosen.candidate.name)
    report.latency = kernel.latency_of(choice.timing, index)
    report.warnings = [w for w in report.warnings if not w.startswith(SLOWER)]
    report.warnings.append(levels_tried(slower[0], choice))
    report.warnings.extend(kernel.slower_of(choice.timing, index))
