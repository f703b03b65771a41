"""The quantize run's seconds split by phase and the phase shown in front of each progress step
(quantize/phases.py), with a fake clock; the report's field on a real run (its keys, never its
times)."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx_conv2matmul.api import quantize_file
from onnx_conv2matmul.quantize.plan import PHASES, PhaseTimer, phase_of
from onnx_conv2matmul.verify.check import VerifyOptions
from speed_fakes import FakeClock

DATA = Path(__file__).parent / "data"


class Recorder:
    def __init__(self) -> None:
        self.steps: list[str] = []
        self.closed = False

    def phase(self, name: str) -> None:
        self.steps.append(name)

    def advance(self, done: int, total: int) -> None:
        self.steps.append(f"{done}/{total}")

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("step", "phase"),
    [
        ("Rewriting", "rewrite"),
        ("Kernel choice: timing each weight shape", "kernel choice"),
        ("Quantizing with block 128", "kernel choice"),
        ("Quantizing", "quantize"),
        ("Evaluating configuration 2 of at most 8", "search"),
        ("Measuring accuracy", "check"),
        ("Timing the result against the original", "timing"),
        ("Timing: proving the inputs the original runs at", "timing"),
        ("Saving", "save"),
        ("Something new", "other"),
    ],
)
def test_each_step_has_its_phase(step: str, phase: str) -> None:
    assert phase_of(step) == phase


def test_seconds_add_up_by_phase_and_steps_show_their_phase() -> None:
    clock = FakeClock()
    inner = Recorder()
    timer = PhaseTimer(inner, clock)
    clock.now = 1.0  # before the first step: counted nowhere
    for step, seconds in [
        ("Rewriting", 2.0),
        ("Quantizing", 5.0),
        ("Saving", 1.0),
        ("Measuring accuracy", 3.0),
    ]:
        timer.phase(step)
        clock.now += seconds
    timer.phase("Quantizing with block 256")
    timer.advance(1, 4)
    clock.now += 4.0
    timer.close()
    assert timer.by_phase() == {
        "rewrite": 2.0,
        "kernel choice": 4.0,
        "quantize": 5.0,
        "save": 1.0,
        "check": 3.0,
    }
    assert list(timer.by_phase()) == [p for p, _ in PHASES if p in timer.by_phase()]
    assert inner.steps[:2] == ["Rewriting", "Quantizing"]  # passed on as they are
    assert "1/4" in inner.steps and inner.closed


def test_the_report_splits_its_seconds(tmp_path: Path) -> None:
    report = quantize_file(
        DATA / "conformer_small.onnx", tmp_path / "q.onnx", verify=VerifyOptions(lengths=(64, 97))
    )
    phases = report.seconds_by_phase
    assert {"rewrite", "quantize", "save", "check", "publish"} <= set(phases)
    assert sum(phases.values()) <= report.seconds + 0.01
    assert report.to_dict()["seconds_by_phase"] == phases
