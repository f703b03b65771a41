"""The quantize report as a run assembles it: the settings it starts from, what a failed check
measured in a few words, and the warnings and reasons the MatMulNBits quantizer's record gives."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.quantize.report import QuantizeReport

if TYPE_CHECKING:
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
    """The report's ``coverage`` (see :mod:`onnx_conv2matmul.quantize.coverage`) from what the run
    quantized: the MatMuls it made MatMulNBits and the other weights it stored as int8."""
    from onnx_conv2matmul.quantize.coverage import coverage

    if report.weight_kinds is None:
        return None
    quantized = [name for name, setting in report.settings.items() if setting.bits is not None]
    stored = report.other_weights.stored if report.other_weights is not None else []
    return coverage(report.weight_kinds, entries, quantized, {t.name: t.bytes_before for t in stored})
