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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files.load import load_input
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

if TYPE_CHECKING:
    import onnx_ir as ir

    from onnx_conv2matmul.quantize.speed_objective import RankedKernel, SpeedFilter
    from onnx_conv2matmul.speed.costs import KernelCosts, Layer

if TYPE_CHECKING:
    from onnx_conv2matmul.files.output import Output, Staged
    from onnx_conv2matmul.files.progress import Progress
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.quantize.options import QuantizeOptions
    from onnx_conv2matmul.quantize.other_weights import OtherWeightsResult
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.verify.check import VerifyOptions


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
    timing: TimingReport
    result_index: int

    def latency(self) -> dict[str, Any]:
        """The report's ``latency`` section: the original's and the result's latencies."""
        original, result = self.timing.models[0], self.timing.models[self.result_index]
        return {
            **self.timing.header(),
            "original": [lat.to_dict() for lat in original.latencies],
            "result": [lat.to_dict() for lat in result.latencies],
        }

    def slower(self) -> list[str]:
        """Warnings for every length at which the result is measurably slower than the original
        (the whole 95% interval of the ratio above 1; the table shows every ratio)."""
        result = self.timing.models[self.result_index]
        return [
            f"the result is slower than the original at length {lat.length}: {lat.ratio:.2f}x its latency"
            for lat in result.latencies
            if measurably_slower(lat)
        ]


def measurably_slower(latency: Latency) -> bool:
    """:attr:`~onnx_conv2matmul.speed.timing.Latency.measurably_slower`, the rule's one place."""
    return latency.measurably_slower


def timing_options(speed: SpeedOptions, verify: VerifyOptions, src: str | None = None) -> TimingOptions:
    """The speed options' timing, with inputs made as the accuracy check makes them (fixed
    values, dims, the length input); with ``src``, the inputs the speed step times on instead:
    the real ones, or the accuracy check's runs of ``src`` (see
    :mod:`onnx_conv2matmul.speed.inputs`)."""
    synthesis = dataclasses.replace(verify, feeds=None, lengths=None, min_cosine=None, report_only=False)
    timing = dataclasses.replace(speed.timing, synthesis=synthesis)
    if src is None:
        return timing
    from onnx_conv2matmul.speed.inputs import timing_inputs

    return timing_inputs(src, timing, verify)


def run_speed_step(
    src: str,
    first: Variant,
    options: QuantizeOptions,
    speed: SpeedOptions,
    *,
    stack: contextlib.ExitStack,
    output: Output,
    convert_options: ConvertOptions,
    verify: VerifyOptions,
    progress: Progress,
    int8: bool,
    metric: MetricTarget | None = None,
    original_score: float | None = None,
) -> SpeedOutcome:
    """Choose among the speed options' candidates (when there are several and the model has a
    MatMulNBits node) and time the result.

    A candidate meets the accuracy target as the output must meet the workflow's criterion:
    every sample's cosine similarity at least ``verify.min_cosine`` and, with ``metric``, the
    score's drop from ``original_score`` at most its ``max_drop`` (a candidate that misses it
    counts as cosine -1, with the score in its note)."""
    timing = timing_options(speed, verify, src)
    if int8 or not speed.chooses or not accuracy_levels(first.staged.onnx_path):
        progress.phase("Timing the result against the original")
        report = time_models([src, first.staged.onnx_path], timing, labels=["original", "result"])
        return SpeedOutcome(first, None, None, report, 1)
    variants = [first]
    for block in speed.block_sizes[1:]:
        progress.phase(f"Quantizing with block {block}")
        variant = quantize_variant(
            src, output, convert_options, dataclasses.replace(options, block_size=block), verify
        )
        stack.enter_context(variant.staged)
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
        progress.phase("Measuring the candidates' accuracy")
        choice = _checked_and_timed(
            src,
            candidates,
            speed,
            timing,
            verify=verify,
            progress=progress,
            metric=metric,
            score=original_score,
        )
    winner = choice.chosen.candidate
    kept = next(v for v in variants if not several_blocks or v.block_size == winner.block_size)
    set_accuracy_level(kept.staged.onnx_path, winner.accuracy_level, kept.staged.onnx_path)
    assert choice.timing is not None
    labels = [model.label for model in choice.timing.models]
    chosen = dataclasses.replace(options, block_size=kept.block_size, accuracy_level=winner.accuracy_level)
    return SpeedOutcome(kept, chosen, choice, choice.timing, labels.index(winner.name))


def _checked_and_timed(
    src: str,
    candidates: Any,
    speed: SpeedOptions,
    timing: Any,
    *,
    verify: VerifyOptions,
    progress: Progress,
    metric: MetricTarget | None,
    score: float | None,
) -> Any:
    """The candidates' accuracy against the original (and the user's metric), then their timing
    against it: the kernel choice among them."""
    check = reference_accuracy(src, verify)
    if metric is not None and score is not None:
        check = _with_metric(check, metric, score)
    progress.phase(f"Timing {len(candidates)} candidates against the original")
    return choose_kernel(
        src, candidates, check, min_cosine=verify.min_cosine, timing=timing, min_gain=speed.min_gain
    )


def retry_levels(
    src: str,
    outcome: SpeedOutcome,
    options: QuantizeOptions,
    speed: SpeedOptions,
    levels: tuple[int, ...],
    *,
    verify: VerifyOptions,
    progress: Progress,
    metric: MetricTarget | None = None,
    original_score: float | None = None,
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
    # On the inputs the result was just timed on (the user's, or shapes the check proved).
    timing = outcome.timing.options
    with level_candidates(kept.staged.onnx_path, order) as candidates:
        progress.phase("Slower than the original: checking the other accuracy levels")
        choice = _checked_and_timed(
            src,
            candidates,
            speed,
            timing,
            verify=verify,
            progress=progress,
            metric=metric,
            score=original_score,
        )
    winner = choice.chosen.candidate
    set_accuracy_level(kept.staged.onnx_path, winner.accuracy_level, kept.staged.onnx_path)
    assert choice.timing is not None
    labels = [model.label for model in choice.timing.models]
    chosen = dataclasses.replace(options, accuracy_level=winner.accuracy_level)
    return SpeedOutcome(kept, chosen, choice, choice.timing, labels.index(winner.name))


def accurate_level(
    path: str, options: QuantizeOptions, speed: SpeedOptions, progress: Progress
) -> int | None:
    """A staged result chosen from kernel costs fell below the accuracy criterion: the most
    accurate level tried (the first), written into it as an attribute when it is not its level
    already; None when there is none to try."""
    level = speed.levels[0]
    if level == options.accuracy_level or not accuracy_levels(path):
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
    rewrite_model(model, convert_options)
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


# --------------------------------------------------------------------------- #
# The choice from per-shape costs (the default)
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class KernelPlan:
    """The kernel settings chosen from per-shape costs before the quantization, and what they cost.

    Attributes:
        options: The quantize options with the chosen block size and accuracy level.
        costs: The kernel costs (measured here or read from the machine's cache).
        layers: The model's quantizable MatMuls, with their rows at ``lengths``.
        ranked: Every (block size, level) tried, most accurate first; ``winner`` indexes it.
        floats: The float MatMuls' milliseconds per length.
        seconds: Time spent measuring and choosing.
        search: The search's speed filter, once the search ran with it.
    """

    options: QuantizeOptions
    costs: KernelCosts
    layers: list[Layer]
    lengths: tuple[int, ...]
    ranked: list[RankedKernel]
    winner: int
    floats: tuple[float, ...]
    reason: str
    seconds: float = 0.0
    search: SpeedFilter | None = None

    def speed_filter(self, accuracy_level: int, margin: float) -> SpeedFilter:
        """The search's hook, with the costs at ``accuracy_level`` (kept for the report)."""
        from onnx_conv2matmul.quantize.speed_objective import SpeedFilter

        layers = {layer.name: layer for layer in self.layers}
        self.search = SpeedFilter(self.costs, layers, accuracy_level, margin)
        return self.search

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": list(self.lengths),
            "layers": len(self.layers),
            "shapes": len({(layer.k, layer.n, layer.rows) for layer in self.layers}),
            "cache": self.costs.path,
            "measured": self.costs.measured,
            "from_cache": self.costs.from_cache,
            "float_ms": list(self.floats),
            "candidates": [r.to_dict() for r in self.ranked],
            "winner": self.winner,
            "reason": self.reason,
            "seconds": self.seconds,
            "search": None
            if self.search is None
            else {**self.search.to_dict(), "summary": self.search.summary()},
        }


def plan_kernels(
    src: str,
    model: ir.Model,
    options: QuantizeOptions,
    speed: SpeedOptions,
    verify: VerifyOptions,
    *,
    costs: KernelCosts | None = None,
) -> KernelPlan:
    """Choose the block size and accuracy level from their costs at ``model``'s weight shapes
    (``model`` rewritten, not changed; ``src`` the original, for the activation rows)."""
    import time

    from onnx_conv2matmul.quantize.speed_objective import model_layers, rank_kernels
    from onnx_conv2matmul.speed.costs import KernelCosts, cache_dir, cache_path

    started = time.perf_counter()
    if costs is None:
        costs = KernelCosts(cache_path(), read_cache=speed.cache, threads=speed.timing.threads)
    rows = ""
    if verify.feeds is not None:  # the rows of the given inputs (--inputs), as the timing runs them
        timing = timing_options(speed, verify, src)
        assert timing.feeds is not None
        lengths = tuple(number for number, _ in timing.feeds)
        layers = _given_layers(model, src, timing.feeds, options.selects)
        rows = f", its activation rows at {timing.feeds_rule}"
    else:
        lengths = _bench_lengths(src, speed, verify)
        rows_cache = os.path.join(cache_dir(), "model-rows") if speed.cache else None
        layers = model_layers(model, src, lengths, options.selects, cache=rows_cache)
    bits = options.bits if options.bits in (4, 8) else 4
    winner, ranked, floats = rank_kernels(
        costs, layers, speed.block_sizes, speed.levels, bits=bits, min_gain=speed.min_gain
    )
    costs.save()
    best = ranked[winner]
    chosen = dataclasses.replace(
        options, block_size=best.kernel.block_size, accuracy_level=best.kernel.accuracy_level
    )
    others = ", ".join(
        f"block {r.kernel.block_size} level {r.kernel.accuracy_level} {r.relative:.2f}x"
        for i, r in enumerate(ranked)
        if i != winner
    )
    reason = (
        f"block {best.kernel.block_size}, accuracy level {best.kernel.accuracy_level}: its MatMuls cost"
        f" {best.relative:.2f}x the float ones' at the model's weight shapes on this CPU{rows}"
        + (f" (against {others}; a later setting must be {speed.min_gain:.0%} faster)" if others else "")
    )
    return KernelPlan(
        chosen, costs, layers, lengths, ranked, winner, floats, reason, time.perf_counter() - started
    )


def _bench_lengths(src: str, speed: SpeedOptions, verify: VerifyOptions) -> tuple[int, ...]:
    """The bench lengths given, else those the timing would choose for the original's inputs."""
    if speed.timing.lengths is not None:
        return tuple(speed.timing.lengths)
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    from onnx_conv2matmul.speed.timing import default_lengths
    from onnx_conv2matmul.verify.feeds import InputSpec

    proto = onnx.load(src, load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    specs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
        ]
        specs.append(InputSpec(value.name, tensor_dtype_to_np_dtype(tensor.elem_type), shape))
    try:
        lengths, _ = default_lengths(specs, timing_options(speed, verify).synthesis)
    except Exception:  # the dims' roles cannot be told: the plain default
        from onnx_conv2matmul.speed.timing import DEFAULT_LENGTHS

        lengths = DEFAULT_LENGTHS
    return tuple(lengths)


def _given_layers(
    model: ir.Model, src: str, feeds: Sequence[tuple[int, Mapping[str, Any]]], selects: Any = None
) -> list[Layer]:
    """As :func:`onnx_conv2matmul.quantize.speed_objective.model_layers`, with each MatMul's rows
    at the given inputs' shapes (one per feed) instead of at synthesised lengths."""
    from onnx_conv2matmul.quantize.speed_objective import layers_at

    known = _rows_at_feeds(src, [feed for _, feed in feeds])
    return layers_at(model, known, tuple(number for number, _ in feeds), selects)


def _rows_at_feeds(src: str, feeds: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Per value of the original model at ``src``: its rows (all dims but the last multiplied) at
    each feed's input shapes, by shape inference. Values whose shape stays unknown are left out."""
    import numpy as np
    import onnx

    from onnx_conv2matmul.quantize.speed_objective import _external_as_inputs, _infer

    base = onnx.load(src, load_external_data=False)
    _external_as_inputs(base)
    found: dict[str, list[int | None]] = {}
    for index, feed in enumerate(feeds):
        proto = onnx.ModelProto()
        proto.CopyFrom(base)
        for value in proto.graph.input:
            if value.name not in feed:
                continue
            shape = np.shape(feed[value.name])
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(shape):
                continue
            for dim, size in zip(dims, shape, strict=True):
                dim.Clear()
                dim.dim_value = int(size)
        inferred = _infer(proto)
        if inferred is None:
            continue
        for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            rows: int | None = 1
            value_dims = list(value.type.tensor_type.shape.dim)
            if not value_dims:
                rows = None
            for dim in value_dims[:-1]:
                if not dim.HasField("dim_value") or rows is None:
                    rows = None
                    break
                rows *= dim.dim_value
            found.setdefault(value.name, [None] * len(feeds))[index] = rows
    return {name: tuple(r for r in rows if r is not None) for name, rows in found.items() if None not in rows}
