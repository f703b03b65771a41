"""The quantize workflow: rewrite, quantize with onnxruntime's tools, measure, publish.

Same guarantees as the rewrite: paths are checked before heavy work, everything is
written beside the destination and renamed into place only when every step passed
(including ``--min-cosine``). What the caller gave is resolved once into a
:class:`~onnx_conv2matmul.quantize.plan.QuantizePlan`, which every step reads.
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
from onnx_conv2matmul.files.load import LoadedModel, load_input
from onnx_conv2matmul.quantize.nbits import (
    NBitsResult,
    int8_dynamic,
    int8_dynamic_obstacle,
    quantize_matmul_nbits,
    weight_stats,
)
from onnx_conv2matmul.quantize.options import AutoOptions, QuantizeOptions
from onnx_conv2matmul.quantize.plan import DEFAULT_MIN_COSINE as DEFAULT_MIN_COSINE
from onnx_conv2matmul.quantize.plan import QuantizePlan, Request, resolve
from onnx_conv2matmul.quantize.report import QuantizeReport as QuantizeReport  # its home before report.py
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.verify.check import VerifyOptions, check_feeds_for_graph, verify_models

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.search import Prepared
    from onnx_conv2matmul.quantize.trade import TransposeTrade
    from onnx_conv2matmul.quantize.transposes import Made
    from onnx_conv2matmul.quantize.unchanged import Unchanged
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.rewrite.report import ConvertReport


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class _Run:
    """One pass of a plan into an output: the plan, where it writes, what it has found so far.

    ``quantize`` and ``auto`` start as the plan's and follow the run (the kernel choice and the
    search replace them).
    """

    plan: QuantizePlan
    output: _output.Output
    report: QuantizeReport
    quantize: QuantizeOptions = dataclasses.field(init=False)
    auto: AutoOptions | None = dataclasses.field(init=False)
    original_score: float | None = None

    def __post_init__(self) -> None:
        self.quantize = self.plan.quantize
        self.auto = self.plan.auto


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

    ``verify`` holds the input synthesis and the pass criterion; its ``feeds`` (real
    inputs), when given, are also the calibration inputs of the ``gptq`` algorithm.
    ``quantize.other_weights`` ``int8`` stores the float weights MatMulNBits does
    not take as int8 (see :mod:`onnx_conv2matmul.quantize.other_weights`).

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
    plan = resolve(input_path, output_path, request)
    report = _new_report(plan)
    try:
        with _output.Output(plan.dst, source=plan.src) as output:
            made = None
            if plan.transposes is not None and not plan.int8 and not plan.convert.allow_added_transposes:
                with output.scratch("transposes") as scratch:
                    plan, trade, made = _weigh(plan, scratch)
                    if made is not None:  # published as it was made, sized and timed
                        report = _publish_made(plan, output, made)
                    report.transposes = trade
            if made is None:
                transposes = report.transposes
                report = _new_report(plan)
                report.transposes = transposes
                _quantize_to(_Run(plan, output, report))
                if not report.passed and plan.search_below and not plan.int8:
                    report = _search_below(plan, output, report)
    finally:
        plan.progress.close()
    if report.unchanged is not None and report.transposes is not None:
        from onnx_conv2matmul.quantize.unchanged import with_trade

        report.unchanged = with_trade(report.unchanged, report.transposes.reason)
    report.seconds = time.perf_counter() - started
    report.seconds_by_phase = plan.progress.by_phase()
    report.peak_rss_bytes = _peak_rss_bytes()
    return report


def _weigh(plan: QuantizePlan, scratch: str) -> tuple[QuantizePlan, TransposeTrade | None, Made | None]:
    """The rewrite the Transposes' trade keeps (see :func:`onnx_conv2matmul.quantize.transposes.weigh`)
    and the model kept as it was made (None: not made); both models are made as this run was
    asked (the speed step included), each in a folder of ``scratch`` under the output's name."""
    from onnx_conv2matmul.quantize.transposes import weigh

    assert plan.transposes is not None
    name = os.path.basename(plan.dst)

    def make(rewrite: ConvertOptions, folder: str) -> QuantizeReport:
        again = plan.request.again(rewrite, speed=plan.speed)
        return quantize_file(plan.src, os.path.join(folder, name), again)

    convert, trade, made = weigh(
        plan.src, scratch, plan.convert, plan.transposes, plan.speed, plan.verify, plan.progress.phase, make
    )
    return dataclasses.replace(plan, convert=convert), trade, made


def _publish_made(plan: QuantizePlan, output: _output.Output, made: Made) -> QuantizeReport:
    """Publish the model the trade kept, as made in its scratch folder; its report, now of the output."""
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


def _search_below(
    plan: QuantizePlan,
    output: _output.Output,
    first: QuantizeReport,
) -> QuantizeReport:
    """The settings asked for fell below the criterion: the search's model, with the same
    criterion, into the same output."""
    below = _below_text(first)
    plan.progress.phase("Below the accuracy criterion: searching")
    auto = AutoOptions(
        min_cosine=None if plan.verify.report_only else plan.verify.min_cosine,
        metric=plan.metric,
        accuracy_level=plan.quantize.accuracy_level,
        exclude=plan.quantize.exclude,
        include=plan.quantize.include,
    )
    plan = dataclasses.replace(plan, auto=auto)
    report = _new_report(plan)
    report.transposes = first.transposes
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
    _quantize_to(_Run(plan, output, report))
    return report


def _new_report(plan: QuantizePlan) -> QuantizeReport:
    auto = plan.auto
    auto_options = None
    if auto is not None:
        auto_options = {
            "min_cosine": auto.min_cosine,
            "max_evaluations": auto.max_evaluations,
            "metric": None if auto.metric is None else auto.metric.to_dict(),
        }
    return QuantizeReport(
        mode="int8_dynamic" if plan.int8 else "matmul_nbits",
        input_path=plan.src,
        options={
            "rewrite": plan.convert.to_dict(),
            "quantize": {"int8_dynamic": True} if plan.int8 else plan.quantize.to_dict(),
            "auto": auto_options,
            "speed": None if plan.speed is None else plan.speed.to_dict(),
        },
        accuracy=copy.deepcopy(dict(plan.criterion)),
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


def _quantize_to(run: _Run) -> None:
    """Quantize the plan's input into ``run.output``: staged, checked, timed, and published when
    it meets the criterion (``run.report`` says what happened)."""
    plan, report = run.plan, run.report
    loaded = load_input(
        plan.src, plan.dst, inplace=False, run_checker=plan.run_checker, progress=plan.progress, timings={}
    )
    run.output.protect(loaded.external_files)
    modes = _output.file_modes(loaded.path, loaded.external_files)
    report.input_bytes = loaded.total_bytes
    if plan.verify.feeds is not None:
        # Before the quantization (gptq runs them), not only when the accuracy check does.
        check_feeds_for_graph(loaded.model.graph.inputs, plan.verify.feeds)
    if plan.int8:
        _check_int8_dynamic(loaded.model)
    if plan.metric is not None:
        plan.progress.phase("Scoring the original model")
        run.original_score = plan.metric.score(plan.src, "the original model")
        score = run.original_score
        report.accuracy["metric"] = {**plan.metric.to_dict(), "original_score": score, "score": None}
    rewrite = _rewrite(run, loaded.model)
    external = loaded.has_external_data or _io.tensor_bytes(loaded.model) > _io.SINGLE_FILE_LIMIT_BYTES
    with contextlib.ExitStack() as searching:  # the search's scratch lives until the output's check
        if plan.int8:
            staged = _int8_staged(run, loaded.model, external)
        else:
            staged = _nbits_staged(run, loaded, rewrite, external, searching)
        with contextlib.ExitStack() as stack:  # at once: any error or interrupt removes what is staged
            stack.enter_context(staged)
            del loaded
            report.peak_rss_quantize_bytes = _peak_rss_bytes()
            _check_and_publish(run, staged, stack, modes)


def _rewrite(run: _Run, model: ir.Model) -> ConvertReport:
    """Rewrite ``model`` in place; with kernel costs to choose from, choose the settings from them."""
    plan, report = run.plan, run.report
    report.weights_without_rewrite = weight_stats(model)
    plan.progress.phase("Rewriting")
    rewrite = rewrite_model(model, plan.convert)
    report.rewrite = rewrite.totals()
    report.weights_with_rewrite = weight_stats(model)
    speed = plan.speed
    if speed is not None and speed.mode == "shapes" and speed.chooses and not plan.int8:
        from onnx_conv2matmul.quantize import kernel

        plan.progress.phase("Kernel choice: timing each weight shape")
        report.kernel_plan = kernel.plan_kernels(plan.src, model, run.quantize, speed, plan.verify)
        run.quantize = report.kernel_plan.options
        report.options["quantize"] = run.quantize.to_dict()
        if run.auto is not None and len(speed.levels) > 1:
            run.auto = dataclasses.replace(run.auto, accuracy_level=run.quantize.accuracy_level)
    return rewrite


def _nbits_staged(
    run: _Run, loaded: LoadedModel, rewrite: ConvertReport, external: bool, searching: contextlib.ExitStack
) -> _output.Staged:
    """Search (with ``auto``, in a scratch directory ``searching`` keeps), quantize to MatMulNBits
    and stage the result."""
    plan, report, output = run.plan, run.report, run.output
    model = loaded.model
    if run.auto is not None:
        from onnx_conv2matmul.quantize import search as auto_search

        workdir = searching.enter_context(output.scratch("auto"))
        searching.callback(_drop_reference, report)
        prepared = auto_search.prepare(model, run.auto, workdir, plan.progress.phase)
        if external:
            # The copy stands for the rewritten model from here on (memory-mapped): the
            # weights the rewrite made in memory go before the fp32 model runs.
            del model
            loaded.model = None  # type: ignore[assignment]
        speed_filter = None
        if report.kernel_plan is not None and plan.speed is not None:
            speed_filter = report.kernel_plan.speed_filter(run.auto.accuracy_level, plan.speed.margin)
        _search(run, workdir, prepared, speed_filter)
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
    report.unchanged = _why_unchanged(rewrite, report, result, quantize_options, plan.verify)
    report.warnings.extend(_nbits_warnings(result, quantize_options))
    if quantize_options.other_weights == "int8":
        from onnx_conv2matmul.quantize.other_weights import quantize_other_weights

        report.other_weights = quantize_other_weights(model)
    if report.auto is not None and report.auto.checked is not None:
        from onnx_conv2matmul.quantize.digest import model_digest

        if model_digest(model) != report.auto.checked[0]:  # not the model the search evaluated
            report.auto.checked = None
    plan.progress.phase("Saving")
    return output.stage(model, external=external, progress=plan.progress.advance)


def _check_and_publish(
    run: _Run, staged: _output.Staged, stack: contextlib.ExitStack, modes: tuple[int, int]
) -> None:
    """Check (and with ``speed``, time) the staged model; publish it when it meets the criterion."""
    plan, report = run.plan, run.report
    speed = plan.speed

    def timed(staged: _output.Staged) -> _output.Staged:
        return _speed_step(run, staged, stack)

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
            below = _below_text(report)
            checked(staged)
            if report.passed:
                report.warnings.append(
                    f"accuracy level {run.quantize.accuracy_level}, the cheapest, fell below the"
                    f" accuracy criterion ({below}): level {level} meets it and is kept"
                )
            run.quantize = dataclasses.replace(run.quantize, accuracy_level=level)
            report.options["quantize"] = run.quantize.to_dict()
    if timed_after and report.passed:
        staged = timed(staged)
        if report.kernel_choice is not None:
            checked(staged)
    if report.passed:
        plan.progress.phase("Publishing")
        staged.publish(modes)
        report.output_path = plan.dst


def _drop_reference(report: QuantizeReport) -> None:
    """The search's reference files go with its scratch directory: the report keeps none."""
    if report.auto is not None:
        report.auto.reference = report.auto.cache = None


def _speed_step(run: _Run, staged: _output.Staged, stack: contextlib.ExitStack) -> _output.Staged:
    """Choose the kernel settings and time the result (see :mod:`onnx_conv2matmul.quantize.kernel`);
    the staged model to check and publish. A candidate meets the accuracy target when it meets
    the output's criterion: every sample's cosine at least ``verify.min_cosine`` (the floor by
    default) and, with ``metric``, a score that dropped by at most its ``max_drop``."""
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
    outcome = kernel.run_speed_step(
        plan.src,
        first,
        quantize_options,
        speed,
        stack=stack,
        output=run.output,
        convert_options=plan.convert,
        verify=plan.verify,
        progress=plan.progress,
        int8=plan.int8,
        metric=plan.metric,
        original_score=run.original_score,
    )
    if chosen_by_cost and outcome.slower() and len(tried_levels) > 1:
        first_slower = outcome.slower()
        outcome = kernel.retry_levels(
            plan.src,
            outcome,
            quantize_options,
            speed,
            tried_levels,
            verify=plan.verify,
            progress=plan.progress,
            metric=plan.metric,
            original_score=run.original_score,
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


def _search(run: _Run, workdir: str, model: ir.Model | Prepared, speed_filter: Any = None) -> None:
    """Run the search for ``run.auto`` on the inputs the accuracy check uses (given or
    synthesised), in ``workdir`` (a scratch directory beside the output, under its guard: see
    :meth:`_output.Output.scratch`)."""
    from onnx_conv2matmul.quantize import search as auto_search
    from onnx_conv2matmul.quantize.reference import feed_set

    plan = run.plan
    assert run.auto is not None
    if plan.verify.feeds is None:
        plan.progress.phase("Synthesising inputs")
    feeds = feed_set(plan.src, plan.verify)
    run.report.auto = auto_search.search(
        model,
        feeds,
        run.auto,
        workdir,
        deterministic=plan.verify.deterministic,
        progress=plan.progress.phase,
        original_score=run.original_score,
        memory=plan.verify.memory,
        speed_filter=speed_filter,
        check=plan.verify,
    )


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


def _int8_staged(run: _Run, model: ir.Model, external: bool) -> _output.Staged:
    """Save the rewritten fp32 model aside, run ``quantize_dynamic`` into a staged output.

    onnxruntime names the data file after the ``.onnx`` it writes, so the staged
    ``.onnx`` is named for the data file to get the destination's data-file name.
    """

    progress, output, report = run.plan.progress, run.output, run.report

    def write(directory: str) -> str:
        progress.phase("Saving the rewritten model")
        fp32_dir = os.path.join(directory, "fp32")
        os.mkdir(fp32_dir)
        fp32_path = os.path.join(fp32_dir, "model.onnx")
        _output.save(model, fp32_path, "model.onnx.data" if external else None)
        progress.phase("Quantizing (int8 dynamic)")
        name = output.data_name.removesuffix(".data") if external else os.path.basename(output.path)
        out = os.path.join(directory, name)
        int8_dynamic(model, fp32_path, out, run.quantize, external_data=external)
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
