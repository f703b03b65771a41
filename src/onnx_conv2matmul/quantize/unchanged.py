"""Why a quantize run quantized nothing: one cause, its figure and the option that changes it.

A run that quantizes no MatMul still writes its output (exit 0) when it meets the accuracy
criterion: the file is the input with the rewrite's exact changes, so a script that quantizes a
folder of models gets every file it asked for. The summary's first line, and ``unchanged`` in the
JSON report, say why, by the first cause that applies:

1. ``accuracy_floor``: the search for settings that meet the accuracy criterion kept every
   MatMul in float;
2. ``patterns``: ``--include``/``--exclude`` left every quantizable MatMul out;
3. ``adds_transposes``: the pointwise convs were left as they are because rewriting them adds
   Transposes (a depthwise or larger-kernel conv beside them needs channels-first data);
4. ``larger_kernels``: the weights are in convs with kernels larger than 1, which MatMulNBits
   cannot take (``--int8-dynamic`` does not help either on the models tried: onnxruntime's
   ``quantize_dynamic`` left silero's and the PP-OCRv4 detector's convs in float);
5. ``weights_are_inputs``: the pointwise convs' weights are initializers that are also graph
   inputs (a caller may replace them), which the rewrite leaves alone; chosen over 3 and 4 when
   they hold more of the weights;
6. ``no_weights``: the model has no MatMul, Gemm or pointwise conv with a constant weight.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.quantize.trade import Prefer, TransposeTrade
from onnx_conv2matmul.rewrite.reasons import SkipReason

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.nbits import NBitsResult
    from onnx_conv2matmul.quantize.projection import WeightStats
    from onnx_conv2matmul.quantize.settings import QuantizeOptions
    from onnx_conv2matmul.rewrite.report import ConvEntry


class Cause(str, enum.Enum):
    """Why nothing was quantized (values are part of the JSON report)."""

    PATTERNS = "patterns"
    ACCURACY_FLOOR = "accuracy_floor"
    ADDS_TRANSPOSES = "adds_transposes"
    LARGER_KERNELS = "larger_kernels"
    WEIGHTS_ARE_INPUTS = "weights_are_inputs"
    NO_WEIGHTS = "no_weights"


@dataclasses.dataclass(frozen=True)
class Unchanged:
    """The cause, the share of the float weights it concerns (None when not about weights), the
    option that changes it (None when there is none) and the sentence the summary opens with."""

    cause: Cause
    share: float | None
    option: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause.value,
            "weight_share": None if self.share is None else round(self.share, 4),
            "option": self.option,
            "message": self.message,
        }


def _share(entries: Sequence[ConvEntry], reason: SkipReason, total: int) -> tuple[int, float]:
    chosen = [e for e in entries if e.reason is reason]
    weight = sum(e.weight_bytes for e in chosen)
    return len(chosen), (weight / total if total else 0.0)


def _convs(count: int, what: str) -> str:
    return f"{count} {what}{'s' if count != 1 else ''}"


def _percent(share: float) -> str:
    return f"{share:.0%}" if share >= 0.01 or share == 0 else f"{share:.1%}" if share >= 0.001 else "<0.1%"


def why_unchanged(
    entries: Sequence[ConvEntry],
    weights: WeightStats,
    rewritten: WeightStats,
    result: NBitsResult,
    options: QuantizeOptions,
    *,
    searched: bool,
    min_cosine: float | None,
    missed: str | None = None,
    real_inputs: bool = False,
) -> Unchanged | None:
    """The reason ``result`` quantized nothing (None when it quantized something).

    Args:
        entries: The rewrite's record of every conv (what was skipped and why).
        weights: The float weights of the model before the rewrite.
        rewritten: The same after the rewrite (how many MatMuls the quantizer could take).
        result: What the quantizer did.
        options: The settings it had (their include and exclude patterns).
        searched: Whether the settings came from the search for the accuracy criterion.
        min_cosine: That criterion, for the message.
        missed: What the settings asked for missed, when known (the output and the figure that
            decided), for the message.
        real_inputs: The criterion was judged on the user's inputs (``--inputs``): the message
            does not send them for real inputs again.
    """
    if result.quantized:
        return None
    total = weights.total_bytes
    quantizable = rewritten.quantizable_matmuls
    if searched and quantizable:
        floor = f" (every sample's cosine >= {min_cosine:g})" if min_cosine is not None else ""
        if missed:
            floor = f" ({missed})"
        return Unchanged(
            Cause.ACCURACY_FLOOR,
            rewritten.share,
            "--min-cosine",
            f"nothing quantized: the accuracy criterion{floor} kept every MatMul in float;"
            + (
                " on these inputs, a lower --min-cosine, or --validate with the task's own measure,"
                " lets the search quantize some"
                if real_inputs
                else " a lower --min-cosine, or --inputs with real inputs, lets the search quantize some"
            ),
        )
    if (options.include or options.exclude) and quantizable:
        patterns = ", ".join(repr(p) for p in (*options.include, *options.exclude))
        return Unchanged(
            Cause.PATTERNS,
            None,
            "--include / --exclude",
            f"nothing quantized: the include and exclude patterns ({patterns}) left all"
            f" {quantizable} quantizable MatMul(s) in float; check them against the node names",
        )
    pointwise, pointwise_share = _share(entries, SkipReason.ADDS_TRANSPOSES, total)
    larger, larger_share = _share(entries, SkipReason.KERNEL_NOT_POINTWISE, total)
    inputs, inputs_share = _share(entries, SkipReason.WEIGHT_OVERRIDABLE, total)
    if inputs and inputs_share > max(pointwise_share, larger_share):
        return Unchanged(
            Cause.WEIGHTS_ARE_INPUTS,
            inputs_share,
            None,
            f"nothing quantized: {_convs(inputs, 'pointwise conv')} holding {_percent(inputs_share)} of"
            " the weights read them from initializers that are also graph inputs (a caller may feed"
            " other weights), so they are left as they are; re-export the model with the weights as"
            " plain initializers to quantize them",
        )
    if pointwise and pointwise_share >= larger_share:
        return Unchanged(
            Cause.ADDS_TRANSPOSES,
            pointwise_share,
            "--allow-added-transposes",
            f"nothing quantized: {_convs(pointwise, 'pointwise conv')} holding {_percent(pointwise_share)} of"
            f" the weights {'was' if pointwise == 1 else 'were'} left as they are because rewriting them"
            " adds Transposes (a depthwise or"
            " larger-kernel conv beside them needs channels-first data); --allow-added-transposes"
            " quantizes them",
        )
    if larger and larger_share > 0:
        also = (
            f"; {_convs(pointwise, 'pointwise conv')} ({_percent(pointwise_share)}) would add Transposes"
            " (--allow-added-transposes)"
            if pointwise
            else ""
        )
        return Unchanged(
            Cause.LARGER_KERNELS,
            larger_share,
            None,
            f"nothing quantized: {_percent(larger_share)} of the weights are in {_convs(larger, 'conv')} with"
            " kernels larger than 1, which MatMulNBits cannot take (it takes MatMuls, and pointwise"
            f" convs once rewritten), and no option of quantize changes that{also}",
        )
    return Unchanged(
        Cause.NO_WEIGHTS,
        None,
        None,
        "nothing quantized: the model has no MatMul, Gemm or pointwise conv with a constant weight",
    )


def with_trade(unchanged: Unchanged, trade: TransposeTrade) -> Unchanged:
    """``unchanged`` with the measured trade of the convs that add Transposes (why the model
    without them was kept) in its message, when that is its cause. ``--prefer size`` is named
    only where it would keep them: the model with them met the criterion with some node
    quantized and was left for its latency. When it missed the criterion or quantized nothing
    (the criterion kept every MatMul in float), or ``--prefer size`` was given, no option would."""
    if unchanged.cause is not Cause.ADDS_TRANSPOSES:
        return unchanged
    with_them = next((layout for layout in trade.layouts if layout.with_transposes), None)
    passed = with_them is not None and with_them.passed and not with_them.not_made
    size_keeps = passed and bool(with_them and with_them.quantized_nodes) and trade.prefer is not Prefer.SIZE
    hint = "; --prefer size keeps them" if size_keeps else ""
    message = unchanged.message.replace(
        "; --allow-added-transposes quantizes them", f"; measured: {trade.reason}{hint}"
    )
    return dataclasses.replace(unchanged, option="--prefer size" if size_keeps else None, message=message)
