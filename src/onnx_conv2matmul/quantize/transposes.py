"""Whether the pointwise convs whose rewrite adds Transposes are rewritten: decided by measurement.

A pointwise conv between two convs that need channels-first data (a depthwise conv, a 3x3 one)
runs channels-last between two Transposes of its own once rewritten, and these Transposes cancel
against nothing (the cleanup, :mod:`onnx_conv2matmul.rewrite.cleanup`, removes those that do).
Rewritten, its weight can be quantized; left as it is, it stays in float. On mobile CNNs such
convs hold most of the weights (86% of a PP-OCRv4 text detector's), so this is a trade of size
for latency, and the Transposes' cost depends on the CPU.

So, when the rewrite leaves such convs (skip reason ``adds_transposes``) holding a share of the
weights (:func:`weighed_share`: 10% by default, 1% with ``--prefer size`` or ``speed``),
``quantize`` makes both models (without them and with them, each quantized and checked as the
run asks), times them against the original side by side on this CPU (the speed step's
inputs, :mod:`onnx_conv2matmul.speed.inputs`; a model made with the original's graph, nothing
rewritten or quantized, is not timed: its latency is the original's), and keeps one by the
preference:

- ``size``: the smaller model that meets the accuracy criterion, whatever its latency;
- ``speed``: the faster one (the lower geometric mean of the latency ratios over the inputs);
- by default (``balanced``): the smaller one among those not slower than the original by more
  than :data:`DEFAULT_MARGIN`, when it is smaller than a faster one by at least
  :data:`MIN_SIZE_GAIN` (a model 3% smaller and 10% slower is not worth it); when neither is
  within the margin, the faster. A choice that turns on the margin (a smaller model kept while
  another is faster, or a smaller model left for timing beyond the margin by less than half the
  margin again) is taken on three timings: all are timed twice more (fresh sessions) and each is
  weighed at the median of its three, so one noisy timing flips it neither way. Timings taken on
  a busy machine are shown and not used (the layouts weighed as untimed).

With ``size`` the model with them is made first: when it meets the criterion and is smaller than
the float weights of those convs alone, the model without them (which keeps those weights in
float) cannot be smaller, and is not made (``not_made`` in its row says so); a search on each
layout (``--auto``) then runs once, not twice.

The report's ``transposes`` section shows the trade: those convs' number and weight share, each
model's size and latency ratio, the margin, what was kept and why. Each model is made as the run
was asked (settings, check, search below the criterion, kernel choice, speed step), and the one kept
is published as it was made: the model written is the very model sized, checked and timed here (a
third quantization could choose otherwise, its search and kernel choice being measured again).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from onnx_conv2matmul.files.paths import model_file_bytes
from onnx_conv2matmul.quantize.trade import (
    BEYOND,
    DEFAULT_MARGIN,
    MIN_SHARE,
    MIN_SIZE_GAIN,
    Layout,
    Prefer,
    TransposeOptions,
    TransposeTrade,
    choose,
    median_of,
    size_text,
)
from onnx_conv2matmul.rewrite.reasons import SkipReason

__all__ = ["DEFAULT_MARGIN", "MIN_SHARE", "Layout", "Prefer", "TransposeOptions", "TransposeTrade"]


def weighed_share(prefer: Prefer) -> float:
    """The least share of the float weights the convs that add Transposes must hold for the trade
    to be weighed: :data:`MIN_SHARE`, and by default (``balanced``) :data:`MIN_SIZE_GAIN`.

    Convs holding less than :data:`MIN_SIZE_GAIN` of the weights cannot, by their own weights,
    make the model that quantizes them that much smaller, so by default it would mostly be kept
    for being faster than the one without its Transposes, which it seldom is: the default leaves
    them (``--allow-added-transposes`` quantizes them unweighed) and spends no build and no timing
    on them. On the registry set two models sit below: PP-OCR's server detector (3.5%; 51 s, 40 of
    them on the trade, which kept the model without them; now 3.5 s, the same model) and silero
    VAD v4 (8.5%; the trade kept the model without them, the other 1.57x the original's latency)."""
    return max(MIN_SHARE, MIN_SIZE_GAIN) if prefer is Prefer.BALANCED else MIN_SHARE


def left_with_transposes(src: str, convert_options: Any) -> tuple[int, float, int]:
    """How many convs the rewrite leaves because they add Transposes, their share of the float
    weights and their weights' bytes (read from the ``.onnx`` without reading external data)."""
    from onnx_conv2matmul.quantize.inspection import inspect_file

    inspected = inspect_file(src, convert_options, run_checker=False)
    entries = [e for e in inspected.rewrite.entries if e.reason is SkipReason.ADDS_TRANSPOSES]
    total = inspected.projection.weights_without_rewrite.total_bytes
    weight = sum(e.weight_bytes for e in entries)
    return len(entries), (weight / total if total else 0.0), weight


CandidateRun = Callable[[Any, str, "bool | None"], Any]
"""Quantizes the input with rewrite options into a folder, as the run was asked (its settings,
check, search, kernel choice and speed step); returns its quantize report. Its third argument:
None searches below the criterion as the run does, False makes the one pass alone (a
candidate), True searches straight away (the one pass missed)."""


@dataclasses.dataclass(frozen=True)
class Made:
    """A model the trade made: its path (in the scratch directory) and its quantize report."""

    path: str
    report: Any


def decide(
    src: str,
    scratch: str,
    convert_options: Any,
    options: TransposeOptions,
    run: CandidateRun,
    timing: Any | None,
    verify: Any,
    progress: Callable[[str], None] = lambda _: None,
    searches: bool = False,
    missed_before: dict[Any, float] | None = None,
    kind: str = "",
) -> tuple[Any, TransposeTrade | None, Made | None]:
    """The rewrite options to quantize with, the trade that chose them (None when the rewrite
    leaves no conv because of Transposes, or they hold no weight), and the model kept, as made
    (None when it was not made, or missed the criterion): the one to publish as it is, so the
    model written is the very model sized and timed here. When the layout kept met the criterion
    on the samples it was made on and missed on the held-out ones, its :class:`Made` has no path:
    its report says how, and the run steps back (the layout is not made again to learn it).

    Both models are made by ``run`` in ``scratch`` (each in a folder of its own) and timed
    against ``src`` with ``timing`` (the speed step's options; None: nothing is timed, as with
    ``--no-bench``). ``searches``: the run searches below its criterion where its settings miss
    it; then, but with ``--prefer size``, each layout is made by the one pass alone first, and
    one that missed is searched only when no layout met the criterion there with a weight
    quantized (nor met it and missed on the held-out samples: the run steps back instead).
    ``missed_before``: the layouts (by ``kind`` of run and layout) that missed a cosine criterion before
    in this quantize, each with the loosest minimum cosine it missed; a layout is not made again
    at that cosine or a stricter one (a step back after a held-out miss only asks for a
    stricter one: PP-OCRv4 rec's layout with the Transposes missed 0.99 in three candidates,
    then 0.9976 in the same three), and one that misses is added.

    Raises:
        ModelLoadError, ModelRunError: a model cannot be timed.
    """
    convs, share, left_bytes = left_with_transposes(src, convert_options)
    if not convs or share < weighed_share(options.prefer):
        return convert_options, None, None
    with_options = dataclasses.replace(convert_options, allow_added_transposes=True)
    layouts: list[Layout] = []
    made: list[Made | None] = []
    order = [("without them", False, convert_options), ("with them", True, with_options)]
    size_first = options.prefer is Prefer.SIZE
    if size_first:  # the model with them first: it may leave the other nothing to win
        order.reverse()
    # By default each layout is made by the one pass alone, and searched below the criterion
    # only when no layout met it there with a weight quantized: the one pass's candidates per
    # layout, not a search each (issue 40, item 5). --prefer size searches each as the run
    # asks, for the smallest.
    one_pass_first = searches and not size_first
    outcomes: list[str] = []
    cosine = verify.min_cosine if missed_before is not None else None
    for name, flag, rewrite in order:
        before = missed_before.get((kind, flag)) if missed_before is not None else None
        why = ""
        if before is not None and cosine is not None and cosine >= before:
            why = (
                f"not made again: it missed the criterion at a minimum cosine of {before:.6g},"
                f" and the step back asks for {cosine:.6g}"
            )
        elif size_first and layouts and layouts[0].passed and layouts[0].bytes < left_bytes:
            # Without them, those convs' float weights alone outweigh the model with them.
            why = (
                f"not made: the float weights of the convs that add Transposes alone"
                f" ({size_text(left_bytes)}) outweigh {layouts[0].name} ({size_text(layouts[0].bytes)})"
            )
        if why:
            layouts.append(Layout(name, flag, 0, False, None, 0, why))
            made.append(None)
            outcomes.append("not made")
            continue
        progress(f"Quantizing {name}: the convs that add Transposes")
        layout, model, outcome = _make(name, flag, rewrite, scratch, run, False if one_pass_first else None)
        layouts.append(layout)
        made.append(model)
        outcomes.append(outcome)
    unsearched = ""
    missed = [i for i, outcome in enumerate(outcomes) if outcome == "missed"]
    # A layout that met the criterion by quantizing nothing (PP-OCRv4 det without them: 86% of
    # the weights left in float) gives the user nothing: it does not spare the other a search.
    met = [i for i, m in enumerate(made) if outcomes[i] == "held out" or (m and layouts[i].quantized_nodes)]
    if one_pass_first and missed and not met:
        for i in missed:
            name, flag, rewrite = order[i]
            progress(f"Searching {name}: no layout met the criterion in the one pass with a weight quantized")
            layouts[i], made[i], outcomes[i] = _make(name, flag, rewrite, scratch, run, True)
    elif one_pass_first and missed:
        names = " and ".join(layouts[i].name for i in missed)
        others = " and ".join(layouts[i].name for i in met)
        unsearched = f" ({names} not searched below it: {others} met it in the one pass, weights quantized)"
    if missed_before is not None and cosine is not None:
        for (_, flag, _), outcome in zip(order, outcomes, strict=True):
            if outcome == "missed":
                missed_before[(kind, flag)] = min(cosine, missed_before.get((kind, flag), cosine))
    held = [m if outcome == "held out" else None for m, outcome in zip(made, outcomes, strict=True)]
    made = [None if outcome == "held out" else m for m, outcome in zip(made, outcomes, strict=True)]
    if size_first:
        layouts.reverse()
        made.reverse()
        held.reverse()
    timed_on = busy = confirmed = ""
    # A layout with the original's graph is not timed: its latency is the original's.
    timed = [i for i, m in enumerate(made) if m is not None and not layouts[i].as_original]
    line: Any = None  # the last timing of both: the kept layout's latency line
    if timing is not None and timed:
        from onnx_conv2matmul.speed.inputs import timing_inputs
        from onnx_conv2matmul.verify.run import release_freed_memory

        which = "both" if len(timed) > 1 else layouts[timed[0]].name
        progress(f"Timing {which} against the original")
        # What making both layouts freed, before the sessions open and hold their activations
        # for the whole timing (captcha-recognizer's YOLO at 640x640: a peak of 807 MiB, 614 after).
        release_freed_memory(always=True)
        timing = timing_inputs(src, timing, verify)  # planned once, for both timings
        timed_on, busy, line = _time(src, made, layouts, timed, timing, options)
        if not busy and options.prefer is Prefer.BALANCED and _hinges_on_the_margin(layouts, options.margin):
            # The smaller model is kept, or left, only because it timed within, or just beyond,
            # the margin: a choice that flips with one noisy timing either way (issue 42, item 3)
            # unless it holds on the median of three.
            rounds = {i: [layouts[i]] for i in timed}
            for again in (1, 2):
                progress(
                    f"Timing {which} against the original again ({again} of 2: the choice is at the margin)"
                )
                _, busy, line = _time(src, made, layouts, timed, timing, options)
                if busy:  # weighed as untimed, as the first timing would have been
                    break
                for i in timed:
                    rounds[i].append(layouts[i])
            if not busy:
                confirmed = "; timed again twice: " + ", ".join(
                    f"{rounds[i][0].name} {', '.join(_times(layout) for layout in rounds[i])}" for i in timed
                )
                confirmed += " (each weighed at the median of its three timings)"
                for i in timed:
                    layouts[i] = median_of(rounds[i])
        if busy:
            timed_on += f"; {busy}"
    original = model_file_bytes(src)
    for i, layout in enumerate(layouts):
        if not layout.passed and not layout.not_made:
            layouts[i] = dataclasses.replace(layout, bytes=layout.bytes or original)
    weighed = layouts
    if busy or not any(layout.ratios for layout in layouts):
        # Weighed as untimed, the original's graph too: the rule for no timing, whose reason says so.
        weighed = [dataclasses.replace(layout, ratios=None, as_original=False) for layout in layouts]
    kept, reason = choose(weighed, options.prefer, options.margin, busy or "not timed")
    reason += unsearched + confirmed
    if line is not None and made[kept] is not None and kept in timed:
        _latency_line(made[kept].report, line, 1 + timed.index(kept), busy)  # type: ignore[union-attr]
    trade = TransposeTrade(
        convs,
        share,
        original,
        tuple(layouts),
        options.prefer,
        options.margin,
        kept,
        reason,
        timed_on,
    )
    return (
        (with_options if layouts[kept].with_transposes else convert_options),
        trade,
        made[kept] or held[kept],
    )


def _make(
    name: str, flag: bool, rewrite: Any, scratch: str, run: CandidateRun, search: bool | None
) -> tuple[Layout, Made | None, str]:
    """One layout made by ``run`` in its folder of ``scratch``: its row, the model (None when it
    missed the criterion or could not be made), and the outcome: ``met``; ``missed`` on the samples
    it was made on (a search below the criterion may meet it); ``held out``: met there, missed on
    the held-out samples (not searched again at the same target: the run steps back and aims
    higher), its model a :class:`Made` without a path, for its report; ``failed``: it could not
    be made."""
    folder = os.path.join(scratch, "with" if flag else "without")
    os.makedirs(folder, exist_ok=True)
    try:
        report = run(rewrite, folder, search)
        passed, quantized = bool(report.passed), int(report.quantized_nodes)
        path = report.output_path or ""
    except Exception as err:  # a model that cannot be made is not a candidate
        from onnx_conv2matmul.errors import Conv2MatMulError

        if not isinstance(err, Conv2MatMulError):
            raise
        report, passed, quantized, path = None, False, 0, ""
    ok = passed and bool(path) and os.path.exists(path)
    unchanged = getattr(report, "unchanged", None) if ok and not quantized else None
    why = unchanged.message if unchanged is not None else ""
    layout = Layout(
        name,
        flag,
        model_file_bytes(path) if ok else 0,
        ok,
        None,
        quantized,
        none_quantized=why,
        as_original=ok and _as_original(report),
    )
    if ok:
        return layout, Made(path, report), "met"
    if report is None:
        return layout, None, "failed"
    if getattr(report, "held_out_missed", False):
        return layout, Made("", report), "held out"
    return layout, None, "missed"  # (a candidate whose one pass missed writes nothing)


def _as_original(report: Any) -> bool:
    """Whether a model made has the original's graph: no node rewritten, quantized or stored
    otherwise. Its latency is the original's; timing it would cost a session and rounds to
    measure the noise (captcha-recognizer's YOLO: 3.5 s and a session's activations at 640x640)."""
    rewrite = getattr(report, "rewrite", None) or {}
    other = getattr(report, "other_weights", None)
    return (
        "nodes_before" in rewrite
        and rewrite["nodes_before"] == rewrite.get("nodes_after")
        and not rewrite.get("converted")
        and not report.quantized_nodes
        and not (other is not None and other.stored)
    )


def _time(
    src: str,
    made: Sequence[Made | None],
    layouts: list[Layout],
    timed: Sequence[int],
    timing: Any,
    options: TransposeOptions,
) -> tuple[str, str, Any]:
    """Time the models made against ``src`` (fresh sessions, interleaved, with ``timing``'s
    planned inputs) into ``layouts``' ratios: the lengths' rule, why the timings are not used
    when the machine was busy (else empty), and the timing
    (:class:`~onnx_conv2matmul.speed.timing.TimingReport`: the original, then each model timed)."""
    from onnx_conv2matmul.speed.machine import busy_text, is_busy
    from onnx_conv2matmul.speed.timing import time_models

    result = time_models(
        [src, *(made[i].path for i in timed)],  # type: ignore[union-attr]
        timing,
        labels=["original", *(layouts[i].name for i in timed)],
        clock=options.clock,
        session_factory=options.session_factory,
    )
    for row, i in zip(result.models[1:], timed, strict=True):
        ratios = tuple(lat.ratio for lat in row.latencies if lat.ratio is not None)
        layouts[i] = dataclasses.replace(layouts[i], ratios=ratios)
    if result.cpu_wait is not None and is_busy(result.cpu_wait):
        # Timed on a busy machine: shown, but the layouts are weighed as if not timed (the
        # choice would flip with the load).
        busy = f"timed on a busy machine, not used ({busy_text(result.cpu_wait)})"
        return result.lengths_rule, busy, result
    return result.lengths_rule, "", result


def _latency_line(report: Any, timing: Any, index: int, busy: str) -> None:
    """The kept layout's latency line (``report.latency``), from the trade's timing of it at
    ``index`` against the original, when its own run timed nothing (a layout made by the one pass):
    interleaved with the original, and warned of where it is measurably slower, or, timed on a busy
    machine, that the ratio may not hold."""
    from onnx_conv2matmul.quantize.kernel import busy_warning, latency_of, slower_of

    if report is None or report.latency is not None:
        return
    report.latency = latency_of(timing, index)
    report.warnings.extend([busy_warning(timing.cpu_wait)] if busy else slower_of(timing, index))


def _times(layout: Layout) -> str:
    return "untimed" if layout.speed is None else f"{layout.speed:.3f}x"


def _hinges_on_the_margin(layouts: Sequence[Layout], margin: float) -> bool:
    """Whether the default's choice turns on where a timing fell against ``margin``: it keeps a
    smaller model that is slower than another only because it timed within the margin of the
    original, or leaves a smaller model that met the criterion only because it timed beyond the
    margin by less than half the margin again (``1 + margin`` to ``1 + 1.5 * margin``: PP-OCRv4
    rec's model with them timed 1.14x once and 1.00-1.03x in other cold runs). Further out the
    two more timings are not spent: a captcha YOLO's model with them timed 1.19x, 1.19x and 1.30x,
    12 s for nothing in a run of 18 s."""
    kept, _ = choose(layouts, Prefer.BALANCED, margin)
    speeds = [layout.speed for layout in layouts if layout.passed and layout.speed is not None]
    value = layouts[kept].speed
    if value is not None and value > 1.0 and bool(speeds) and value > min(speeds):
        return True
    return any(
        layout.passed
        and layout.speed is not None
        and layout.bytes < layouts[kept].bytes
        and 1 + margin < layout.speed <= 1 + BEYOND * margin
        for layout in layouts
    )


def weigh(plan: Any, scratch: str, run: CandidateRun) -> tuple[Any, TransposeTrade | None, Made | None]:
    """:func:`decide` for a quantize run's plan (:class:`onnx_conv2matmul.quantize.plan.QuantizePlan`):
    ``run`` makes each model in ``scratch`` as the run was asked (settings, check, search, kernel
    choice, speed step); both are timed with the plan's speed options' timing (None: ``--no-bench``)."""
    timing = None
    if plan.speed is not None:
        from onnx_conv2matmul.quantize.kernel import timing_options

        timing = timing_options(plan.speed, plan.verify)
    searches = plan.search_below and plan.auto is None and not plan.request.candidate
    # A metric's criterion is not a cosine: a layout that missed it is made again.
    memos = plan.request.memos
    missed = memos.missed if memos is not None and plan.metric is None else None
    kind = "search" if plan.auto is not None else "one pass"
    kind += " candidate" if plan.request.candidate else ""
    return decide(
        plan.src,
        scratch,
        plan.convert,
        plan.transposes,
        run,
        timing,
        plan.verify,
        plan.progress.phase,
        searches=searches,
        missed_before=missed,
        kind=kind,
    )


def search_both(trade: TransposeTrade) -> bool:
    """Whether ``--auto``'s search runs on both layouts of the default run's Transposes' trade,
    not only on the one it kept: when that one quantized nothing and the other's one pass missed
    the criterion, the search may meet it there (PP-OCRv4 det: the layout with the Transposes at
    0.358x, where the one kept, without them, stays 1.00x)."""
    missed = any(not layout.passed and not layout.not_made for layout in trade.layouts)
    return missed and trade.chosen.quantized_nodes == 0
