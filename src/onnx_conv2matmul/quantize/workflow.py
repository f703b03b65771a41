"""The quantize workflow: rewrite, quantize with onnxruntime's tools, measure, publish.

Same guarantees as the rewrite: paths are checked before heavy work, everything is
written beside the destination and renamed into place only when every step passed
(including ``--min-cosine``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import resource
import shutil
import time
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import count_op
from onnx_conv2matmul.errors import Hint, InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files.load import check_paths, load_input
from onnx_conv2matmul.files.progress import NullProgress, Progress
from onnx_conv2matmul.quantize.metric import MetricTarget
from onnx_conv2matmul.quantize.nbits import (
    NBitsResult,
    int8_dynamic,
    int8_dynamic_obstacle,
    quantize_matmul_nbits,
    weight_stats,
)
from onnx_conv2matmul.quantize.options import AutoOptions, QuantizeOptions
from onnx_conv2matmul.quantize.phases import PhaseTimer
from onnx_conv2matmul.quantize.report import QuantizeReport as QuantizeReport  # its home before report.py
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.verify.check import (
    VerifyOptions,
    check_feeds_for_graph,
    discover_inputs,
    verify_models,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from onnx_conv2matmul.quantize.options import AutoOptions
    from onnx_conv2matmul.quantize.search import Prepared
    from onnx_conv2matmul.quantize.transposes import TransposeOptions
    from onnx_conv2matmul.quantize.unchanged import Unchanged
    from onnx_conv2matmul.rewrite.report import ConvertReport
    from onnx_conv2matmul.speed.choose import SpeedOptions


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


DEFAULT_MIN_COSINE = 0.99
"""The accuracy floor of ``quantize`` when no criterion is given: the worst sample's cosine
similarity to the fp32 model, on every float output of every feed."""

SYNTHESISED_CAVEAT = (
    "accuracy measured on synthesised inputs, which can overstate it (a trained model can"
    " score well on random inputs and badly on real ones): real inputs of the model give the true figure"
)


def quantize_file(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    convert_options: ConvertOptions | None = None,
    quantize_options: QuantizeOptions | None = None,
    int8: bool = False,
    verify: VerifyOptions | None = None,
    run_checker: bool = True,
    progress: Progress | None = None,
    auto: AutoOptions | None = None,
    speed: SpeedOptions | None = None,
    metric: MetricTarget | None = None,
    search_below: bool | None = None,
    transposes: TransposeOptions | None = None,
) -> QuantizeReport:
    """Rewrite pointwise convs, quantize, compare with the fp32 input, then publish.

    With ``transposes``, when the rewrite would leave pointwise convs because converting them
    adds Transposes, the model is made both without and with them, both are timed against the
    input, and the preference keeps one (see :mod:`onnx_conv2matmul.quantize.transposes`; the
    report's ``transposes`` shows the trade); None, or ``allow_added_transposes`` given, decides
    nothing.

    With ``speed``, the result is timed against the input on this CPU, and when the speed options
    leave several kernel settings (accuracy levels, block sizes) the fastest that meets the
    accuracy criterion below is kept (see :mod:`onnx_conv2matmul.quantize.kernel`); None times
    nothing.

    ``verify`` holds the input synthesis and the pass criterion; its ``feeds`` (real
    inputs), when given, are also the calibration inputs of the ``gptq`` algorithm.
    ``quantize_options.other_weights`` ``int8`` stores the float weights MatMulNBits does
    not take as int8 (see :mod:`onnx_conv2matmul.quantize.other_weights`).

    The output is published only when it meets a criterion: ``verify.min_cosine`` (every
    sample's cosine similarity, see :func:`onnx_conv2matmul.verify.check.sample_cosines`),
    and ``metric`` (the user's score may drop by at most its ``max_drop``); with neither,
    the floor :data:`DEFAULT_MIN_COSINE`. ``verify.report_only`` asks for no cosine
    criterion (measured only). When the model falls below and ``search_below`` is true,
    the search runs with the same criterion (as ``auto`` does) and its model is published
    instead, with a warning; by default that happens when the settings are the defaults
    (``quantize_options`` None, no ``auto``, not ``int8``).

    With ``auto``, the settings are searched for (see :mod:`onnx_conv2matmul.quantize.search`) on
    ``verify``'s inputs (its feeds, or the synthesised ones); the options chosen replace
    ``quantize_options`` (the report's ``options.quantize`` replays them) and the accuracy
    check requires the search's target.

    Raises:
        InputError: also when the algorithm cannot run here (see
            :func:`onnx_conv2matmul.quantize.nbits.quantize_matmul_nbits`), checked before any work.
        ValidationError: the metric's function fails or returns no number.
        TargetUnreachable: with ``auto`` (or a search below the criterion), the target is not
            met even in float.
    """
    started = time.perf_counter()
    asked: dict[str, Any] = {
        "quantize_options": quantize_options,
        "verify": verify,
        "auto": auto,
        "metric": metric,
        "search_below": search_below,
        "run_checker": run_checker,
    }
    defaults = quantize_options is None and auto is None and not int8
    search_below = defaults if search_below is None else search_below
    convert_options = convert_options or ConvertOptions(extended=True, allow_non_unit_dilation=True)
    quantize_options = quantize_options or QuantizeOptions()
    verify = verify or VerifyOptions()
    if auto is not None:
        if int8:
            raise InputError("the search chooses MatMulNBits settings, not int8 dynamic quantization")
        if metric is not None and auto.metric is None:
            auto = dataclasses.replace(auto, metric=metric)
        metric = auto.metric
        if auto.min_cosine is None and verify.min_cosine is not None:
            auto = dataclasses.replace(auto, min_cosine=verify.min_cosine)
    given_cosine = verify.min_cosine is not None or (auto is not None and auto.min_cosine is not None)
    if auto is not None and auto.min_cosine is None and metric is None:
        auto = dataclasses.replace(auto, min_cosine=DEFAULT_MIN_COSINE)
    if auto is not None:
        if auto.min_cosine is not None:
            verify = dataclasses.replace(verify, min_cosine=auto.min_cosine, report_only=False)
        else:
            verify = dataclasses.replace(verify, report_only=True)
    elif verify.min_cosine is None and not verify.report_only:
        if metric is None:
            verify = dataclasses.replace(verify, min_cosine=DEFAULT_MIN_COSINE)
        else:
            verify = dataclasses.replace(verify, report_only=True)
    criterion = _criterion(verify, metric, given=given_cosine)
    progress = phases = PhaseTimer(progress or NullProgress())
    src = os.fspath(input_path)
    dst = check_paths(src, os.fspath(output_path), inplace=False)
    if not int8:
        _check_quantize_options(quantize_options, verify)
    # Once: the check, the search and the latency step all feed these sizes and values.
    verify = discover_inputs(src, verify)
    if verify.feeds is not None:
        # The latency step still synthesises its inputs: at the sizes the model takes.
        found = discover_inputs(src, dataclasses.replace(verify, feeds=None))
        verify = dataclasses.replace(verify, axes=found.axes)
    report = _new_report(src, int8, convert_options, quantize_options, auto, criterion, speed)
    trade = None
    try:
        with _output.Output(dst, source=src) as output:
            if transposes is not None and not int8 and not convert_options.allow_added_transposes:
                from onnx_conv2matmul.quantize.transposes import weigh

                with output.scratch("transposes") as scratch:
                    convert_options, trade = weigh(
                        src,
                        scratch,
                        convert_options,
                        transposes,
                        speed,
                        verify,
                        progress.phase,
                        lambda rewrite, path: quantize_file(src, path, convert_options=rewrite, **asked),
                    )
                report = _new_report(src, int8, convert_options, quantize_options, auto, criterion, speed)
                report.transposes = trade
            refuse = None
            if trade is not None and trade.chosen.with_transposes and transposes is not None:
                from onnx_conv2matmul.quantize.transposes import within_margin

                refuse = within_margin(src, trade, transposes)
            _quantize_to(
                src,
                output,
                convert_options,
                quantize_options,
                int8,
                verify,
                run_checker,
                progress,
                report,
                auto,
                speed,
                metric,
                refuse,
            )
            if not report.passed and search_below and not int8:
                first = report
                below = _below_text(first)
                progress.phase("Below the accuracy criterion: searching")
                auto = AutoOptions(
                    min_cosine=None if verify.report_only else verify.min_cosine,
                    metric=metric,
                    accuracy_level=quantize_options.accuracy_level,
                    exclude=quantize_options.exclude,
                    include=quantize_options.include,
                )
                report = _new_report(src, int8, convert_options, quantize_options, auto, criterion, speed)
                report.transposes = trade
                report.accuracy["fallback"] = {
                    "reason": below,
                    "settings": first.options["quantize"],
                    "worst_cosine": _worst_cosine(first),
                    "score": (first.accuracy.get("metric") or {}).get("score"),
                }
                report.warnings.append(
                    f"the settings asked for fell below the accuracy criterion ({below}): the search"
                    " chose per-node settings that meet it instead"
                )
                _quantize_to(
                    src,
                    output,
                    convert_options,
                    quantize_options,
                    int8,
                    verify,
                    run_checker,
                    progress,
                    report,
                    auto,
                    speed,
                    metric,
                    refuse,
                )
    finally:
        progress.close()
    if trade is not None and report.refused_ratio is not None:
        # The model with the Transposes, timed again as written, was slower than the margin
        # allows: nothing was published, and the model without them is made and written instead.
        from onnx_conv2matmul.quantize.transposes import refused

        trade = refused(trade, report.refused_ratio)
        without = dataclasses.replace(convert_options, allow_added_transposes=False)
        report = quantize_file(src, dst, convert_options=without, speed=speed, **asked)
        report.transposes = trade
    if report.unchanged is not None and report.transposes is not None:
        from onnx_conv2matmul.quantize.unchanged import with_trade

        report.unchanged = with_trade(report.unchanged, report.transposes.reason)
    report.seconds = time.perf_counter() - started
    report.seconds_by_phase = phases.by_phase()
    report.peak_rss_bytes = _peak_rss_bytes()
    return report


def _criterion(verify: VerifyOptions, metric: MetricTarget | None, *, given: bool) -> dict[str, Any]:
    """The report's ``accuracy`` object before any measurement: what the output must meet."""
    if verify.report_only:
        cosine_kind = None
    elif verify.min_cosine is None:
        cosine_kind = "exact"
    else:
        cosine_kind = "given" if given else "default floor"
    return {
        "min_cosine": None if verify.report_only else verify.min_cosine,
        "min_cosine_source": cosine_kind,
        "per_sample": True,
        "inputs": "synthesised" if verify.feeds is None else "files",
        "caveat": SYNTHESISED_CAVEAT if verify.feeds is None else None,
        "metric": None if metric is None else {**metric.to_dict(), "original_score": None, "score": None},
        "fallback": None,
    }


def _new_report(
    src: str,
    int8: bool,
    convert_options: ConvertOptions,
    quantize_options: QuantizeOptions,
    auto: AutoOptions | None,
    criterion: dict[str, Any],
    speed: SpeedOptions | None,
) -> QuantizeReport:
    auto_options = None
    if auto is not None:
        auto_options = {
            "min_cosine": auto.min_cosine,
            "max_evaluations": auto.max_evaluations,
            "metric": None if auto.metric is None else auto.metric.to_dict(),
        }
    return QuantizeReport(
        mode="int8_dynamic" if int8 else "matmul_nbits",
        input_path=src,
        options={
            "rewrite": convert_options.to_dict(),
            "quantize": {"int8_dynamic": True} if int8 else quantize_options.to_dict(),
            "auto": auto_options,
            "speed": None if speed is None else speed.to_dict(),
        },
        accuracy=copy.deepcopy(criterion),
    )


def _worst_cosine(report: QuantizeReport) -> float | None:
    rows = report.verification.results if report.verification is not None else []
    cosines = [c for c in (r.worst_cosine for r in rows) if c is not None]
    return min(cosines) if cosines else None


def _below_text(report: QuantizeReport) -> str:
    """What the failed check measured, in a few words."""
    parts = []
    worst = _worst_cosine(report)
    verification = report.verification
    if verification is not None and not verification.passed:
        if verification.options.min_cosine is not None and worst is not None:
            parts.append(f"worst cosine {worst:.4f} < {verification.options.min_cosine:g}")
        else:
            parts.append("outputs that must match differ")
    found = report.accuracy.get("metric") or {}
    if found.get("passed") is False:
        parts.append(f"score {found['score']:.6g} against the original's {found['original_score']:.6g}")
    return "; ".join(parts) or "the check failed"


def _quantize_to(
    src: str,
    output: _output.Output,
    convert_options: ConvertOptions,
    quantize_options: QuantizeOptions,
    int8: bool,
    verify: VerifyOptions,
    run_checker: bool,
    progress: Progress,
    report: QuantizeReport,
    auto: AutoOptions | None = None,
    speed: SpeedOptions | None = None,
    metric: MetricTarget | None = None,
    refuse: Callable[[str], float | None] | None = None,
) -> None:
    dst = output.path
    loaded = load_input(src, dst, inplace=False, run_checker=run_checker, progress=progress, timings={})
    output.protect(loaded.external_files)
    modes = _output.file_modes(loaded.path, loaded.external_files)
    report.input_bytes = loaded.total_bytes
    model = loaded.model
    if verify.feeds is not None:
        # Before the quantization (gptq runs them), not only when the accuracy check does.
        check_feeds_for_graph(model.graph.inputs, verify.feeds)
    if int8:
        _check_int8_dynamic(model)
    original_score = None
    if metric is not None:
        progress.phase("Scoring the original model")
        original_score = metric.score(src, "the original model")
        report.accuracy["metric"] = {**metric.to_dict(), "original_score": original_score, "score": None}
    report.weights_without_rewrite = weight_stats(model)
    progress.phase("Rewriting")
    rewrite = rewrite_model(model, convert_options)
    report.rewrite = rewrite.totals()
    report.weights_with_rewrite = weight_stats(model)
    if speed is not None and speed.mode == "shapes" and speed.chooses and not int8:
        from onnx_conv2matmul.quantize import kernel

        progress.phase("Kernel choice: timing each weight shape")
        report.kernel_plan = kernel.plan_kernels(src, model, quantize_options, speed, verify)
        quantize_options = report.kernel_plan.options
        report.options["quantize"] = quantize_options.to_dict()
        if auto is not None and len(speed.levels) > 1:
            auto = dataclasses.replace(auto, accuracy_level=quantize_options.accuracy_level)
    external = loaded.has_external_data or _io.tensor_bytes(model) > _io.SINGLE_FILE_LIMIT_BYTES
    with contextlib.ExitStack() as searching:  # the search's scratch lives until the output's check
        if int8:
            staged = _int8_staged(model, output, external, quantize_options, progress, report)
        else:
            if auto is not None:
                from onnx_conv2matmul.quantize import search as auto_search

                workdir = searching.enter_context(output.scratch("auto"))
                searching.callback(_drop_reference, report)
                prepared = auto_search.prepare(model, auto, workdir, progress.phase)
                if external:
                    # The copy stands for the rewritten model from here on (memory-mapped): the
                    # weights the rewrite made in memory go before the fp32 model runs.
                    del model
                    loaded.model = None  # type: ignore[assignment]
                speed_filter = None
                if report.kernel_plan is not None and speed is not None:
                    speed_filter = report.kernel_plan.speed_filter(auto.accuracy_level, speed.margin)
                _search(src, workdir, prepared, auto, verify, progress, report, original_score, speed_filter)
                if external:
                    model = prepared.load()
                assert report.auto is not None
                quantize_options = report.auto.config.quantize_options()
                report.options["quantize"] = quantize_options.to_dict()
            progress.phase("Quantizing")
            with contextlib.ExitStack() as stack:
                # gptq runs the model to capture its activations: from a copy in a scratch directory.
                gptq = quantize_options.algorithm == "gptq"
                scratch = stack.enter_context(output.scratch("gptq")) if gptq else None
                cache = report.auto.cache if report.auto is not None else None
                result = quantize_matmul_nbits(
                    model, quantize_options, feeds=verify.feeds, scratch_dir=scratch, cache=cache
                )
            report.matmuls = result.matmuls
            report.quantized_nodes = result.quantized
            report.excluded = result.excluded
            report.settings = result.settings
            report.unchanged = _why_unchanged(rewrite, report, result, quantize_options, verify)
            report.warnings.extend(_nbits_warnings(result, quantize_options))
            if quantize_options.other_weights == "int8":
                from onnx_conv2matmul.quantize.other_weights import quantize_other_weights

                report.other_weights = quantize_other_weights(model)
            progress.phase("Saving")
            staged = output.stage(model, external=external, progress=progress.advance)
        with contextlib.ExitStack() as stack:  # at once: any error or interrupt removes what is staged
            stack.enter_context(staged)
            del model, loaded
            report.peak_rss_quantize_bytes = _peak_rss_bytes()

            def timed(staged: _output.Staged) -> _output.Staged:
                assert speed is not None
                return _speed_step(
                    src,
                    staged,
                    stack,
                    output,
                    convert_options,
                    quantize_options,
                    int8,
                    verify,
                    speed,
                    progress,
                    report,
                    metric,
                    original_score,
                )

            def checked(staged: _output.Staged) -> None:
                report.external_data = staged.data_path is not None
                report.output_bytes = staged.size
                if run_checker:
                    progress.phase("Checking the output")
                    _io.run_checker(staged.onnx_path, "the quantized model")
                progress.phase("Measuring accuracy")
                reference = report.auto.reference if report.auto is not None else None
                if reference is not None:
                    result_v = reference.check(src, staged.onnx_path, verify)
                else:
                    result_v = verify_models(src, staged.onnx_path, verify)
                result_v.candidate = dst
                report.verification = result_v
                if metric is not None and result_v.passed:
                    assert original_score is not None
                    progress.phase("Scoring the quantized model")
                    score = metric.score(staged.onnx_path, "the quantized model")
                    report.accuracy["metric"].update(
                        score=score,
                        drop=metric.drop(original_score, score),
                        passed=metric.meets(original_score, score),
                    )

            # Settings chosen from kernel costs: the result is timed only once it passed the check
            # (one that fails is not timed for nothing), and checked again if its level changed.
            timed_after = speed is not None and report.kernel_plan is not None
            if speed is not None and not timed_after:
                staged = timed(staged)
            checked(staged)
            if timed_after and not report.passed and speed is not None:
                from onnx_conv2matmul.quantize.kernel import accurate_level

                level = accurate_level(staged.onnx_path, quantize_options, speed, progress)
                if level is not None:
                    below = _below_text(report)
                    checked(staged)
                    if report.passed:
                        report.warnings.append(
                            f"accuracy level {quantize_options.accuracy_level}, the cheapest, fell below the"
                            f" accuracy criterion ({below}): level {level} meets it and is kept"
                        )
                    quantize_options = dataclasses.replace(quantize_options, accuracy_level=level)
                    report.options["quantize"] = quantize_options.to_dict()
            if timed_after and report.passed:
                staged = timed(staged)
                if report.kernel_choice is not None:
                    checked(staged)
            if report.passed and refuse is not None:
                progress.phase("Timing the model with the Transposes as written")
                report.refused_ratio = refuse(staged.onnx_path)
            if report.passed and report.refused_ratio is None:
                progress.phase("Publishing")
                staged.publish(modes)
                report.output_path = dst


def _drop_reference(report: QuantizeReport) -> None:
    """The search's reference files go with its scratch directory: the report keeps none."""
    if report.auto is not None:
        report.auto.reference = report.auto.cache = None


def _speed_step(
    src: str,
    staged: _output.Staged,
    stack: contextlib.ExitStack,
    output: _output.Output,
    convert_options: ConvertOptions,
    quantize_options: QuantizeOptions,
    int8: bool,
    verify: VerifyOptions,
    speed: SpeedOptions,
    progress: Progress,
    report: QuantizeReport,
    metric: MetricTarget | None,
    original_score: float | None,
) -> _output.Staged:
    """Choose the kernel settings and time the result (see :mod:`onnx_conv2matmul.quantize.kernel`);
    the staged model to check and publish. A candidate meets the accuracy target when it meets
    the output's criterion: every sample's cosine at least ``verify.min_cosine`` (the floor by
    default) and, with ``metric``, a score that dropped by at most its ``max_drop``."""
    from onnx_conv2matmul.quantize import kernel

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
    outcome = kernel.run_speed_step(
        src,
        first,
        quantize_options,
        speed,
        stack=stack,
        output=output,
        convert_options=convert_options,
        verify=verify,
        progress=progress,
        int8=int8,
        metric=metric,
        original_score=original_score,
    )
    if chosen_by_cost and outcome.slower() and len(tried_levels) > 1:
        first_slower = outcome.slower()
        outcome = kernel.retry_levels(
            src,
            outcome,
            quantize_options,
            speed,
            tried_levels,
            verify=verify,
            progress=progress,
            metric=metric,
            original_score=original_score,
        )
        if outcome.choice is not None:  # None: nothing became MatMulNBits, no level to try
            report.warnings.append(
                f"{first_slower[0]}: the other accuracy levels were checked and timed, and"
                f" {outcome.choice.chosen.candidate.name} kept ({outcome.choice.reason})"
            )
    report.latency = outcome.latency()
    report.kernel_choice = None if outcome.choice is None else outcome.choice.to_dict()
    report.warnings.extend(outcome.slower())
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


def _search(
    src: str,
    workdir: str,
    model: ir.Model | Prepared,
    auto: AutoOptions,
    verify: VerifyOptions,
    progress: Progress,
    report: QuantizeReport,
    original_score: float | None,
    speed_filter: Any = None,
) -> None:
    """Run the search on the inputs the accuracy check uses (given or synthesised), in
    ``workdir`` (a scratch directory beside the output, under its guard: see
    :meth:`_output.Output.scratch`)."""
    from onnx_conv2matmul.quantize import search as auto_search
    from onnx_conv2matmul.quantize.reference import feed_set

    if verify.feeds is None:
        progress.phase("Synthesising inputs")
    feeds = feed_set(src, verify)
    report.auto = auto_search.search(
        model,
        feeds,
        auto,
        workdir,
        deterministic=verify.deterministic,
        progress=progress.phase,
        original_score=original_score,
        memory=verify.memory,
        speed_filter=speed_filter,
    )


def _check_quantize_options(options: QuantizeOptions, verify: VerifyOptions) -> None:
    """Refuse, before any work, settings this run cannot apply."""
    from onnx_conv2matmul.quantize.weight_only import check_available

    check_available(options.algorithm, has_calibration=bool(verify.feeds))


def _why_unchanged(
    rewrite: ConvertReport,
    report: QuantizeReport,
    result: NBitsResult,
    options: QuantizeOptions,
    verify: VerifyOptions,
) -> Unchanged | None:
    """Why nothing was quantized (see :mod:`onnx_conv2matmul.quantize.unchanged`)."""
    from onnx_conv2matmul.quantize.unchanged import why_unchanged

    assert report.weights_without_rewrite is not None and report.weights_with_rewrite is not None
    return why_unchanged(
        rewrite.entries,
        report.weights_without_rewrite,
        report.weights_with_rewrite,
        result,
        options,
        searched=report.auto is not None,
        min_cosine=verify.min_cosine,
    )


def _nbits_warnings(result: NBitsResult, options: QuantizeOptions) -> list[str]:
    warnings = []
    if result.quantized == 0 and (options.include or options.exclude) and not options.nodes:
        warnings.append(
            "no MatMul was quantized: check the include and exclude patterns against the node names"
        )
    if result.unknown_nodes:
        names = ", ".join(repr(n) for n in result.unknown_nodes[:5])
        more = f" and {len(result.unknown_nodes) - 5} more" if len(result.unknown_nodes) > 5 else ""
        warnings.append(f"per-node settings name no quantizable MatMul: {names}{more}")
    if result.unmatched_patterns:
        patterns = ", ".join(repr(p) for p in result.unmatched_patterns)
        warnings.append(f"patterns that match no quantizable MatMul: {patterns}")
    reasons: dict[str, list[str]] = {}
    for name, why in result.not_quantized:
        reasons.setdefault(why, []).append(name)
    for why, left in reasons.items():
        warnings.append(f"{len(left)} MatMul(s) left in float ({why}): {', '.join(left[:5])}")
    return warnings


def _check_int8_dynamic(model: ir.Model) -> None:
    """Refuse, before the rewrite, a model ``quantize_dynamic`` would turn into one that does not load."""
    obstacle = int8_dynamic_obstacle(model)
    if obstacle is not None:
        raise InputError(
            f"int8 dynamic quantization needs a float32 model: {obstacle}"
            " (onnxruntime's quantize_dynamic takes float32 only)",
            hint=Hint.NOT_INT8_DYNAMIC,
        )


def _int8_staged(
    model: ir.Model,
    output: _output.Output,
    external: bool,
    quantize_options: QuantizeOptions,
    progress: Progress,
    report: QuantizeReport,
) -> _output.Staged:
    """Save the rewritten fp32 model aside, run ``quantize_dynamic`` into a staged output.

    onnxruntime names the data file after the ``.onnx`` it writes, so the staged
    ``.onnx`` is named for the data file to get the destination's data-file name.
    """

    def write(directory: str) -> str:
        progress.phase("Saving the rewritten model")
        fp32_dir = os.path.join(directory, "fp32")
        os.mkdir(fp32_dir)
        fp32_path = os.path.join(fp32_dir, "model.onnx")
        _output.save(model, fp32_path, "model.onnx.data" if external else None)
        progress.phase("Quantizing (int8 dynamic)")
        name = output.data_name.removesuffix(".data") if external else os.path.basename(output.path)
        out = os.path.join(directory, name)
        int8_dynamic(model, fp32_path, out, quantize_options, external_data=external)
        shutil.rmtree(fp32_dir)
        _restore_model_fields(out, model)
        quantized = ir.load(out)
        report.matmuls = count_op(model, "MatMul")
        report.quantized_nodes = sum(
            count_op(quantized, op) for op in ("MatMulInteger", "DynamicQuantizeLSTM", "ConvInteger")
        )
        return out

    return output.stage_with(write)


def _restore_model_fields(path: str, model: ir.Model) -> None:
    """Give the model at ``path`` the producer, doc string and metadata of ``model``.

    ``quantize_dynamic`` names itself the producer and adds its own metadata entry;
    loaders such as sherpa-onnx read their settings from the input's metadata. Only the
    ``.onnx`` file is rewritten: its external data stays where it is.
    """
    import onnx

    proto = onnx.load(path, load_external_data=False)
    proto.producer_name = model.producer_name or ""
    proto.producer_version = model.producer_version or ""
    proto.doc_string = model.doc_string or ""
    del proto.metadata_props[:]
    for key, value in model.metadata_props.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save_model(proto, path)
