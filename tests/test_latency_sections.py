"""The latency sections of the bench and quantize reports come from one place: the timing
report's header (how the models were timed) and each Latency's own row and slower-rule."""

from __future__ import annotations

from typing import Any

from onnx_conv2matmul.quantize.kernel import SpeedOutcome
from onnx_conv2matmul.speed.timing import Latency, Mode, ModelTiming, TimingOptions, TimingReport


def _timing() -> TimingReport:
    def model(name: str, ratios: list[tuple[float, float] | None]) -> ModelTiming:
        latencies = tuple(
            Latency(n, (2.0, 1.0, 3.0), *((None, None, None) if r is None else (r[0], r[1], r[0] + 0.1)))
            for n, r in zip((8, 32), ratios, strict=True)
        )
        return ModelTiming(f"/m/{name}.onnx", name, 100, latencies, "x: float32[1, T, 4]")

    return TimingReport(
        models=(model("fp32", [None, None]), model("int4", [(1.2, 1.05), (0.9, 0.8)])),
        baseline=0,
        lengths=(8, 32),
        lengths_rule="given",
        options=TimingOptions(rounds=3, warmup=0, threads=1),
        mode=Mode.TOGETHER,
        cpu="a CPU (2 CPUs)",
    )


def test_the_quantize_reports_latency_has_the_bench_reports_header_and_rows() -> None:
    timing = _timing()
    outcome: Any = SpeedOutcome(variant=None, options=None, choice=None, timing=timing, result_index=1)  # type: ignore[arg-type]
    section = outcome.latency()
    whole = timing.to_dict()
    assert {k: section[k] for k in timing.header()} == {k: whole[k] for k in timing.header()}
    assert set(timing.header()) == {"cpu", "options", "lengths", "mode"}
    assert section["original"] == whole["models"][0]["latencies"]
    assert section["result"] == whole["models"][1]["latencies"]
    assert outcome.slower() == ["the result is slower than the original at length 8: 1.20x its latency"]


def test_measurably_slower_is_the_whole_interval_above_one() -> None:
    base, int4 = _timing().models
    assert [lat.measurably_slower for lat in int4.latencies] == [True, False]
    assert not any(lat.measurably_slower for lat in base.latencies)
    assert Latency(8, (1.0,), 1.1, None, None).measurably_slower
    assert not Latency(8, (1.0,), 1.01, 0.97, 1.05).measurably_slower
