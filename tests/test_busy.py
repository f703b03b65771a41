"""Timings on a busy machine choose nothing (issue 42, item 3): the share of this process's CPUs
that other processes use is measured while anything is timed (speed/machine.CpuWait); from 20% the
kernel choice keeps the most accurate setting, the search is offered every setting, the
Transposes' trade weighs the layouts as untimed, and no timing is cached. The load is faked here
(the meter's readings stubbed), so no test depends on the machine's own load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from onnx_conv2matmul.quantize.speed_objective import SpeedFilter
from onnx_conv2matmul.speed import costs as costs_module
from onnx_conv2matmul.speed import machine
from onnx_conv2matmul.speed import timing as timing_module
from onnx_conv2matmul.speed.costs import Kernel, KernelCosts
from onnx_conv2matmul.speed.machine import BUSY_WAIT_SHARE, CpuWait
from speed_fakes import FakeClock, KernelMachine, int8_machine
from test_speed_costs import LAYERS, _node
from test_transposes import Prefer, _run


class _Loaded(CpuWait):
    """A meter that reads a busy machine (``share``), whatever the clock."""

    share_seen = 0.5

    def __exit__(self, *_: object) -> None:
        self.share, self.capacity, self.others = self.share_seen, 1.0, self.share_seen


def test_the_share_is_what_other_processes_used_of_this_ones_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 CPUs over 0.5 s of wall time: 1 CPU-second; they were busy 0.8 s of it, 0.3 s this
    # process's own: others used 0.5 of it.
    readings = iter([(10.0, 1.0, 2), (10.8, 1.3, 2)])
    clock = iter([100.0, 100.5])
    monkeypatch.setattr(machine, "_readings", lambda: next(readings))
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    with CpuWait() as wait:
        pass
    assert wait.share == pytest.approx(0.5) and wait.capacity == pytest.approx(1.0) and wait.busy
    with CpuWait(enabled=False) as off:
        pass
    assert off.share is None and not off.busy


def test_the_share_is_measured_where_the_system_says() -> None:
    import time

    with CpuWait() as wait:  # long enough for the share to be known (MIN_CAPACITY_S)
        end = time.perf_counter() + machine.MIN_CAPACITY_S
        while time.perf_counter() < end:
            sum(i * i for i in range(10_000))
    if machine._readings() is None:
        pytest.skip("this system does not give /proc/stat")
    assert wait.share is not None and 0.0 <= wait.share <= 1.0


class _Ticks(CpuWait):
    """A meter over a block of 5 ms on 2 CPUs that reads others' use a whole 10 ms clock tick
    early or late by turns: +1 tick, then -1 tick (the system's counts are in ticks)."""

    turn = 0

    def __exit__(self, *_: object) -> None:
        _Ticks.turn += 1
        self.capacity, self.others = 0.01, 0.01 if _Ticks.turn % 2 else -0.01
        self.share = CpuWait.share_of(self.others, self.capacity)


def test_short_blocks_are_added_up_before_the_share_is_clipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shape's timing is one short block whose reading is a tick off either way by chance:
    clipped block by block that reads 50% busy (the ones at 100%, the others at 0); added up, 0."""
    monkeypatch.setattr(costs_module, "CpuWait", _Ticks)
    clock = FakeClock()
    costs = KernelCosts(None, clock=clock, session_factory=KernelMachine(clock, int8_machine(3.0)))
    for n in range(16, 16 + 2 * 60, 2):  # 60 blocks: 0.6 CPU-second, enough to be known
        costs.measure(64, n, Kernel(4, 64, 0), [25])
    assert costs.waited == 0.0 and not costs.busy


def test_a_share_over_too_short_a_span_is_not_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four blocks of 5 ms, each read a tick busy: 100% others, over 0.04 CPU-second, less than
    the counters can tell (a quiet machine's small model read 10-20% busy so): not known, trusted."""
    monkeypatch.setattr(costs_module, "CpuWait", _Ticks)
    _Ticks.turn = 0
    clock = FakeClock()
    costs = KernelCosts(None, clock=clock, session_factory=KernelMachine(clock, int8_machine(3.0)))
    for n in (16, 48, 80, 112):
        _Ticks.turn = 0  # +1 tick each time
        costs.measure(64, n, Kernel(4, 64, 0), [25])
    assert costs.waited is None and not costs.busy
    assert CpuWait.share_of(0.01, 0.04) is None
    assert CpuWait.share_of(0.3, machine.MIN_CAPACITY_S) == pytest.approx(0.6)


def _busy_costs(monkeypatch: pytest.MonkeyPatch, path: Path) -> KernelCosts:
    monkeypatch.setattr(costs_module, "CpuWait", _Loaded)
    clock = FakeClock()
    return KernelCosts(str(path), clock=clock, session_factory=KernelMachine(clock, int8_machine(3.0)))


def test_timings_on_a_busy_machine_are_used_but_not_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "costs.json"
    costs = _busy_costs(monkeypatch, cache)
    assert costs.cost(64, 128, Kernel(4, 64, 0), 25) > 0 and costs.measured == 1
    assert costs.busy and costs.waited == pytest.approx(0.5)
    costs.save()
    assert json.loads(cache.read_text())["costs"] == {}


def test_a_busy_machine_drops_no_setting_from_the_search(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    costs = _busy_costs(monkeypatch, tmp_path / "costs.json")
    node = _node()
    ladder = list(node.options)
    hook = SpeedFilter(costs, {layer.name: layer for layer in LAYERS}, accuracy_level=0)
    hook([node])
    assert list(node.options) == ladder and hook.busy and not hook.dropped
    assert "busy" in hook.summary() and hook.to_dict()["busy"] is True


def test_a_busy_machine_keeps_the_most_accurate_kernel_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On this fake machine block 128 is the cheaper; timed on a busy machine, block 32 is kept."""
    clock = FakeClock()
    cheap_blocks = KernelMachine(clock, int8_machine(3.0))  # larger blocks a little cheaper
    quiet = _planned(KernelCosts(None, clock=clock, session_factory=cheap_blocks))
    assert quiet.options.block_size == 128 and "busy" not in quiet.reason
    monkeypatch.setattr(costs_module, "CpuWait", _Loaded)
    busy = _planned(KernelCosts(None, clock=clock, session_factory=cheap_blocks))
    assert busy.options.block_size == 32 and "the machine was busy" in busy.reason
    assert busy.to_dict()["others_cpu_share"] == pytest.approx(0.5)


def _planned(costs: KernelCosts, blocks: tuple[int, ...] = (32, 128)) -> Any:
    import onnx_ir as ir

    from onnx_conv2matmul.quantize.kernel_plan import plan_kernels
    from onnx_conv2matmul.quantize.options import QuantizeOptions
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.speed.timing import TimingOptions
    from onnx_conv2matmul.verify.check import VerifyOptions

    source = Path(__file__).parent / "data" / "conformer_small.onnx"
    speed = SpeedOptions(TimingOptions(lengths=(16,)), levels=(0,), block_sizes=blocks, cache=False)
    return plan_kernels(
        str(source), ir.load(str(source)), QuantizeOptions(), speed, VerifyOptions(), costs=costs
    )


@pytest.mark.parametrize("holds", [True, False], ids=["confirmed", "not-confirmed"])
def test_a_faster_but_less_accurate_setting_must_win_twice(holds: bool) -> None:
    """Block 128 is timed cheaper than block 32; timed again (fresh sessions), it is kept only when
    it is cheaper again, else block 32, the most accurate, is."""
    clock = FakeClock()
    base = int8_machine(3.0)

    def cost(key: str, k: int, n: int, rows: int) -> float:
        again = machine.opened.count(f"{key}-{k}x{n}.onnx") > 1
        return base(key, k, n, rows) * (1.5 if key.startswith("int4-b128") and again and not holds else 1.0)

    machine = KernelMachine(clock, cost)
    plan = _planned(KernelCosts(None, clock=clock, session_factory=machine))
    assert plan.options.block_size == (128 if holds else 32)
    assert (": confirmed" if holds else ": not confirmed, the most accurate setting is kept") in plan.reason
    assert "timed again" in plan.reason


@pytest.mark.parametrize(
    ("again_128", "again_32", "kept"),
    [(0.8, 0.9, 128), (0.9, 0.9, 32), (1.0, 1.0, 16)],
    ids=["winner confirmed", "the one it replaced kept", "most accurate kept"],
)
def test_the_winner_must_beat_the_setting_it_replaced_again(
    again_128: float, again_32: float, kept: int
) -> None:
    """Timed once, block 32 beats block 16 by 10% and block 128 beats block 32 by 11%. Timed
    again, block 128 must beat block 32 again to be kept (beating block 16 is not enough); else
    block 32, when it beats block 16 again; else block 16."""
    clock = FakeClock()
    first = {"b16": 1.0, "b32": 0.9, "b128": 0.8}
    second = {"b16": 1.0, "b32": again_32, "b128": again_128}

    def cost(key: str, k: int, n: int, rows: int) -> float:
        base = k * n * rows / 1e6
        if key == "float":
            return base
        table = second if machine.opened.count(f"{key}-{k}x{n}.onnx") > 1 else first
        return base * 0.5 * table[key.split("-")[1]]

    machine = KernelMachine(clock, cost)
    plan = _planned(KernelCosts(None, clock=clock, session_factory=machine), blocks=(16, 32, 128))
    assert plan.options.block_size == kept
    assert "block 128 level 0 timed again" in plan.reason and "the setting it replaced" in plan.reason
    assert (": not confirmed" not in plan.reason) is (kept == 128)
    assert ("block 32 level 0 is kept" in plan.reason) is (kept == 32)
    assert ("the most accurate setting is kept" in plan.reason) is (kept == 16)


def test_a_busy_machine_weighs_the_layouts_as_untimed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Quiet, the model with the Transposes (1.05x, smaller) is kept; busy, the one without them
    (adds no Transposes), and the reason says why."""
    monkeypatch.setattr(timing_module, "CpuWait", _Loaded)
    data = _run(tmp_path, Prefer.BALANCED, 1.05)
    trade = data["transposes"]
    assert isinstance(trade, dict) and trade["kept"] == "without them"
    assert trade["reason"].startswith("timed on a busy machine, not used (the machine was busy")
    assert "not used" in trade["timed_on"]
    without, with_ = trade["models"]
    assert with_["latency_ratios"]  # shown, not used
    assert without["as_original"] and without["latency_ratios"] is None  # the original's graph: not timed
    assert _Loaded.share_seen >= BUSY_WAIT_SHARE


def test_a_latency_timed_on_a_busy_machine_says_so_and_decides_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    monkeypatch.setattr(timing_module, "CpuWait", _Loaded)
    encoder = Path(__file__).parent / "data" / "conformer_small.onnx"
    report = tmp_path / "r.json"
    args = [
        "quantize",
        str(encoder),
        str(tmp_path / "q.onnx"),
        "--bench-rounds",
        "3",
        "--report-json",
        str(report),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["latency"] is not None
    busy = [w for w in data["warnings"] if "the latency was measured on a busy machine" in w]
    assert busy and not any("the result is slower than the original" in w for w in data["warnings"])
    assert data["kernel_choice"] is None  # no other level timed because of it
