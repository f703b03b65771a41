"""Kernel costs at the model's weight shapes (speed/costs.py) and what the search and the kernel
choice make of them (quantize/speed_objective.py), on fake machines: a fake clock and fake
sessions whose runs cost what the test says, so no test depends on how fast anything runs."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_conv2matmul.quantize.options import Setting
from onnx_conv2matmul.quantize.sensitivity import MatMulNode
from onnx_conv2matmul.quantize.speed_objective import SpeedFilter, model_layers, rank_kernels
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.speed.costs import (
    FLOAT_KERNEL,
    Kernel,
    KernelCosts,
    Layer,
    cache_path,
    kernel_model,
    model_cost,
)
from onnx_conv2matmul.verify.check import VerifyOptions
from speed_fakes import FakeClock, KernelMachine, int8_machine

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"
INT8_SLOW = int8_machine(int8_factor=3.0)
"""As measured on an AVX-512 Xeon: 8-bit MatMulNBits slower than the float MatMul."""
INT8_FAST = int8_machine(int8_factor=0.6)


def _costs(cost=INT8_SLOW, path: Path | None = None, **kwargs: object) -> tuple[KernelCosts, KernelMachine]:  # type: ignore[no-untyped-def]
    clock = FakeClock()
    machine = KernelMachine(clock, cost)
    kwargs.setdefault("min_ms", 0.0)  # the runs as given (see test_short_kernels_run_longer)
    costs = KernelCosts(
        None if path is None else str(path),
        clock=clock,
        session_factory=machine,
        **kwargs,  # type: ignore[arg-type]
    )
    return costs, machine


LAYERS = [
    Layer("a", 64, 128, (25, 125)),
    Layer("b", 128, 64, (25, 125)),
    Layer("c", 64, 128, (25, 125)),  # the shape of "a": measured once
]


def test_each_shape_is_timed_once_in_its_own_session_and_added_up(tmp_path: Path) -> None:
    costs, machine = _costs()
    total = model_cost(costs, LAYERS, Kernel(4, 64, 0))
    assert machine.opened == ["int4-b64-l0-64x128.onnx", "int4-b64-l0-128x64.onnx"]
    one = [INT8_SLOW("int4-b64-l0", 64, 128, rows) for rows in (25, 125)]
    other = [INT8_SLOW("int4-b64-l0", 128, 64, rows) for rows in (25, 125)]
    assert total == pytest.approx(tuple(2 * a + b for a, b in zip(one, other, strict=True)))
    assert costs.measured == 4  # two shapes at two row counts
    floats = model_cost(costs, LAYERS, FLOAT_KERNEL)
    assert floats == pytest.approx(tuple(3 * 64 * 128 * r / 1e6 for r in (25, 125)))


def test_the_kernels_of_a_shape_are_timed_in_interleaved_rounds() -> None:
    costs, machine = _costs(runs=4, warmup=1)
    costs.prefetch(LAYERS[:1], [FLOAT_KERNEL, Kernel(4, 64, 4)])
    timed = [key for key, rows in machine.runs if rows == 25][2:]  # after one warm-up run each
    assert timed == [
        "float",
        "int4-b64-l4",
        "int4-b64-l4",
        "float",
        "float",
        "int4-b64-l4",
        "int4-b64-l4",
        "float",
    ]
    assert costs.cost(64, 128, FLOAT_KERNEL, 125) == pytest.approx(INT8_SLOW("float", 64, 128, 125))
    assert costs.measured == 4


def test_costs_are_kept_per_machine_and_read_back(tmp_path: Path) -> None:
    from onnx_conv2matmul.speed import costs as costs_module

    path = tmp_path / "costs.json"
    costs, _machine = _costs(path=path)
    first = model_cost(costs, LAYERS, Kernel(8, 128, 4))
    costs.save()
    assert json.loads(path.read_text())["version"] == costs_module.CACHE_VERSION
    again, machine2 = _costs(path=path)
    assert model_cost(again, LAYERS, Kernel(8, 128, 4)) == first
    assert machine2.opened == [] and again.measured == 0 and again.from_cache > 0
    # Nothing timed since it was read, or since the last save: nothing written.
    written = path.stat().st_mtime_ns
    path.write_text(path.read_text() + " ")
    marked = path.read_text()
    again.save()
    costs.save()
    assert path.read_text() == marked and path.stat().st_mtime_ns >= written
    ignored, machine3 = _costs(path=path, read_cache=False)  # --no-bench-cache
    model_cost(ignored, LAYERS, Kernel(8, 128, 4))
    assert len(machine3.opened) == 2
    path.write_text(json.dumps({"version": 1, "costs": json.loads(marked)["costs"]}))  # an older version's
    older, machine5 = _costs(path=path)
    model_cost(older, LAYERS, Kernel(8, 128, 4))
    assert len(machine5.opened) == 2, "an older version's costs are measured again"
    path.write_text("{not json")
    broken, machine4 = _costs(path=path)
    model_cost(broken, LAYERS, Kernel(8, 128, 4))
    assert len(machine4.opened) == 2, "a damaged cache is measured again"


def test_the_cache_lives_in_the_xdg_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import onnxruntime as ort

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = Path(cache_path())
    assert path.parent == tmp_path / "onnx-conv2matmul" / "kernel-costs"
    assert ort.__version__.replace("+", "_") in path.name
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Path(cache_path()).is_relative_to(tmp_path / "home" / ".cache" / "onnx-conv2matmul")


@pytest.mark.parametrize("kernel", [FLOAT_KERNEL, Kernel(4, 32, 0), Kernel(8, 64, 4), Kernel(4, 256, 4)])
def test_kernel_models_compute_x_times_their_weight(kernel: Kernel) -> None:
    """The timed models are real: onnxruntime runs them at any row count."""
    import onnxruntime as ort

    model = kernel_model(96, 40, kernel)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for rows in (1, 7):
        (y,) = session.run(None, {"x": np.ones((rows, 96), np.float32)})
        assert y.shape == (rows, 40) and np.isfinite(y).all()


def test_rank_kernels_takes_the_cheapest_unless_the_gain_is_small() -> None:
    costs, _ = _costs()
    steps, ranked, _floats = rank_kernels(costs, LAYERS, (64, 128, 256), (0, 4), min_gain=0.02)
    winner = steps[-1]
    assert [(r.kernel.block_size, r.kernel.accuracy_level) for r in ranked][winner] == (256, 4)
    assert all(r.relative < 1 for r in ranked)  # 4 bits beat float on this machine
    # a min_gain larger than any difference keeps the most accurate (the first)
    steps, _, _ = rank_kernels(costs, LAYERS, (64, 128, 256), (0, 4), min_gain=0.5)
    assert steps == [0]


def _node(name: str = "a") -> MatMulNode:
    node = MatMulNode(name, None, 64, 128, 64 * 128 * 4)
    node.options = {
        Setting(4, 128, True): (0.02, 1000),
        Setting(4, 32, False): (0.01, 1500),
        Setting(8, 64, True): (0.0001, 2200),
    }
    return node


def test_int8_slow_machine_offers_no_8_bits_and_says_why() -> None:
    costs, _ = _costs(INT8_SLOW)
    speed = SpeedFilter(costs, {layer.name: layer for layer in LAYERS}, accuracy_level=4)
    node = _node()
    speed([node])
    assert [s.bits for s in node.options] == [4, 4]
    # a layer that cannot stay 4-bit goes to float: more accuracy than 4 bits is float's
    assert node.choose(1e9)[0].bits is None
    assert speed.dropped == {"int8 block 64 symmetric": ["a"]}
    assert "int8 block 64 symmetric on 1 layers" in speed.summary()


def test_int8_fast_machine_keeps_8_bits() -> None:
    costs, _ = _costs(INT8_FAST)
    speed = SpeedFilter(costs, {layer.name: layer for layer in LAYERS}, accuracy_level=4)
    node = _node()
    speed([node])
    assert [s.bits for s in node.options] == [4, 4, 8]
    assert node.choose(1e6)[0].bits == 8 and not speed.dropped


def test_a_layer_slower_than_float_in_every_setting_stays_float() -> None:
    costs, _ = _costs(int8_machine(int8_factor=2.0, int4_factor=1.5))
    speed = SpeedFilter(costs, {"a": LAYERS[0]}, accuracy_level=0)
    node = _node()
    speed([node])
    assert node.options == {} and speed.to_float == ["a"]
    assert node.choose(0.0)[0].bits is None


def test_a_setting_within_the_margin_stays() -> None:
    """4 bits at 1.03x float: within the 5% margin, so the smaller model is kept."""
    costs, _ = _costs(int8_machine(int8_factor=3.0, int4_factor=1.03 / (1 - 128 / 2048)))
    speed = SpeedFilter(costs, {"a": LAYERS[0]}, accuracy_level=0, margin=0.05)
    node = _node()
    speed([node])
    assert Setting(4, 128, True) in node.options


def test_a_large_kernel_is_timed_at_fewer_rows_and_scaled_up() -> None:
    """A CTC head (120 x 18,710) at 1,500 rows would hold 112 MB of output in each session: it is
    timed at the rows that fit in MAX_TIMED_VALUES and its cost scaled by the rows; a small shape
    is timed at its own rows."""
    from onnx_conv2matmul.speed.costs import MAX_TIMED_VALUES, timed_rows

    costs, machine = _costs()
    head = costs.cost(120, 18710, FLOAT_KERNEL, 1500)
    timed = timed_rows(120, 18710, 1500)
    assert timed == MAX_TIMED_VALUES // 18710 < 1500 and timed * 18710 <= MAX_TIMED_VALUES
    assert {rows for _, rows in machine.runs} == {timed}
    assert head == pytest.approx(120 * 18710 * 1500 / 1e6)  # the fake costs in proportion to rows
    assert costs.cost(64, 128, FLOAT_KERNEL, 25) == pytest.approx(64 * 128 * 25 / 1e6)
    assert machine.runs[-1] == ("float", 25)


def test_the_margin_bounds_the_layers_extras_together_the_largest_refused_first() -> None:
    """4 bits at 1.5x float everywhere: on a large layer that is far over the margin of the
    model's MatMuls and is refused; on a layer of 1/1000 of the time the extra fits, so the
    setting stays offered there (a difference of microseconds decides nothing), and the extras
    offered, each layer at its slowest setting, stay within the margin together."""
    costs, _ = _costs(int8_machine(int8_factor=3.0, int4_factor=1.5))
    big, small = Layer("big", 256, 256, (1000,)), Layer("small", 16, 4, (1000,))
    speed = SpeedFilter(costs, {"big": big, "small": small}, accuracy_level=0, margin=0.05)
    ladder = [Setting(4, 32, True), Setting(8, 32, True)]
    allowed = speed.allowed(["big", "small"], ladder)
    assert allowed == {"big": (), "small": tuple(ladder)} and speed.to_float == ["big"]
    floats = speed.layer_cost(big, Setting(None, 0)) + speed.layer_cost(small, Setting(None, 0))  # type: ignore[arg-type]
    worst = max(speed.layer_cost(small, s) for s in ladder) - speed.layer_cost(small, Setting(None, 0))  # type: ignore[arg-type]
    assert 0 < worst <= 0.05 * floats
    assert speed.dropped == {"int4 block 32 symmetric": ["big"], "int8 block 32 symmetric": ["big"]}


def test_several_small_extras_are_refused_once_together_they_exceed_the_margin() -> None:
    """Ten equal layers, 8 bits 1.18x float on each: 1.8% of the model each, so 8 bits stays
    offered on two of them (3.6%) and is refused on the eight others, in name order (equal
    extras). Offered 4 bits too (0.5x float), a layer refused 8 bits counts at 4 bits, whose
    saving pays for the others' 8 bits: two refusals are then enough."""
    costs, _ = _costs(int8_machine(int8_factor=1.2, int4_factor=0.5))
    layers = {f"l{i}": Layer(f"l{i}", 64, 64, (100,)) for i in range(10)}
    eight, four = Setting(8, 32, True), Setting(4, 32, True)
    speed = SpeedFilter(costs, layers, accuracy_level=0, margin=0.05)
    float_ms = speed.layer_cost(layers["l0"], Setting(None, 0))  # type: ignore[arg-type]
    share = (speed.layer_cost(layers["l0"], eight) - float_ms) / (10 * float_ms)
    allowed = speed.allowed(sorted(layers), [eight])
    kept = [name for name, settings in allowed.items() if settings]
    assert len(kept) == int(0.05 / share) == 2 and kept == ["l8", "l9"]
    assert speed.to_float == [f"l{i}" for i in range(8)]
    both = SpeedFilter(costs, layers, accuracy_level=0, margin=0.05).allowed(sorted(layers), [four, eight])
    assert both["l0"] == both["l1"] == (four,) and all(both[f"l{i}"] == (four, eight) for i in range(2, 10))


def test_layers_take_their_rows_from_the_rewritten_graph(tmp_path: Path) -> None:
    model = ir.load(ENCODER)
    before = ir.serde.serialize_model(model).SerializeToString()
    rewrite_model(model, ConvertOptions(extended=True, allow_non_unit_dilation=True))
    rewritten = ir.serde.serialize_model(model).SerializeToString()
    layers = model_layers(model, (200, 1000), cache=str(tmp_path))
    assert len(layers) == len({layer.name for layer in layers}) > 0
    rows = {layer.rows for layer in layers}
    assert (25, 125) in rows  # the encoder subsamples by 8
    assert (49, 249) in rows  # relative positions: 2T - 1
    assert ir.serde.serialize_model(model).SerializeToString() == rewritten != before  # left as it was
    assert model_layers(model, (200, 1000), cache=str(tmp_path)) == layers  # read back from the cache


def _pointwise_cnn() -> ir.Model:
    """x [N, 8, H, W] -> Conv 1x1 (8 -> 16) -> Relu -> Conv 1x1 (16 -> 4): channels-last MatMuls."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, "H", "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, "H", "W"])
    weights = [
        numpy_helper.from_array(rng.standard_normal((16, 8, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((4, 16, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], name="conv1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(nodes, "cnn", [x], [y], weights)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_rewritten_convs_rows_are_its_pixels_not_the_original_nchw_rows() -> None:
    """The MatMul that replaced a 1x1 Conv runs on [N, H, W, C]: batch times pixels rows (not N*C*H,
    the rows of the original's NCHW value), at every length or at the shapes the timing feeds."""
    model = _pointwise_cnn()
    rewrite_model(model, ConvertOptions(allow_added_transposes=True))
    layers = model_layers(model, (8, 16))
    assert [(layer.k, layer.n, layer.rows) for layer in layers] == [(8, 16, (64, 256)), (16, 4, (64, 256))]
    fixed = [{"x": [1, 8, 4, length]} for length in (8, 16)]  # a height the check found fixed
    layers = model_layers(model, (8, 16), shapes=fixed)
    assert {layer.rows for layer in layers} == {(32, 64)}


def test_kernel_model_is_valid() -> None:
    onnx.checker.check_model(kernel_model(32, 16, Kernel(4, 16, 4)))


def _levels(path: str | Path) -> set[int]:
    """The accuracy levels of the model's MatMulNBits nodes."""
    return {
        next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
        for node in onnx.load(path, load_external_data=False).graph.node
        if node.op_type == "MatMulNBits"
    }


def _level_machine(level_0: float, level_4: float) -> Any:
    """Whole-model milliseconds on a fake machine: the original 10, a model whose MatMulNBits are
    at level 0 ``level_0``, at level 4 ``level_4``."""

    def cost(path: str, length: int) -> float:
        levels = _levels(path)
        if not levels:
            return 10.0
        return level_4 if 4 in levels else level_0

    return cost


_level_cost = _level_machine(5.0, 20.0)
"""Level 4 slower than the original, level 0 faster."""
_level_4_fast = _level_machine(8.0, 2.0)
"""Level 4 the fast one, level 0 a little faster than the original."""
_level_0_slow = _level_machine(20.0, 2.0)
"""Level 0 slower than the original, level 4 faster."""


def _fake_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cost: Any, kernels: bool = False) -> None:
    """Whole models timed on ``cost`` (real sessions run, a fake clock reads); with ``kernels``,
    the kernel costs on a machine whose 8-bit kernels are slow; the cache folder the test's own."""
    from onnx_conv2matmul.speed import costs as costs_module
    from onnx_conv2matmul.speed import timing
    from speed_fakes import Sessions

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # this fake machine's costs only
    if kernels:
        kernel_clock = FakeClock()
        monkeypatch.setattr(costs_module, "_default_clock", kernel_clock)
        monkeypatch.setattr(costs_module, "timed_session", KernelMachine(kernel_clock, INT8_SLOW))
    clock = FakeClock()
    monkeypatch.setattr(timing, "_default_clock", clock)
    monkeypatch.setattr(timing, "timed_session", Sessions(clock, cost, real=True))


def _auto(tmp_path: Path) -> dict[str, Any]:
    """``quantize ENCODER q.onnx --auto`` (a minimum cosine of 0.9, two evaluations, lengths 64
    and 97) through the command line: its JSON report, once it exited 0."""
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    args = ["quantize", str(ENCODER), str(tmp_path / "q.onnx"), "--auto", "--min-cosine", "0.9"]
    args += ["--max-evaluations", "2", "--verify-lengths", "64,97", "--report-json-stdout"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _checked_at_level_4(data: dict[str, Any]) -> bool:
    """Whether the report's check is that of the model at level 4: its worst cosine is the one the
    kernel choice measured for level 4."""
    level_4 = next(c for c in data["kernel_choice"]["candidates"] if c["accuracy_level"] == 4)
    worst = min(row["cosine"] for row in data["verification"]["results"] if row["cosine"] is not None)
    return bool(worst == pytest.approx(level_4["cosine"], abs=1e-6))


def test_a_default_result_slower_than_the_original_is_not_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel costs choose level 4; the whole model then measures slower than the original:
    the other level is checked and timed, and the faster one is written, with a warning."""
    from onnx_conv2matmul.api import quantize_file
    from onnx_conv2matmul.quantize.options import resolve

    _fake_machine(monkeypatch, tmp_path, _level_cost, kernels=True)
    speed = resolve({}, bench_lengths=(40, 120), bench_rounds=3).speed
    report = quantize_file(
        ENCODER, tmp_path / "q.onnx", verify=VerifyOptions(lengths=(64, 97), min_cosine=0.9), speed=speed
    )
    assert report.kernel_plan is not None
    chosen = report.kernel_plan.ranked[report.kernel_plan.winner].kernel
    assert chosen.accuracy_level == 4
    assert report.kernel_choice is not None and report.kernel_choice["accuracy_level"] == 0
    assert report.options["quantize"]["accuracy_level"] == 0
    levels = _levels(tmp_path / "q.onnx")
    assert levels == {0}
    assert any("other accuracy levels were checked and timed" in w for w in report.warnings)
    assert all(lat["ratio"] < 1 for lat in report.latency["result"])  # type: ignore[index]


def test_a_slower_result_is_timed_again_on_the_inputs_of_its_latency_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The levels of a result measured slower are timed on the inputs the original's latency line
    was timed on, at once. Before: the speed step chose them again (opening the original twice
    more) and timed silero VAD at 200 samples where its latency line and check ran at 192, 256 and
    512; and it timed the result against the original again first (11.6 s of the encoder's run)."""
    from onnx_conv2matmul.api import quantize_file
    from onnx_conv2matmul.quantize import kernel
    from onnx_conv2matmul.quantize.options import resolve
    from onnx_conv2matmul.speed import inputs

    _fake_machine(monkeypatch, tmp_path, _level_cost, kernels=True)

    def chosen_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the speed step chose its inputs again")

    monkeypatch.setattr(inputs, "proven_inputs", chosen_again)

    def timed_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the result was timed again before its other levels")

    monkeypatch.setattr(kernel, "run_speed_step", timed_again)
    speed = resolve({}, bench_rounds=3).speed
    report = quantize_file(
        ENCODER, tmp_path / "q.onnx", verify=VerifyOptions(lengths=(64, 97), min_cosine=0.9), speed=speed
    )
    assert any("other accuracy levels were checked and timed" in w for w in report.warnings)
    assert report.latency is not None
    assert report.latency["lengths"]["used"] == [200]
    assert report.latency["lengths"]["rule"].startswith("the shortest of default")


def test_a_searched_result_kept_at_another_level_is_checked_at_that_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--auto's search evaluates level 0; the speed step keeps level 4. Before: the final check
    reported the search's rows of level 0 for the model written at level 4 ("the same model")."""
    from onnx_conv2matmul.quantize.reference import SEARCHED_ROWS

    _fake_machine(monkeypatch, tmp_path, _level_4_fast)
    data = _auto(tmp_path)
    assert data["kernel_choice"]["accuracy_level"] == 4
    levels = _levels(tmp_path / "q.onnx")
    assert levels == {4}
    verification = data["verification"]
    assert verification["passed"] and SEARCHED_ROWS not in verification["warnings"]
    assert _checked_at_level_4(data)  # the rows of the model written


def test_the_speed_step_opens_the_original_once_to_prove_its_inputs_and_check_its_levels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--auto's result has its levels checked and timed: one checking session of the original
    proves the inputs timed and makes the levels' reference. Before: three (the inputs' probe,
    their proof, the reference): on the Parakeet-shaped encoder, 2.3 GiB opened each time."""
    from onnx_conv2matmul.quantize import kernel
    from onnx_conv2matmul.verify import run as runs

    _fake_machine(monkeypatch, tmp_path, _level_4_fast)
    opened: list[str] = []
    stepping: list[bool] = []
    real_session, real_step = runs.session, kernel.run_speed_step

    def session(path: str, options: Any) -> Any:
        if stepping:
            opened.append(os.path.basename(path))
        return real_session(path, options)

    def step(*args: Any, **kwargs: Any) -> Any:
        stepping.append(True)
        try:
            return real_step(*args, **kwargs)
        finally:
            stepping.clear()

    monkeypatch.setattr(runs, "session", session)
    monkeypatch.setattr(kernel, "run_speed_step", step)
    data = _auto(tmp_path)
    assert data["kernel_choice"]["accuracy_level"] == 4
    assert data["latency"]["lengths"]["used"] == [200]
    assert opened.count(ENCODER.name) == 1, opened


@pytest.mark.parametrize("search", ["kept", "finds nothing"])
def test_auto_tries_the_levels_of_its_default_candidate_only_when_it_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, search: str
) -> None:
    """--auto's default candidate, measured slower, does not check and time its other levels: the
    search's model, whose own levels are, is the one usually kept (on the Parakeet-shaped encoder
    the candidate's took 41 s of 190). When the default's model is kept, its levels are tried then."""
    from onnx_conv2matmul.errors import TargetUnreachable
    from onnx_conv2matmul.quantize import kernel, workflow
    from onnx_conv2matmul.speed import choose

    _fake_machine(monkeypatch, tmp_path, _level_0_slow)
    events: list[str] = []
    real_choose, real_quantize = choose.choose_kernel, workflow.quantize_file

    def choosing(*args: Any, **kwargs: Any) -> Any:
        events.append("levels")
        return real_choose(*args, **kwargs)

    def quantizing(src: Any, dst: Any, request: Any = None) -> Any:
        if request is not None and request.candidate and request.auto is not None:
            events.append("search")
            if search == "finds nothing":
                raise TargetUnreachable("nothing meets it (a test's search)")
        return real_quantize(src, dst, request)

    monkeypatch.setattr(choose, "choose_kernel", choosing)
    monkeypatch.setattr(kernel, "choose_kernel", choosing)
    monkeypatch.setattr(workflow, "quantize_file", quantizing)
    data = _auto(tmp_path)
    assert events == ["search", "levels"]  # the candidate's levels are not tried before the search
    assert data["kernel_choice"]["accuracy_level"] == 4
    levels = _levels(tmp_path / "q.onnx")
    assert levels == {4} and data["options"]["quantize"]["accuracy_level"] == 4
    assert all(lat["ratio"] < 1 for lat in data["latency"]["result"])
    assert data["verification"]["passed"]
    if search == "finds nothing":
        assert any("the default run's model" in w for w in data["warnings"])
        assert any("other accuracy levels were checked and timed" in w for w in data["warnings"])
        slower = [w for w in data["warnings"] if w.startswith("the result is slower")]
        assert len(slower) == 1 and "checked and timed" in slower[0]  # the level kept is not slower
        assert _checked_at_level_4(data)  # checked at the level written


def test_short_kernels_run_longer_long_ones_as_many_times_as_asked() -> None:
    """A kernel of 10 us runs until it has taken MIN_TIMED_MS (capped at MAX_RUNS); one of 10 ms
    runs DEFAULT_RUNS times: the fastest of nine runs of microseconds moved 15% between cold runs."""
    from onnx_conv2matmul.speed import costs as costs_module

    def cost(key: str, k: int, n: int, rows: int) -> float:
        return 0.01 if rows == 1 else 10.0

    costs, machine = _costs(cost, min_ms=costs_module.MIN_TIMED_MS)
    costs.prefetch([Layer("a", 64, 64, (1, 2))], [FLOAT_KERNEL])
    runs = Counter(rows for _, rows in machine.runs)
    warmup = costs_module.DEFAULT_WARMUP
    assert runs[1] == warmup + costs_module.MAX_RUNS  # 5 ms / 0.01 ms = 500, capped
    assert runs[2] == warmup + costs_module.DEFAULT_RUNS

    def middling(key: str, k: int, n: int, rows: int) -> float:
        return 0.1

    costs, machine = _costs(middling, min_ms=costs_module.MIN_TIMED_MS)
    costs.prefetch([Layer("a", 64, 64, (1,))], [FLOAT_KERNEL])
    assert len(machine.runs) == warmup + 50  # 5 ms / 0.1 ms


class _Drifting:
    """A machine whose 8-bit kernels cost ``first`` times float in the first session opened for a
    shape and ``second`` times float in any later one (a cold run's noise, then the truth)."""

    def __init__(self, first: float, second: float) -> None:
        self.first, self.second = first, second
        self.machine = KernelMachine(FakeClock(), self.cost)
        self.timed: list[str] = []

    def cost(self, key: str, k: int, n: int, rows: int) -> float:
        base = k * n * rows / 1e6
        if not key.startswith("int8"):
            return base * (1.0 if key == "float" else 0.5)
        self.timed.append(key)
        sessions = self.machine.opened.count(f"{key}-{k}x{n}.onnx")
        return base * (self.first if sessions == 1 else self.second)


def _drifting_costs(first: float, second: float) -> tuple[KernelCosts, _Drifting]:
    drift = _Drifting(first, second)
    clock = drift.machine.clock
    return KernelCosts(None, clock=clock, session_factory=drift.machine, min_ms=0.0), drift


def test_a_refusal_rests_on_a_second_timing_that_keeps_the_faster() -> None:
    """The first timing puts 8 bits at 3x float, the second at 0.9x: the faster holds, and the
    setting is offered; the entries timed twice are not timed a third time."""
    costs, drift = _drifting_costs(first=3.0, second=0.9)
    speed = SpeedFilter(costs, {layer.name: layer for layer in LAYERS}, accuracy_level=0)
    node = _node()
    speed([node])
    assert Setting(8, 64, True) in node.options and not speed.dropped
    eight = [k for k in costs.table if k.startswith("int8-b64-l0:64x128:")]
    assert eight and all(
        costs.table[k] == pytest.approx(0.9 * 64 * 128 * int(k.rsplit(":", 1)[1]) / 1e6) for k in eight
    )
    before = len(drift.timed)
    assert costs.confirm([LAYERS[0], LAYERS[2]], [Kernel(8, 64, 0)]) == 0 and len(drift.timed) == before
    assert costs.confirm(LAYERS, [Kernel(8, 64, 0)]) == 2  # layer b's shape: confirmed only now


def test_a_refusal_that_holds_on_the_second_timing_stands() -> None:
    costs, _ = _drifting_costs(first=3.0, second=2.5)
    speed = SpeedFilter(costs, {layer.name: layer for layer in LAYERS}, accuracy_level=0)
    node = _node()
    speed([node])
    assert Setting(8, 64, True) not in node.options
    assert speed.dropped == {"int8 block 64 symmetric": ["a"]}


def test_entries_read_from_the_cache_are_not_timed_again(tmp_path: Path) -> None:
    cache = tmp_path / "costs.json"
    first, _ = _costs(INT8_SLOW, path=cache)
    first.prefetch(LAYERS, [FLOAT_KERNEL, Kernel(8, 64, 0)])
    first.save()
    again, machine = _costs(INT8_SLOW, path=cache)
    assert again.confirm(LAYERS, [FLOAT_KERNEL, Kernel(8, 64, 0)]) == 0 and machine.runs == []


def test_a_tie_at_4_bits_goes_to_the_level_that_runs_8_bits_faster() -> None:
    """4 bits cost the same at levels 0 and 4; 8 bits 2.2x float at level 0 and 1.1x at level 4
    (a small BERT on an AVX-512 VNNI CPU): level 4 is taken, so the search can keep 8 bits."""
    from onnx_conv2matmul.quantize.kernel_plan import eight_bit_tie

    def cost(key: str, k: int, n: int, rows: int) -> float:
        base = k * n * rows / 1e6
        factor = {
            "float": 1.0,
            "int4-b64-l0": 1.18,
            "int4-b64-l4": 1.18,
            "int8-b64-l0": 2.2,
            "int8-b64-l4": 1.1,
        }
        return base * factor[key]

    costs, _ = _costs(cost)
    steps, ranked, _ = rank_kernels(costs, LAYERS, (64,), (0, 4), min_gain=0.02)
    winner = steps[-1]
    assert ranked[winner].kernel.accuracy_level == 0  # the 4-bit timing alone: a tie, the first
    picked, why = eight_bit_tie(costs, LAYERS, ranked, winner)
    assert ranked[picked].kernel.accuracy_level == 4 and "ties with it for 4 bits" in why

    def no_gain(key: str, k: int, n: int, rows: int) -> float:
        return cost(key, k, n, rows) if key != "int8-b64-l4" else 2.2 * k * n * rows / 1e6

    costs, _ = _costs(no_gain)
    steps, ranked, _ = rank_kernels(costs, LAYERS, (64,), (0, 4), min_gain=0.02)
    winner = steps[-1]
    assert eight_bit_tie(costs, LAYERS, ranked, winner) == (winner, "")


def test_a_tie_holds_across_the_spread_of_cold_runs() -> None:
    """PP-OCRv4 rec's figures over six cold runs: level 4's 4-bit MatMuls 1.01-1.05x level 0's, its
    8-bit ones 0.85-0.90x as long: level 4 is taken at both ends, as it was in the middle."""
    from onnx_conv2matmul.quantize.kernel_plan import eight_bit_tie

    for four, eight in ((1.01, 0.85), (1.05, 0.90), (1.05, 0.85), (1.01, 0.90)):

        def cost(key: str, k: int, n: int, rows: int, four: float = four, eight: float = eight) -> float:
            factor = {
                "float": 1.0,
                "int4-b64-l0": 1.09,
                "int4-b64-l4": 1.09 * four,
                "int8-b64-l0": 1.6,
                "int8-b64-l4": 1.6 * eight,
            }
            return k * n * rows / 1e6 * factor[key]

        costs, _ = _costs(cost)
        steps, ranked, _ = rank_kernels(costs, LAYERS, (64,), (0, 4), min_gain=0.02)
        winner = steps[-1]
        assert ranked[winner].kernel.accuracy_level == 0
        picked, why = eight_bit_tie(costs, LAYERS, ranked, winner)
        assert ranked[picked].kernel.accuracy_level == 4, (four, eight, why)


def test_added_runs_stay_within_their_budget() -> None:
    """Kernels of 10 us: the first shape timed gets the runs MIN_TIMED_MS asks for while EXTRA_MS
    lasts, a later one DEFAULT_RUNS, and so does a second timing (without the bound, CNNs with
    hundreds of small kernels took up to twice as long)."""
    from onnx_conv2matmul.speed import costs as costs_module

    def cost(key: str, k: int, n: int, rows: int) -> float:
        return 0.01

    clock = FakeClock()
    machine = KernelMachine(clock, cost)
    costs = KernelCosts(None, clock=clock, session_factory=machine, extra_ms=1.0)  # 100 runs' worth
    first, second = Layer("a", 64, 64, (1,)), Layer("b", 64, 32, (1,))
    warmup, runs, most = costs_module.DEFAULT_WARMUP, costs_module.DEFAULT_RUNS, costs_module.MAX_RUNS
    costs.prefetch([first], [FLOAT_KERNEL])
    assert len(machine.runs) == warmup + runs + 100
    costs.prefetch([second], [FLOAT_KERNEL])
    assert len(machine.runs) == 2 * (warmup + runs) + 100
    assert costs.confirm([second], [FLOAT_KERNEL]) == 1
    assert len(machine.runs) == 3 * (warmup + runs) + 100
    roomy = KernelCosts(None, clock=clock, session_factory=machine)
    before = len(machine.runs)
    roomy.prefetch([first], [FLOAT_KERNEL])
    assert len(machine.runs) - before == warmup + most


def test_a_second_timing_leaves_the_cached_rows_of_a_shape(tmp_path: Path) -> None:
    """A shape whose row count 25 came from the cache and 125 was timed here: only 125 is timed
    again (and counted)."""
    cache = tmp_path / "costs.json"
    first, _ = _costs(INT8_SLOW, path=cache)
    first.prefetch([Layer("a", 64, 128, (25,))], [FLOAT_KERNEL])
    first.save()
    again, _ = _costs(INT8_SLOW, path=cache)
    layer = Layer("a", 64, 128, (25, 125))
    again.prefetch([layer], [FLOAT_KERNEL])
    cached = again.table[again.entry(64, 128, FLOAT_KERNEL, 25)]
    assert again.confirm([layer], [FLOAT_KERNEL]) == 1
    assert again.table[again.entry(64, 128, FLOAT_KERNEL, 25)] == cached
    assert again.confirm([layer], [FLOAT_KERNEL]) == 0
