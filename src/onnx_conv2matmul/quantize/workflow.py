"""The quantize workflow: rewrite, quantize with onnxruntime's tools, measure, publish.

Same guarantees as the rewrite: paths are checked before heavy work, everything is
written beside the destination and renamed into place only when every step passed
(including ``--min-cosine``). What the caller gave is resolved once into a
:class:`~onnx_conv2matmul.quantize.plan.QuantizePlan`, which every step reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import TYPE_CHECKING

from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files.load import LoadedModel, load_input
from onnx_conv2matmul.quantize import onepass
from onnx_conv2matmul.quantize.check_publish import check_and_publish, publish_made
from onnx_conv2matmul.quantize.inspection import weight_kinds
from onnx_conv2matmul.quantize.int8_step import check_int8_dynamic, int8_staged
from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits
from onnx_conv2matmul.quantize.plan import QuantizePlan, Request, Run, peak_rss_bytes, resolve, wants_smallest
from onnx_conv2matmul.quantize.projection import weight_stats
from onnx_conv2matmul.quantize.report import QuantizeReport as QuantizeReport  # its home before report.py
from onnx_conv2matmul.quantize.run_report import (
    KeptOpen,
    below_text,
    coverage_of,
    nbits_warnings,
    new_report,
    record_step,
    step_back_cosine,
    why_unchanged,
    worst_cosine,
)
from onnx_conv2matmul.quantize.search_options import AutoOptions
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.verify.check import check_feeds_for_graph

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

    import onnx_ir as ir

    from onnx_conv2matmul.quantize.trade import TransposeTrade
    from onnx_conv2matmul.quantize.transposes import Made
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.rewrite.report import ConvertReport
    from onnx_conv2matmul.verify.labels import TaskResult


def quantize_file(
    input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], request: Request | None = None
) -> QuantizeReport:
    """Rewrite pointwise convs, quantize, compare with the fp32 input, then publish.

    ``request`` holds what :func:`onnx_conv2matmul.api.quantize_file` was given; it is resolved
    once (:func:`onnx_conv2matmul.quantize.plan.resolve`: the defaults, the accuracy criterion,
    the inputs) into the plan every step reads.

    With ``transposes``, when the rewrite would leave pointwise convs because converting them
    adds Transposes, the model is made both without and with them, both are timed against the
    input, and the preference keeps one (see :mod:`onnx_conv2matmul.quantize.transposes`; the
    report's ``transposes`` shows the trade); None, or ``allow_added_transposes`` given, decides
    nothing.

    With ``speed``, the result is timed against the input on this CPU, and when the speed options
    leave several kernel settings (accuracy levels, block sizes) the fastest that meets the
    accuracy criterion is kept (see :mod:`onnx_conv2matmul.quantize.kernel`); None times nothing.

    ``verify`` holds the input synthesis and the pass criterion; its ``feeds`` (real inputs), when given,
    are also the calibration inputs of the ``gptq`` algorithm. ``quantize.other_weights`` ``int8`` stores
    the float weights MatMulNBits does not take as int8 (see :mod:`~.other_weights`).

    The output is published only when it meets the plan's criterion. When the model falls below
    and ``search_below`` is true, the search runs with the same criterion (as ``auto`` does) and
    its model is published instead, with a warning.

    With ``auto``, the settings are searched for (see :mod:`onnx_conv2matmul.quantize.search`) on
    ``verify``'s inputs (its feeds, or the synthesised ones); the options chosen replace
    ``quantize`` (the report's ``options.quantize`` replays them) and the accuracy
    check requires the search's target.

    Raises:
        InputError: also when the algorithm cannot run here (see
            :func:`onnx_conv2matmul.quantize.nbits.quantize_matmul_nbits`), checked before any work.
        ValidationError: the metric's function fails or returns no number.
        TargetUnreachable: with ``auto`` (or a search below the criterion), the target is not
            met even in float.
    """
    started = time.perf_counter()
    request = request or Request()
    progress, top = request.progress, not (request.candidate or request.nested)
    if top and progress is not None:  # one progress for every attempt, closed once
        request = dataclasses.replace(request, progress=KeptOpen(progress))
    if top:
        request = request.with_memos()
    try:
        if top:
            report = _stepping_back(input_path, output_path, request)
        else:
            report, _ = _quantize_once(input_path, output_path, request)
    finally:
        if top and progress is not None:
            progress.close()
    report.seconds = time.perf_counter() - started
    return report


def _stepping_back(
    input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], request: Request
) -> QuantizeReport:
    """One run of ``request``, and while its result misses on the held-out samples, the run again
    with the stricter minimum cosine the miss asks for (see :func:`~.run_report.step_back_cosine`)."""
    from onnx_conv2matmul.errors import ModeRefused, TargetUnreachable

    report, plan = _quantize_once(input_path, output_path, request)
    by_phase = dict(report.seconds_by_phase)
    while plan.chooses and (cosine := step_back_cosine(report)) is not None:
        missed = report
        try:
            again = dataclasses.replace(request, step_back=cosine)
            report, plan = _quantize_once(input_path, output_path, again)
        except (TargetUnreachable, ModeRefused):  # nothing stricter to step back to
            report = missed
            break
        for phase, seconds in report.seconds_by_phase.items():
            by_phase[phase] = round(by_phase.get(phase, 0.0) + seconds, 3)
        record_step(report, missed)
    report.seconds_by_phase = by_phase
    return report


def _quantize_once(
    input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], request: Request
) -> tuple[QuantizeReport, QuantizePlan]:
    """One run of ``request`` (see :func:`quantize_file`), without the step backs; its report and plan."""
    started = time.perf_counter()
    plan = resolve(input_path, output_path, request)
    report = new_report(plan)
    try:
        with _output.Output(plan.dst, source=plan.src) as output:
            made = None
            if _weighs_default(plan):
                with output.scratch("candidates") as scratch:
                    report = _auto_or_default(plan, output, scratch)
            elif plan.transposes is not None and not plan.int8 and not plan.convert.allow_added_transposes:
                with output.scratch("transposes") as scratch:
                    plan, trade, made = _weigh(plan, scratch)
                    if made is not None and made.path:  # published as it was made, sized and timed
                        report = publish_made(plan, output, made)
                    elif made is not None:  # a candidate missed, or it missed on the held-out samples
                        report = made.report
                    report.transposes = trade
            if made is None and not _weighs_default(plan):
                transposes = report.transposes
                report = new_report(plan)
                report.transposes = transposes
                _quantize_to(Run(plan, output, report))
                # A held-out miss is not searched again at the same target: the step back aims higher.
                below = not report.passed and not report.held_out_missed
                if below and plan.search_below and not plan.int8 and not plan.request.candidate:
                    report = _search_below(plan, output, report)
    finally:
        plan.progress.close()
    if report.unchanged is not None and report.transposes is not None:
        from onnx_conv2matmul.quantize.unchanged import with_trade

        report.unchanged = with_trade(report.unchanged, report.transposes)
    report.seconds = time.perf_counter() - started
    report.seconds_by_phase = plan.progress.by_phase()
    report.peak_rss_bytes = peak_rss_bytes()
    return report, plan


def _weighs_default(plan: QuantizePlan) -> bool:
    """Whether this ``--auto`` run weighs its search's model against the default run's: a cosine
    criterion (a metric is the user's to weigh), MatMulNBits by the default algorithm, and not a
    candidate of another run."""
    auto = plan.auto
    return (
        auto is not None
        and auto.metric is None
        and plan.verify.min_cosine is not None
        and plan.quantize.algorithm == "default"
        and not plan.request.candidate
    )


def _auto_or_default(plan: QuantizePlan, output: _output.Output, scratch: str) -> QuantizeReport:
    """``--auto`` is never bigger than the default: the default run's model (the one pass, no
    search below it) and the search's, each made in ``scratch``; the smaller that meets the
    criterion is published as it was made (the search's on a tie), with a warning when it is the
    default's."""
    from onnx_conv2matmul.errors import TargetUnreachable
    from onnx_conv2matmul.files.paths import model_file_bytes
    from onnx_conv2matmul.quantize.search import NothingSmaller
    from onnx_conv2matmul.quantize.transposes import Made, search_both

    name = os.path.basename(plan.dst)
    request = plan.request
    # The criterion's cosine (a step back's stricter one is the request's, and applies again).
    verify = dataclasses.replace(request.verify or plan.verify, min_cosine=plan.criterion["min_cosine"])
    made: dict[str, Made] = {}
    for folder in ("default", "auto"):
        os.makedirs(os.path.join(scratch, folder), exist_ok=True)
    plan.progress.phase("Quantizing with the default settings (a candidate of --auto)")
    default_request = dataclasses.replace(
        request, auto=None, verify=verify, metric=None, progress=None, candidate=True, search_below=True
    )
    # The default run as a user gets it: stepped back when its result misses on the held-out samples.
    default = _stepping_back(plan.src, os.path.join(scratch, "default", name), default_request)
    if default.output_path is not None:
        made["default"] = Made(default.output_path, default)
        hopeless = _unpromisable(default)
        if hopeless is not None:
            # A smaller model of the search would not be kept (see below): not searched for.
            report = publish_made(plan, output, made["default"], kept_default=True)
            report.warnings.append(
                f"--auto did not search below the default run's model: {hopeless}, so a smaller"
                " model could not be kept (more samples, or --criterion cosine, let --auto search)"
            )
            return report
    plan.progress.phase("Searching for the smallest settings that meet the criterion (--auto)")
    search_request = dataclasses.replace(request, progress=None, candidate=True)
    trade = default.transposes
    one_layout = "default" in made and (trade is None or not search_both(trade))
    beat = None
    if one_layout:
        # A model of the search bigger than the default run's is neither checked nor timed for
        # nothing (not when the search weighs both layouts: each would be made again).
        beat = model_file_bytes(made["default"].path)
        search_request = dataclasses.replace(search_request, larger_than=beat)
    if trade is not None and one_layout:
        # The layout of the convs that add Transposes was weighed by the default run's models:
        # the search runs on the one kept, not once per layout.
        convert = dataclasses.replace(plan.convert, allow_added_transposes=trade.chosen.with_transposes)
        search_request = dataclasses.replace(search_request, convert=convert, transposes=None)
    nothing_smaller = ""
    try:
        searched = quantize_file(plan.src, os.path.join(scratch, "auto", name), search_request)
    except TargetUnreachable as err:
        if "default" not in made:
            raise
        searched = None
        nothing_smaller = str(err) if isinstance(err, NothingSmaller) else ""
    if searched is not None and searched.output_path is not None:
        made["auto"] = Made(searched.output_path, searched)
    if not made:
        assert searched is not None
        return searched
    sizes = {key: model_file_bytes(m.path) for key, m in made.items()}
    kept = "auto" if "auto" in made and sizes["auto"] <= sizes.get("default", sizes["auto"]) else "default"
    short = _unpromised(searched) if kept == "auto" and sizes["auto"] < sizes.get("default", 0) else None
    if short is not None:
        kept = "default"
    report = publish_made(plan, output, made[kept], kept_default=kept == "default")
    if report.transposes is None:
        report.transposes = trade  # the layouts weighed by the default run's models
    if short is not None:
        report.warnings.append(
            f"the search's model ({sizes['auto']} bytes) is smaller than the default run's"
            f" ({sizes['default']} bytes), but {short}: the default run's model is kept (more"
            " samples, or --criterion cosine, let --auto go below it)"
        )
    elif kept == "default":
        found = f"{sizes['auto']} bytes" if "auto" in sizes else "no model that meets it"
        if nothing_smaller:
            found = f"no smaller model that meets it: {nothing_smaller}"
        if searched is not None and searched.verification is None and beat and searched.output_bytes > beat:
            found = f"{searched.output_bytes} bytes, neither checked nor timed"
        report.warnings.append(
            f"the default run's model ({sizes['default']} bytes) meets the criterion and is smaller than"
            f" what the search found ({found}): it is kept"
        )
    return report


def _unpromisable(default: QuantizeReport) -> str | None:
    """Why the default run's held-out samples (the search's too) could promise no model's labels
    (:func:`onnx_conv2matmul.verify.labels.unpromisable`); None when they could, or without any."""
    from onnx_conv2matmul.verify.labels import unpromisable

    return _held_out_labels(default, unpromisable)


def _unpromised(searched: QuantizeReport | None) -> str | None:
    """Why the search's held-out samples do not promise its labels beyond the samples it saw
    (see :func:`onnx_conv2matmul.verify.labels.unpromised`); None when they do, or when the run
    has no inputs of the user's to hold out (its criterion is the cosine on synthesised ones)."""
    from onnx_conv2matmul.verify.labels import unpromised

    return None if searched is None else _held_out_labels(searched, unpromised)


def _held_out_labels(
    report: QuantizeReport, judge: Callable[[Sequence[TaskResult], Sequence[Mapping[str, Any]]], str | None]
) -> str | None:
    """``judge`` of the report's labels (judged on the samples its model was chosen on) and its
    held-out samples' labels; None without held-out samples or a check."""
    held = report.accuracy.get("held_out")
    if held is None or report.verification is None:
        return None
    return judge(report.verification.labels, held.get("labels") or [])


def _weigh(plan: QuantizePlan, scratch: str) -> tuple[QuantizePlan, TransposeTrade | None, Made | None]:
    """The rewrite the Transposes' trade keeps (see :func:`onnx_conv2matmul.quantize.transposes.weigh`)
    and the model kept as it was made (None: not made); both models are made as this run was
    asked (the speed step included), each in a folder of ``scratch`` under the output's name."""
    from onnx_conv2matmul.quantize.transposes import Made, weigh

    assert plan.transposes is not None
    name = os.path.basename(plan.dst)

    shared = onepass.Shared(os.path.join(scratch, "reference"))  # the original, measured once
    reports: dict[bool, QuantizeReport] = {}

    def make(rewrite: ConvertOptions, folder: str, search: bool | None) -> QuantizeReport:
        again = plan.request.again(rewrite, speed=plan.speed, shared=shared, search=search)
        reports[rewrite.allow_added_transposes] = quantize_file(plan.src, os.path.join(folder, name), again)
        return reports[rewrite.allow_added_transposes]

    convert, trade, made = weigh(plan, scratch, make)
    plan = dataclasses.replace(plan, convert=convert)
    if made is None and trade is not None and plan.request.candidate:
        # A candidate's layouts missed (or were not made again): the one kept is not made a third time.
        made = Made("", reports.get(trade.chosen.with_transposes) or new_report(plan))
    return plan, trade, made


def _search_below(
    plan: QuantizePlan,
    output: _output.Output,
    first: QuantizeReport,
) -> QuantizeReport:
    """The settings asked for fell below the criterion: the search's model, with the same
    criterion, into the same output."""
    below = below_text(first)
    plan.progress.phase("Below the accuracy criterion: searching")
    plan = dataclasses.replace(plan, auto=_floor_search(plan))
    report = new_report(plan)
    report.transposes = first.transposes
    report.accuracy["fallback"] = {
        "reason": below,
        "settings": first.options["quantize"],
        "worst_cosine": worst_cosine(first),
        "score": (first.accuracy.get("metric") or {}).get("score"),
    }
    report.warnings.append(
        f"the settings asked for fell below the accuracy criterion ({below}): the search"
        " chose per-node settings that meet it instead"
    )
    _quantize_to(Run(plan, output, report))
    return report


def _floor_search(plan: QuantizePlan) -> AutoOptions:
    """The search a run below its criterion falls back to: the same criterion, as ``--auto``."""
    return AutoOptions(
        min_cosine=None if plan.verify.report_only else plan.verify.min_cosine,
        metric=plan.metric,
        accuracy_level=plan.quantize.accuracy_level,
        exclude=plan.quantize.exclude,
        include=plan.quantize.include,
        speed_aware=not wants_smallest(plan.request),
    )


def _quantize_to(run: Run) -> None:
    """Quantize the plan's input into ``run.output``: staged, checked, timed, and published when
    it meets the criterion (``run.report`` says what happened)."""
    plan, report = run.plan, run.report
    loaded = load_input(
        plan.src, plan.dst, inplace=False, run_checker=plan.run_checker, progress=plan.progress, timings={}
    )
    run.output.protect(loaded.external_files)
    if loaded.linked_note and loaded.linked_note not in report.warnings:
        report.warnings.append(loaded.linked_note)
    modes = _output.file_modes(loaded.path, loaded.external_files)
    report.input_bytes = loaded.total_bytes
    if plan.verify.feeds is not None:
        # Before the quantization (gptq runs them), not only when the accuracy check does.
        check_feeds_for_graph(loaded.model.graph.inputs, plan.verify.feeds)
    if plan.int8:
        check_int8_dynamic(loaded.model)
    if plan.metric is not None:
        plan.progress.phase("Scoring the original model")
        run.original_score = plan.metric.score(plan.src, "the original model")
        score = run.original_score
        report.accuracy["metric"] = {**plan.metric.to_dict(), "original_score": score, "score": None}
    rewrite = _rewrite(run, loaded.model)
    external = loaded.has_external_data or _io.tensor_bytes(loaded.model) > _io.SINGLE_FILE_LIMIT_BYTES
    if onepass.applies(run):
        del loaded  # each candidate is loaded again, its weights memory-mapped
        if plan.request.one_pass_missed:
            pass  # this run's one pass was made, as a candidate, and missed: not made again
        elif onepass.OnePass(run, rewrite, external).execute(modes) or plan.request.candidate:
            run.report.coverage = coverage_of(run.report, rewrite.entries)
            return
        # No candidate of the pass met the criterion: the search decides (as --auto does).
        run.report.warnings.append(
            "no candidate of the one pass met the accuracy criterion: the search chose the settings"
        )
        run.plan = dataclasses.replace(run.plan, search_below=False)
        run.auto = _floor_search(run.plan)
        run.report.one_pass = None
        _quantize_to(run)
        return
    with contextlib.ExitStack() as searching:  # the search's scratch lives until the output's check
        if plan.int8:
            staged = int8_staged(run, loaded.model, external)
        else:
            staged = _nbits_staged(run, loaded, rewrite, external, searching)
        with contextlib.ExitStack() as stack:  # at once: any error or interrupt removes what is staged
            stack.enter_context(staged)
            del loaded
            report.peak_rss_quantize_bytes = peak_rss_bytes()
            check_and_publish(run, staged, stack, modes)
    if not plan.int8:
        run.report.coverage = coverage_of(run.report, rewrite.entries)


def _rewrite(run: Run, model: ir.Model) -> ConvertReport:
    """Rewrite ``model`` in place; with kernel costs to choose from, choose the settings from them."""
    plan, report = run.plan, run.report
    report.weights_without_rewrite = weight_stats(model)
    report.weight_kinds = weight_kinds(model)
    plan.progress.phase("Rewriting")
    rewrite = rewrite_model(model, plan.convert, for_quantization=True)
    report.rewrite = rewrite.totals()
    report.weights_with_rewrite = weight_stats(model)
    if plan.speed is not None and plan.speed.mode == "shapes" and plan.speed.chooses and not plan.int8:
        from onnx_conv2matmul.quantize.kernel import choose_settings

        choose_settings(run, model, wants_smallest(plan.request))
    return rewrite


def _nbits_staged(
    run: Run, loaded: LoadedModel, rewrite: ConvertReport, external: bool, searching: contextlib.ExitStack
) -> _output.Staged:
    """Search (with ``auto``, in a scratch directory ``searching`` keeps), quantize to MatMulNBits
    and stage the result."""
    plan, report, output = run.plan, run.report, run.output
    model = loaded.model
    if run.auto is not None:
        from onnx_conv2matmul.quantize import search as auto_search

        workdir = searching.enter_context(output.scratch("auto"))
        searching.callback(auto_search.drop_reference, report)
        prepared = auto_search.prepare(model, run.auto, workdir, plan.progress.phase)
        if external:
            # The copy stands for the rewritten model from here on (memory-mapped): the
            # weights the rewrite made in memory go before the fp32 model runs.
            del model
            loaded.model = None  # type: ignore[assignment]
        speed_filter = None
        if report.kernel_plan is not None and plan.speed is not None and run.auto.speed_aware:
            speed_filter = report.kernel_plan.speed_filter(run.auto.accuracy_level, plan.speed.margin)
        auto_search.run_search(run, workdir, prepared, speed_filter)
        if external:
            model = prepared.load()
        assert report.auto is not None
        run.quantize = report.auto.config.quantize_options()
        report.options["quantize"] = run.quantize.to_dict()
    quantize_options = run.quantize
    plan.progress.phase("Quantizing")
    with contextlib.ExitStack() as stack:
        # gptq runs the model to capture its activations: from a copy in a scratch directory.
        gptq = quantize_options.algorithm == "gptq"
        scratch = stack.enter_context(output.scratch("gptq")) if gptq else None
        cache = report.auto.cache if report.auto is not None else None
        result = quantize_matmul_nbits(
            model, quantize_options, feeds=plan.verify.feeds, scratch_dir=scratch, cache=cache
        )
    report.matmuls = result.matmuls
    report.quantized_nodes = result.quantized
    report.excluded = result.excluded
    report.settings = result.settings
    report.unchanged = why_unchanged(rewrite, report, result, quantize_options, plan.verify)
    report.warnings.extend(nbits_warnings(result, quantize_options))
    if quantize_options.other_weights == "int8":
        from onnx_conv2matmul.quantize.other_weights import quantize_other_weights

        report.other_weights = quantize_other_weights(model)
    if report.auto is not None and report.auto.checked is not None:
        from onnx_conv2matmul.quantize.search_runs import model_digest

        if model_digest(model) != report.auto.checked[0]:  # not the model the search evaluated
            report.auto.checked = None
    plan.progress.phase("Saving")
    return output.stage(model, external=external, progress=plan.progress.advance)
