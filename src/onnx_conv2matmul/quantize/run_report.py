"""The quantize report as a run assembles it: the settings it starts from, what a failed check
measured in a few words, and the warnings and reasons the MatMulNBits quantizer's record gives.

The step back after a held-out miss (see :func:`onnx_conv2matmul.quantize.workflow.quantize_file`):
with ``--inputs``, a result that met the criterion on the samples it was chosen on and missed it on
the held-out ones is chosen again, each choice asked for a stricter minimum cosine on the samples
it sees (:func:`step_back_cosine`), at most :data:`MAX_STEP_BACKS` times; the report keeps each
result that missed (``accuracy.held_out.steps``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.quantize.report import QuantizeReport

if TYPE_CHECKING:
    from onnx_conv2matmul.files.progress import Progress
    from onnx_conv2matmul.quantize.nbits import NBitsResult
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.quantize.settings import QuantizeOptions
    from onnx_conv2matmul.quantize.unchanged import Unchanged
    from onnx_conv2matmul.rewrite.report import ConvertReport
    from onnx_conv2matmul.verify.check import VerifyOptions


def new_report(plan: QuantizePlan) -> QuantizeReport:
    """The report a run of ``plan`` starts from: its mode, input, options and accuracy criterion."""
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


def worst_cosine(report: QuantizeReport) -> float | None:
    """The lowest cosine the accuracy check measured (None: it measured none)."""
    return report.verification.worst_cosine if report.verification is not None else None


def below_text(report: QuantizeReport) -> str:
    """What the failed check measured, in a few words."""
    parts = []
    worst = worst_cosine(report)
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


def why_unchanged(
    rewrite: ConvertReport,
    report: QuantizeReport,
    result: NBitsResult,
    options: QuantizeOptions,
    verify: VerifyOptions,
) -> Unchanged | None:
    """Why nothing was quantized (see :mod:`onnx_conv2matmul.quantize.unchanged`). Settings chosen
    for the criterion (by the search, or the one pass's per-layer decision: the report's
    ``accuracy.fallback``) that keep everything in float are the criterion's doing."""
    from onnx_conv2matmul.quantize import unchanged

    assert report.weights_without_rewrite is not None and report.weights_with_rewrite is not None
    return unchanged.why_unchanged(
        rewrite.entries,
        report.weights_without_rewrite,
        report.weights_with_rewrite,
        result,
        options,
        searched=report.auto is not None or report.accuracy.get("fallback") is not None,
        min_cosine=verify.min_cosine,
        missed=(report.accuracy.get("fallback") or {}).get("reason"),
        real_inputs=verify.feeds is not None,
    )


def nbits_warnings(result: NBitsResult, options: QuantizeOptions, *, decided: bool = False) -> list[str]:
    """What the user should know from the quantizer's record: patterns or node names that matched
    nothing, MatMuls left in float and why. ``decided``: the settings were chosen for the accuracy
    criterion (their patterns are the tool's, not the user's)."""
    warnings = []
    if result.quantized == 0 and (options.include or options.exclude) and not options.nodes and not decided:
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


def coverage_of(report: QuantizeReport, entries: Sequence[Any]) -> dict[str, Any] | None:
    """The report's ``coverage`` (see :mod:`onnx_conv2matmul.quantize.inspection`) from what the run
    quantized: the MatMuls it made MatMulNBits and the other weights it stored as int8."""
    from onnx_conv2matmul.quantize.inspection import coverage

    if report.weight_kinds is None:
        return None
    quantized = [name for name, setting in report.settings.items() if setting.bits is not None]
    stored = report.other_weights.stored if report.other_weights is not None else []
    return coverage(report.weight_kinds, entries, quantized, {t.name: t.bytes_before for t in stored})


MAX_STEP_BACKS = 2
"""Runs made again after a held-out miss, each choosing with a stricter minimum cosine."""
STEP_BACK_SHARE = 0.9
"""A step back aims the held-out samples' loss at this share of one that passes (a margin)."""
MIN_STEP_BACK_LOSS = 1e-6
"""A step back that would allow less cosine loss than this asks for float: the run fails instead."""


def step_back_cosine(report: QuantizeReport) -> float | None:
    """The minimum cosine the next run's choices must meet on the samples they see, after the
    result met the criterion there and missed it on the held-out ones; None: no step back (the
    held-out samples passed or were not checked, :data:`MAX_STEP_BACKS` were made, or only float
    would do).

    The held-out samples' loss (one minus their worst cosine) is aimed at a share
    (:data:`STEP_BACK_SHARE`) of one that would have passed: the criterion's, or, when their labels
    moved, the loss at which they moved. The samples the run chooses on are asked for that aim
    times the ratio of their loss to the held-out samples' in the result that missed, and at least
    half the loss allowed before."""
    held = report.accuracy.get("held_out") or {}
    criterion = report.accuracy.get("min_cosine")
    if held.get("passed") is not False or criterion is None or len(held.get("steps") or []) >= MAX_STEP_BACKS:
        return None
    verification = report.verification
    chosen = verification.worst_cosine if verification is not None else None
    asked = held.get("chosen_with_min_cosine") or criterion
    allowed = (1.0 - asked) / 2
    worst = held.get("worst_cosine")
    if worst is not None and chosen is not None and worst < 1.0:
        aim = 1.0 - criterion
        if any(not t["passed"] for t in held.get("labels") or []):
            aim = min(aim, 1.0 - worst)
        allowed = min(allowed, STEP_BACK_SHARE * aim * (1.0 - chosen) / (1.0 - worst))
    if allowed <= MIN_STEP_BACK_LOSS:
        return None
    return round(1.0 - float(allowed), 8)


def record_step(report: QuantizeReport, missed: QuantizeReport) -> None:
    """The held-out miss of ``missed`` as a step of ``report``'s, and a warning that says so."""
    held, before = report.accuracy.get("held_out"), missed.accuracy.get("held_out") or {}
    if not held:
        return
    step = {
        "chosen_with_min_cosine": before.get("chosen_with_min_cosine") or missed.accuracy.get("min_cosine"),
        "worst_cosine": before.get("worst_cosine"),
        "labels": before.get("labels") or [],
        "note": before.get("note"),
    }
    held["steps"] = [*(before.get("steps") or []), step]
    if report.passed:
        report.warnings.append(
            f"the result chosen with a minimum cosine of {step['chosen_with_min_cosine']:g}"
            f" {before.get('note')}: the run stepped back and chose with"
            f" {held['chosen_with_min_cosine']:g} on those samples, which the held-out ones meet"
        )


class KeptOpen:
    """A progress whose ``close`` waits for the last attempt of a run (the step backs reuse it)."""

    def __init__(self, inner: Progress) -> None:
        self.inner = inner

    def phase(self, name: str) -> None:
        self.inner.phase(name)

    def advance(self, done: int, total: int) -> None:
        self.inner.advance(done, total)

    def close(self) -> None:
        pass
