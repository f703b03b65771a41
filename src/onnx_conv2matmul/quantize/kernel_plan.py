"""The kernel settings chosen from per-shape costs, before the quantization (the default
``--bench shapes``): every candidate block size and accuracy level is costed at the model's own
weight shapes and activation rows (:mod:`onnx_conv2matmul.quantize.speed_objective`), so the model
is quantized once, with the cheapest."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

    from onnx_conv2matmul.quantize.options import QuantizeOptions
    from onnx_conv2matmul.quantize.speed_objective import RankedKernel, SpeedFilter
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.speed.costs import KernelCosts, Layer
    from onnx_conv2matmul.speed.timing import TimingOptions
    from onnx_conv2matmul.verify.check import VerifyOptions


SHORT_ROUNDS = 5
"""Timed rounds of a short timing (the default latency line, a choice of the speed step)."""


def shortened(timing: TimingOptions) -> TimingOptions:
    """``timing`` made short: :data:`SHORT_ROUNDS` rounds at most, none left to settle (the
    shortest length is the caller's); lengths or inputs given are timed as given."""
    if timing.lengths is not None or timing.feeds is not None:
        return timing
    return dataclasses.replace(timing, rounds=min(timing.rounds, SHORT_ROUNDS), settle_after=None)


def timing_options(
    speed: SpeedOptions,
    verify: VerifyOptions,
    src: str | None = None,
    *,
    short: bool = False,
    session: Any = None,
) -> TimingOptions:
    """The speed options' timing, with inputs made as the accuracy check makes them (fixed
    values, dims, the length input); with ``src``, the inputs the speed step times on instead:
    the real ones, or the accuracy check's runs of ``src`` (see
    :mod:`onnx_conv2matmul.speed.inputs`). ``short`` (with ``src``): the shortest of those alone,
    :data:`SHORT_ROUNDS` rounds at most, unless lengths were given. ``session``: a checking session
    of ``src`` made already, to prove them with."""
    synthesis = dataclasses.replace(verify, feeds=None, lengths=None, min_cosine=None, report_only=False)
    timing = dataclasses.replace(speed.timing, synthesis=synthesis)
    if src is None:
        return timing
    from onnx_conv2matmul.speed.inputs import timing_inputs

    short = short and timing.lengths is None and timing.feeds is None  # given: timed as given
    return timing_inputs(src, shortened(timing) if short else timing, verify, short=short, session=session)


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
    retry: str = ""
    """Why a more accurate level was not tried on a result below the criterion (empty: it was, or
    there was no need)."""

    def relative(self, block_size: int, level: int) -> float | None:
        """The MatMuls' cost with ``block_size`` and ``level`` as a multiple of float's (None: not
        costed)."""
        for ranked in self.ranked:
            if ranked.kernel.block_size == block_size and ranked.kernel.accuracy_level == level:
                return ranked.relative
        return None

    def for_size(self) -> KernelPlan:
        """This plan as ``--prefer size`` (and ``--auto``'s default candidate) quantizes with it:
        of the block sizes costed and the default's, the one whose weights take the fewest bytes
        at these weight shapes, the smaller on a tie (a block pads K: PLCMOS v2 came out 0.634x
        at block 256, 0.591x at 64; ddddocr's recognizer 0.467x at 64, 0.459x at the default's
        256); at accuracy level 0, the most accurate, which changes no byte (level 4
        quantizes the activations too: its error left PP-OCRv4's detector in float, 1.00x, where
        level 0 gives 0.44x)."""
        from onnx_conv2matmul.quantize.settings import QuantizeOptions

        options = self.options
        blocks = {r.kernel.block_size for r in self.ranked} | {QuantizeOptions().block_size}
        block = min(blocks, key=lambda b: (weight_bytes(self.layers, options, b), b))
        options = dataclasses.replace(options, block_size=block, accuracy_level=0)
        reason = (
            f"{self.reason}; for the smallest model, block {block} (the fewest bytes at these weight"
            " shapes) at accuracy level 0, the most accurate (the same bytes)"
        )
        return dataclasses.replace(self, options=options, reason=reason)

    def speed_filter(self, accuracy_level: int, margin: float) -> SpeedFilter:
        """The search's hook, with the costs at ``accuracy_level`` and the block sizes costed (kept
        for the report)."""
        from onnx_conv2matmul.quantize.speed_objective import SpeedFilter

        layers = {layer.name: layer for layer in self.layers}
        blocks = tuple(sorted({r.kernel.block_size for r in self.ranked}))
        self.search = SpeedFilter(self.costs, layers, accuracy_level, margin, blocks)
        return self.search

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": list(self.lengths),
            "layers": len(self.layers),
            "shapes": len({(layer.k, layer.n, layer.rows) for layer in self.layers}),
            "cache": self.costs.path,
            "measured": self.costs.measured,
            "from_cache": self.costs.from_cache,
            "others_cpu_share": None if self.costs.waited is None else round(self.costs.waited, 4),
            "float_ms": list(self.floats),
            "candidates": [r.to_dict() for r in self.ranked],
            "winner": self.winner,
            "reason": self.reason,
            "retry": self.retry or None,
            "seconds": self.seconds,
            "search": None
            if self.search is None
            else {**self.search.to_dict(), "summary": self.search.summary()},
        }


def weight_bytes(layers: Sequence[Layer], options: QuantizeOptions, block_size: int) -> int:
    """The bytes the quantized weights of ``layers`` take at ``block_size`` with ``options``' bits
    and zero points (a block pads K to whole blocks: see :func:`~.blockwise.stored_bytes`)."""
    from onnx_conv2matmul.quantize.blockwise import stored_bytes

    shapes = {layer.name: (layer.k, layer.n) for layer in layers}.values()
    return sum(stored_bytes(k, n, options.bits, block_size, options.symmetric) for k, n in shapes)


def _not_bigger(
    layers: Sequence[Layer], options: QuantizeOptions, blocks: Sequence[int]
) -> tuple[tuple[int, ...], str]:
    """The block sizes of ``blocks`` whose weights take no more bytes than at the options' own
    block (64 by default), and in words those left out: a block that pads K (K = 120 in blocks of
    256) can make a model bigger for a kernel a few percent faster (PLCMOS v2: 0.634x at block
    256, 0.591x at 64)."""
    if options.block_size not in blocks:
        return tuple(blocks), ""
    sizes = {b: weight_bytes(layers, options, b) for b in blocks}
    base = sizes[options.block_size]
    kept = tuple(b for b in blocks if sizes[b] <= base)
    left = [
        f"block {b} ({sizes[b] / base:.2f}x block {options.block_size}'s bytes)"
        for b in blocks
        if b not in kept
    ]
    why = f"; not costed, as their weights take more bytes at these shapes: {', '.join(left)}" if left else ""
    return kept, why


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

    import numpy as np

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
        given = [{name: np.shape(array) for name, array in feed.items()} for _, feed in timing.feeds]
        layers = model_layers(model, lengths, options.selects, shapes=given)
        rows = f", its activation rows at {timing.feeds_rule}"
    else:
        lengths, shapes = _bench_shapes(src, speed, verify)
        rows_cache = os.path.join(cache_dir(), "model-rows") if speed.cache else None
        layers = model_layers(model, lengths, options.selects, shapes=shapes, cache=rows_cache)
    bits = options.bits if options.bits in (4, 8) else 4
    blocks, left_out = _not_bigger(layers, options, speed.block_sizes)
    steps, ranked, floats = rank_kernels(
        costs, layers, blocks, speed.levels, bits=bits, min_gain=speed.min_gain
    )
    winner = steps[-1]
    costs.save()
    note = ""  # why the winner was not taken as timed, or how its second timing went
    if costs.busy and winner != 0:
        from onnx_conv2matmul.speed.machine import busy_text

        # Timings on a busy machine do not trade accuracy: the most accurate setting is kept.
        assert costs.waited is not None
        note = f"; {busy_text(costs.waited)}: the most accurate setting is kept, not the fastest timed"
        winner = 0
    elif winner != 0 and costs.measured:
        winner, again = confirm_gain(costs, layers, ranked, steps, speed.min_gain)
        note = f"; {again}"
    if bits == 4 and not costs.busy:
        winner, tie = eight_bit_tie(costs, layers, ranked, winner)
        note += tie
        costs.save()  # the 8-bit kernels it timed
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
        + note
        + left_out
    )
    return KernelPlan(
        chosen, costs, layers, lengths, ranked, winner, floats, reason, time.perf_counter() - started
    )


TIE_BAND = 0.10
"""Settings whose 4-bit MatMuls cost within this share of the chosen one's tie with it (see
:func:`eight_bit_tie`): wider than the 2% a setting must gain to be chosen, as two cold runs put the
same two settings 1-4% apart in either order, and wider than the spread of cold runs: at 5%,
PP-OCRv4 rec's block 128 level 4 fell at 1.01-1.05x block 64 level 0's over six cold runs, outside
the band once, and that run left the model with the Transposes 0.997x where the others made
0.381x (level 0's 8-bit kernels are slower than float there, so its mix could not keep 8 bits).
The same 10% as the layouts' margin against the original (the whole model's latency)."""
EIGHT_BIT_GAIN = 0.05
"""How much less a tied setting's 8-bit MatMuls must cost to be taken (see :func:`eight_bit_tie`):
PP-OCRv4 rec's level 4 ran them 0.85-0.90x as long as level 0 over cold runs, at the edge of 10%."""


def eight_bit_tie(
    costs: KernelCosts, layers: Sequence[Layer], ranked: Sequence[RankedKernel], winner: int
) -> tuple[int, str]:
    """The winner, or a setting at another accuracy level tied with it (its 4-bit MatMuls within
    :data:`TIE_BAND` of the winner's) whose 8-bit MatMuls cost :data:`EIGHT_BIT_GAIN` less; and
    what decided, in words (empty: there was no tie, or it changed nothing).

    The level is one for every MatMul, and the search that runs when the uniform setting falls
    below the criterion offers 8 bits only where they do not slow the model. On a CPU where
    4-bit kernels cost the same at levels 0 and 4 but 8-bit ones twice as much at level 0 (a small
    BERT's: 1.17-1.21x float's for 4 bits at either, 8 bits 2.2x at level 0 and 1.1x at 4), the
    noise of the 4-bit timing chose the level, and with it whether the search could keep 8 bits
    (0.32x) or had to leave those layers in float (0.69x). A tie goes to the smaller model."""
    from onnx_conv2matmul.speed.costs import model_cost

    best = ranked[winner]
    tied = [
        index
        for index, other in enumerate(ranked)
        if other.kernel.accuracy_level != best.kernel.accuracy_level
        and other.relative <= best.relative * (1 + TIE_BAND)
    ]
    if not tied:
        return winner, ""
    eight = {i: dataclasses.replace(ranked[i].kernel, bits=8) for i in [winner, *tied]}
    costs.prefetch(layers, list(eight.values()))
    if costs.busy:
        return winner, ""
    cost = {i: sum(model_cost(costs, layers, kernel)) for i, kernel in eight.items()}
    pick = min(tied, key=lambda i: (cost[i], i))
    if cost[pick] >= cost[winner] * (1 - EIGHT_BIT_GAIN):
        return winner, ""
    chosen = ranked[pick].kernel
    return pick, (
        f"; block {chosen.block_size} level {chosen.accuracy_level} ties with it for 4 bits"
        f" ({ranked[pick].relative:.2f}x, within {TIE_BAND:.0%}) and runs 8-bit weights"
        f" {cost[pick] / cost[winner]:.2f}x as long, so the search can keep them where the criterion"
        " needs 8 bits: it is taken"
    )


def confirm_gain(
    costs: KernelCosts,
    layers: Sequence[Layer],
    ranked: Sequence[RankedKernel],
    steps: Sequence[int],
    min_gain: float,
) -> tuple[int, str]:
    """The setting kept once the first timing's winner is timed again (fresh sessions, not cached),
    and what that timing gave in words. ``steps``: the settings that each replaced the one before
    as the fastest (:func:`~onnx_conv2matmul.quantize.speed_objective.won_steps`), the winner last.
    A setting that trades accuracy for speed must win twice: once is noise as often as not on a
    shared machine. The winner is kept when it beats the setting it replaced again; else that one,
    when it beats the most accurate again; else the most accurate. The step before the winner
    counts, not only the first: openWakeWord's hey jarvis (MatMuls of 50 us) timed block 256 level 4
    0.91x against block 128 level 4's 0.96x in one cold run, 0.3-1.8% apart in six others; block
    256 beat block 64 level 0 (1.11x) again, was kept, its uniform candidate missed the floor
    where block 128's meets it, and the mix made 0.514x instead of 0.268x."""
    from onnx_conv2matmul.speed.costs import FLOAT_KERNEL, KernelCosts, model_cost, relative

    again = KernelCosts(
        None,
        read_cache=False,
        runs=costs.runs,
        warmup=costs.warmup,
        threads=costs.threads,
        min_ms=costs.min_ms,
        extra_ms=costs.extra_ms,
        clock=costs.clock,
        session_factory=costs.session_factory,
    )
    first, previous, winner = steps[0], steps[-2], steps[-1]
    timed = list(dict.fromkeys([first, previous, winner]))
    again.prefetch(layers, [FLOAT_KERNEL, *(ranked[i].kernel for i in timed)])
    floats = model_cost(again, layers, FLOAT_KERNEL)
    ratio = {i: relative(model_cost(again, layers, ranked[i].kernel), floats) for i in timed}

    def label(i: int) -> str:
        return f"block {ranked[i].kernel.block_size} level {ranked[i].kernel.accuracy_level}"

    text = f"{label(winner)} timed again: {ratio[winner]:.2f}x against {ratio[previous]:.2f}x"
    if previous != first:
        text += f" ({label(previous)}, the setting it replaced)"
    if again.busy:
        return first, f"{text}, on a busy machine: not confirmed, the most accurate setting is kept"
    if ratio[winner] < ratio[previous] * (1 - min_gain):
        return winner, f"{text}: confirmed"
    if previous != first and ratio[previous] < ratio[first] * (1 - min_gain):
        return previous, (
            f"{text}: not confirmed; {label(previous)} is kept ({ratio[previous]:.2f}x against the most"
            f" accurate setting's {ratio[first]:.2f}x: confirmed)"
        )
    return first, f"{text}: not confirmed, the most accurate setting is kept"


def _bench_shapes(
    src: str, speed: SpeedOptions, verify: VerifyOptions
) -> tuple[tuple[int, ...], list[dict[str, list[int]]] | None]:
    """The bench lengths (given, else those the timing would choose for the original's inputs)
    and, per length, the input shapes the timing synthesises at batch 1: the dims the accuracy
    check found (a recognizer's height of 48) fixed, the others at the length. None for the shapes
    when the dims' roles cannot be told."""
    import onnx

    from onnx_conv2matmul.speed.timing import DEFAULT_LENGTHS, default_lengths
    from onnx_conv2matmul.verify.discover import graph_specs
    from onnx_conv2matmul.verify.roles import dim_roles

    specs = graph_specs(onnx.load(src, load_external_data=False))
    synthesis = dataclasses.replace(timing_options(speed, verify).synthesis, batch=1)
    lengths: tuple[int, ...] = tuple(speed.timing.lengths or ())
    if specs is None:  # an input that is not a plain tensor: the plain default, every dim at the length
        return lengths or tuple(DEFAULT_LENGTHS), None
    try:
        if not lengths:
            lengths = tuple(default_lengths(specs, synthesis)[0])
        roles = dim_roles(specs, synthesis)
        shapes = [
            {spec.name: roles.shape(spec.name, roles.values(length, synthesis)) for spec in specs}
            for length in lengths
        ]
    except Exception:  # the dims' roles cannot be told: the plain default, every dim at the length
        return lengths or tuple(DEFAULT_LENGTHS), None
    return lengths, shapes
