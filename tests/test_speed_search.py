"""The speed-aware search on fake machines (tests/speed_fakes.py): which settings it may measure
and choose, its ladder, its stop, and the retry of a more accurate level. No test depends on how
fast anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from onnx_conv2matmul.files.progress import NullProgress
from onnx_conv2matmul.quantize import search as auto_search
from onnx_conv2matmul.quantize import sensitivity
from onnx_conv2matmul.quantize.kernel import accurate_level
from onnx_conv2matmul.quantize.kernel_plan import KernelPlan
from onnx_conv2matmul.quantize.options import LADDER, AutoOptions, QuantizeOptions, Setting
from onnx_conv2matmul.quantize.search import synthesised_feeds
from onnx_conv2matmul.quantize.speed_objective import SpeedFilter, model_layers, rank_kernels
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.speed.choose import SpeedOptions
from onnx_conv2matmul.speed.costs import KernelCosts, Layer
from onnx_conv2matmul.verify.check import VerifyOptions
from speed_fakes import FakeClock, KernelMachine, int8_machine, quantized, sequence_matmul_model

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"
INT8_SLOW = int8_machine(int8_factor=3.0)
"""As measured on an AVX-512 Xeon: 8-bit MatMulNBits slower than the float MatMul."""
INT8_FAST = int8_machine(int8_factor=0.6)
"""As on a CPU where 8 bits pays: faster than float, slower than 4 bits."""
LAYERS = {"a": Layer("a", 64, 128, (25, 125)), "b": Layer("b", 128, 64, (25, 125))}


@dataclasses.dataclass(frozen=True)
class _Float:
    bits: None = None
    block_size: int = 0


def _costs(cost=INT8_SLOW) -> KernelCosts:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    return KernelCosts(None, clock=clock, session_factory=KernelMachine(clock, cost))


def test_the_ladder_takes_the_block_sizes_the_kernel_choice_costed() -> None:
    speed = SpeedFilter(_costs(), LAYERS, accuracy_level=4, block_sizes=(64, 128, 256))
    ladder = speed.ladder(LADDER)
    assert set(LADDER) < set(ladder)
    assert {Setting(4, 256, True), Setting(4, 256, False), Setting(8, 256, True)} <= set(ladder)
    assert ladder[0] == Setting(4, 256, True)  # 4 bits first, larger blocks first
    assert SpeedFilter(_costs(), LAYERS, accuracy_level=4).ladder(LADDER) == LADDER


@pytest.mark.parametrize(("machine", "eight_bits"), [(INT8_SLOW, False), (INT8_FAST, True)])
def test_slow_settings_are_refused_before_any_error_is_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, machine, eight_bits: bool
) -> None:  # type: ignore[no-untyped-def]
    """The search measures the errors only of the settings the filter allows: on the int8-slow
    machine no 8-bit setting of a layer that would slow the model is ever quantized to measure
    it (only the smallest layers, whose extras fit in the margin together, may take 8 bits); on
    the int8-fast one every layer may."""
    model = ir.load(ENCODER)
    rewrite_model(model, ConvertOptions(extended=True, allow_non_unit_dilation=True))
    layers = model_layers(model, (64, 97))
    speed = SpeedFilter(_costs(machine), {layer.name: layer for layer in layers}, 4, block_sizes=(256,))
    measured: list[tuple[tuple[int, ...], Setting]] = []
    real = sensitivity.block_quantize

    def spy(weight, setting):  # type: ignore[no-untyped-def]
        measured.append((tuple(sorted(weight.shape)), setting))
        return real(weight, setting)

    monkeypatch.setattr(sensitivity, "block_quantize", spy)
    feeds = synthesised_feeds(str(ENCODER), VerifyOptions(lengths=(64, 97)))
    result = auto_search.search(
        model, feeds, AutoOptions(min_cosine=0.9999), str(tmp_path), speed_filter=speed
    )
    eight = [shape for shape, setting in measured if setting.bits == 8]
    four = [shape for shape, setting in measured if setting == Setting(4, 256, True)]
    assert four  # the costed block size is a choice of each layer
    bits = {choice.setting.bits for choice in result.choices}
    assert result.reached_cosine >= 0.9999
    if eight_bits:
        assert len(eight) >= 2 * len(four) and 8 in bits and not speed.dropped
    else:  # 8 bits only where its extras fit in the margin together: most layers never try it
        assert len(eight) < len(four) and None in bits
        assert any(label.startswith("int8") for label in speed.dropped)
        assert "not offered to the search" in speed.summary()
    # the mix chosen: its MatMuls slower than float's by at most the margin, all layers together
    float_ms = sum(speed.layer_cost(layer, _Float()) for layer in layers)
    by_name = {layer.name: layer for layer in layers}
    extra = sum(
        speed.layer_cost(by_name[c.name], c.setting) - speed.layer_cost(by_name[c.name], _Float())
        for c in result.choices
    )
    assert extra <= speed.margin * float_ms
    # The 2% stop: no evaluation follows a passing step that shrank the model by less than 2%.
    sizes = [e.weight_bytes for e in result.evaluations if e.passed]
    small = [i for i in range(1, len(sizes)) if sizes[i] > sizes[i - 1] * (1 - auto_search.MIN_STEP)]
    assert all(i == len(sizes) - 1 for i in small)


def test_a_layer_slower_than_float_everywhere_is_never_read() -> None:
    speed = SpeedFilter(_costs(int8_machine(2.0, int4_factor=1.5)), LAYERS, accuracy_level=0)
    allowed = speed.allowed(["a", "b", "unknown"], LADDER)
    assert allowed["a"] == allowed["b"] == () and speed.to_float == ["a", "b"]
    assert allowed["unknown"] == LADDER  # no costs: nothing refused


def _plan(level0: float, level4: float = 0.5) -> KernelPlan:
    costs = _costs()
    _, ranked, floats = rank_kernels(costs, list(LAYERS.values()), (64,), (0, 4))
    ranked = [
        type(r)(r.kernel, r.cost_ms, level0 if r.kernel.accuracy_level == 0 else level4) for r in ranked
    ]
    return KernelPlan(QuantizeOptions(), costs, list(LAYERS.values()), (25, 125), ranked, 1, floats, "")


@pytest.mark.parametrize(("level0", "tried"), [(0.9, True), (1.04, True), (1.2, False)])
def test_the_more_accurate_level_is_retried_only_where_it_is_not_slow(
    tmp_path: Path, level0: float, tried: bool
) -> None:
    """Below the criterion at level 4, level 0 is tried only when its MatMuls cost at most 5% more
    than float's at the model's shapes; else the plan says why and the search is left to answer."""
    path = tmp_path / "q.onnx"
    onnx.save(quantized(sequence_matmul_model(), accuracy_level=4), path)
    plan = _plan(level0)
    options = QuantizeOptions(block_size=64, accuracy_level=4)
    level = accurate_level(str(path), options, SpeedOptions(), NullProgress(), plan)
    assert (level == 0) == tried
    assert bool(plan.retry) != tried
    if not tried:
        assert "1.20x" in plan.retry and plan.to_dict()["retry"] == plan.retry


@pytest.mark.parametrize("prefer_size", [False, True])
def test_prefer_size_offers_the_search_below_the_floor_every_precision(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, prefer_size: bool
) -> None:
    """By default the mix the one pass decides when the uniform settings fall below the floor is
    kept from precisions that would slow the model on this CPU (int8 on the int8-slow machine,
    for all but the smallest layers, whose extras fit in the margin together); ``--prefer size``
    asks for the smallest model, so every layer is offered int8, as ``--auto`` is."""
    from onnx_conv2matmul.api import quantize_file
    from onnx_conv2matmul.quantize import decide
    from onnx_conv2matmul.quantize.options import resolve
    from onnx_conv2matmul.quantize.transposes import Prefer, TransposeOptions
    from onnx_conv2matmul.speed import costs as costs_module
    from onnx_conv2matmul.speed import timing
    from speed_fakes import Sessions

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # this fake machine's costs only
    kernel_clock = FakeClock()
    monkeypatch.setattr(costs_module, "_default_clock", kernel_clock)
    monkeypatch.setattr(costs_module, "timed_session", KernelMachine(kernel_clock, INT8_SLOW))
    clock = FakeClock()
    monkeypatch.setattr(timing, "_default_clock", clock)
    monkeypatch.setattr(timing, "timed_session", Sessions(clock, lambda path, length: 1.0, real=True))
    offered: list[int] = []
    real = decide.sensitivity

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = real(*args, **kwargs)
        offered.extend(sum(s.bits == 8 for s in node.options) for node in found.nodes)
        return found

    monkeypatch.setattr(decide, "sensitivity", spy)
    speed = resolve({}, bench_lengths=(64,), bench_rounds=3).speed
    transposes = TransposeOptions(Prefer.SIZE) if prefer_size else None
    report = quantize_file(
        ENCODER,
        tmp_path / "q.onnx",
        verify=VerifyOptions(lengths=(64, 97), min_cosine=0.9995),
        speed=speed,
        transposes=transposes,
    )
    assert report.accuracy["fallback"] is not None  # the uniform settings fell below: decided
    assert offered and (all(offered) if prefer_size else sum(map(bool, offered)) < len(offered) / 2)


@pytest.mark.parametrize("k", [16, 80, 128, 300])
@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, False)])
@pytest.mark.parametrize("block", [16, 64, 256])
def test_the_bytes_a_weight_takes_are_those_the_quantizer_stores(
    k: int, bits: int, symmetric: bool, block: int
) -> None:
    import numpy as np

    from onnx_conv2matmul.quantize.blockwise import block_quantize, stored_bytes

    weight = np.random.default_rng(k).standard_normal((k, 24)).astype(np.float32)
    arrays = block_quantize(weight, Setting(bits, block, symmetric))
    assert stored_bytes(k, 24, bits, block, symmetric) == sum(a.nbytes for a in arrays if a is not None)


@pytest.mark.parametrize(("ks", "block"), [((80, 96), 32), ((256, 512), 256), ((64, 64), 64)])
def test_prefer_size_quantizes_with_the_block_of_the_fewest_bytes(ks: tuple[int, int], block: int) -> None:
    """A block pads K to whole blocks, so the largest block is not always the smallest model
    (PLCMOS v2: 0.634x at block 256, 0.591x at 64); ``--prefer size`` takes the block whose
    weights take the fewest bytes at the model's shapes (the smaller on a tie), at accuracy level
    0 (level 4 changes no byte and costs accuracy)."""
    costs = _costs()
    layers = [Layer("a", ks[0], 128, (25,)), Layer("b", ks[1], 64, (25,))]
    _, ranked, floats = rank_kernels(costs, layers, (32, 128, 256), (0, 4))
    chosen = QuantizeOptions(block_size=128, accuracy_level=4)
    plan = KernelPlan(chosen, costs, layers, (25,), ranked, 1, floats, "chosen").for_size()
    assert plan.options.block_size == block and plan.options.accuracy_level == 0
    assert plan.reason.startswith(f"chosen; for the smallest model, block {block} (the fewest bytes")
