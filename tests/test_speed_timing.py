"""speed.timing: models timed side by side, driven by a fake clock (no test depends on a time)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples
from onnx_conv2matmul.errors import InputError, ModelLoadError, ModelRunError
from onnx_conv2matmul.files.paths import model_file_bytes
from onnx_conv2matmul.speed import timing
from onnx_conv2matmul.speed.timing import Mode, TimingOptions, time_models
from onnx_conv2matmul.verify.check import VerifyOptions
from onnx_conv2matmul.verify.roles import InputSpec
from speed_fakes import FakeClock, FakeInput, Sessions, sequence_matmul_model

COSTS = {"a.onnx": 2.0, "b.onnx": 1.0, "c.onnx": 3.0}  # milliseconds per 100 frames


def _cost(path: str, length: int) -> float:
    return COSTS[Path(path).name] * length / 100


def _models(tmp_path: Path, names: tuple[str, ...] = ("a.onnx", "b.onnx")) -> list[str]:
    paths = []
    for name in names:
        path = tmp_path / name
        path.write_bytes(b"x" * 100)  # not a model: only its size is read, and the fake opens it
        paths.append(str(path))
    return paths


def _time(tmp_path: Path, **kwargs: object) -> tuple[timing.TimingReport, Sessions]:
    clock = FakeClock()
    sessions = Sessions(clock, _cost)
    names = kwargs.pop("names", ("a.onnx", "b.onnx"))
    options = kwargs.pop("options", TimingOptions(lengths=(100, 400), rounds=4, warmup=1))
    report = time_models(
        _models(tmp_path, names),  # type: ignore[arg-type]
        options,  # type: ignore[arg-type]
        clock=clock,
        session_factory=sessions,
        **kwargs,  # type: ignore[arg-type]
    )
    return report, sessions


def test_medians_and_ratios_are_those_of_the_runs(tmp_path: Path) -> None:
    report, _ = _time(tmp_path)
    a, b = report.models
    assert [lat.median_ms for lat in a.latencies] == pytest.approx([2.0, 8.0])
    assert [lat.median_ms for lat in b.latencies] == pytest.approx([1.0, 4.0])
    assert [lat.ratio for lat in a.latencies] == [None, None]  # the baseline
    assert [lat.ratio for lat in b.latencies] == pytest.approx([0.5, 0.5])
    assert b.at(400).ratio_low == pytest.approx(0.5) and b.at(400).ratio_high == pytest.approx(0.5)
    assert len(b.at(100).samples_ms) == 4
    assert report.lengths == (100, 400) and report.lengths_rule == "given"
    assert report.mode is Mode.TOGETHER


def test_another_baseline(tmp_path: Path) -> None:
    report, _ = _time(tmp_path, baseline=1)
    assert [lat.ratio for lat in report.models[0].latencies] == pytest.approx([2.0, 2.0])
    assert report.models[1].at(100).ratio is None


def test_runs_are_interleaved_in_every_order(tmp_path: Path) -> None:
    options = TimingOptions(lengths=(100,), rounds=6, warmup=2)
    _, sessions = _time(tmp_path, names=("a.onnx", "b.onnx", "c.onnx"), options=options)
    runs = [Path(path).name[0] for path, _ in sessions.runs]
    warmup, timed = runs[:6], runs[6:]
    assert warmup == ["a", "a", "b", "b", "c", "c"]
    rounds = ["".join(timed[i : i + 3]) for i in range(0, len(timed), 3)]
    assert rounds == ["abc", "acb", "bac", "bca", "cab", "cba"]


def test_lengths_interleave_within_a_round(tmp_path: Path) -> None:
    _, sessions = _time(tmp_path, options=TimingOptions(lengths=(100, 400), rounds=3, warmup=0))
    first_round = [(Path(p).name, n) for p, n in sessions.runs[:4]]
    assert first_round == [("a.onnx", 100), ("b.onnx", 100), ("a.onnx", 400), ("b.onnx", 400)]
    assert [(Path(p).name, n) for p, n in sessions.runs[4:6]] == [("b.onnx", 100), ("a.onnx", 100)]


def test_feeds_are_batch_1_with_the_length_and_the_same_values_for_every_model(tmp_path: Path) -> None:
    options = TimingOptions(lengths=(100,), rounds=3, warmup=0, synthesis=VerifyOptions(batch=4, seed=3))
    _, sessions = _time(tmp_path, options=options)
    feeds = [f for _, f in sessions.feeds]
    assert feeds[0]["audio_signal"].shape == (1, 4, 100)
    assert feeds[0]["length"].tolist() == [100]
    assert np.array_equal(feeds[0]["audio_signal"], feeds[1]["audio_signal"])


def test_threads_reach_every_session(tmp_path: Path) -> None:
    _, sessions = _time(tmp_path, options=TimingOptions(lengths=(100,), rounds=3, threads=3))
    assert {threads for _, threads in sessions.opened} == {3}


def test_models_that_do_not_fit_together_are_timed_one_at_a_time(tmp_path: Path) -> None:
    options = TimingOptions(lengths=(100, 200), rounds=3, warmup=0, memory_budget_bytes=300)
    report, sessions = _time(tmp_path, options=options)
    assert report.mode is Mode.ONE_AT_A_TIME
    assert sessions.most_alive == 1
    # once to read the inputs, then once per round
    assert [Path(p).name for p, _ in sessions.opened].count("a.onnx") == 1 + 3
    assert [lat.ratio for lat in report.models[1].latencies] == pytest.approx([0.5, 0.5])
    # a warm-up run at each length before the timed ones, even with warmup=0
    assert [n for p, n in sessions.runs[:4]] == [100, 200, 100, 200]


def test_one_at_a_time_the_baseline_stays_open_when_it_fits_beside_each_other_model(tmp_path: Path) -> None:
    """Three models of 100 bytes (200 each in a session) in a budget of 400: not all together, but
    the baseline beside any one other. Each other model is then opened once and timed in rounds of
    its own, alternating with the baseline's, and its ratio is against those runs of the baseline.
    Before: every model, the baseline (an encoder's 2.3 GiB original) too, was opened again in
    every round, and once more to read its inputs (56 s for an encoder and two candidates)."""
    options = TimingOptions(lengths=(100, 200), rounds=3, warmup=1, memory_budget_bytes=400)
    report, sessions = _time(tmp_path, options=options, names=("a.onnx", "b.onnx", "c.onnx"))
    assert report.mode is Mode.ONE_AT_A_TIME
    assert sessions.most_alive == 2
    opened = [Path(p).name for p, _ in sessions.opened]
    assert opened.count("a.onnx") == 1  # the baseline: once, for its inputs and every round
    assert opened.count("b.onnx") == opened.count("c.onnx") == 1 + 1
    runs = [Path(p).name for p, _ in sessions.runs]
    # Warmed up once (a run at each length), then a run per length in each round beside each other.
    assert runs.count("a.onnx") == 2 + 2 * 3 * 2
    assert runs.count("b.onnx") == runs.count("c.onnx") == 2 + 3 * 2
    # b's rounds come before c's is opened: b is closed first.
    assert max(i for i, name in enumerate(runs) if name == "b.onnx") < runs.index("c.onnx")
    assert [lat.ratio for lat in report.models[1].latencies] == pytest.approx([0.5, 0.5])
    assert len(report.models[0].latencies[0].samples_ms) == 2 * 3
    # A baseline that does not fit beside another is opened in every round, as before.
    options = dataclasses.replace(options, memory_budget_bytes=399)
    report, sessions = _time(tmp_path, options=options, names=("a.onnx", "b.onnx", "c.onnx"))
    assert sessions.most_alive == 1
    assert [Path(p).name for p, _ in sessions.opened].count("a.onnx") == 1 + 3


def test_models_that_fit_stay_open_together(tmp_path: Path) -> None:
    options = TimingOptions(lengths=(100,), rounds=3, memory_budget_bytes=400)
    report, sessions = _time(tmp_path, options=options)
    assert report.mode is Mode.TOGETHER and len(sessions.opened) == 2 and sessions.most_alive == 2


def test_choose_mode() -> None:
    assert timing.choose_mode([10, 20], None) is Mode.TOGETHER
    assert timing.choose_mode([10, 20], 60) is Mode.TOGETHER
    assert timing.choose_mode([10, 20], 59) is Mode.ONE_AT_A_TIME


def test_errors(tmp_path: Path) -> None:
    clock = FakeClock()
    sessions = Sessions(clock, _cost)
    paths = _models(tmp_path)
    options = TimingOptions(lengths=(100,), rounds=3)
    with pytest.raises(InputError, match="no model"):
        time_models([], options, clock=clock, session_factory=sessions)
    with pytest.raises(InputError, match="baseline 2 out of range"):
        time_models(paths, options, baseline=2, clock=clock, session_factory=sessions)
    with pytest.raises(InputError, match="1 labels for 2 models"):
        time_models(paths, options, labels=["x"], clock=clock, session_factory=sessions)
    unknown = dataclasses.replace(options, synthesis=VerifyOptions(dims={"frames": 3}))
    with pytest.raises(InputError, match="unknown dim 'frames'"):
        time_models(paths, unknown, clock=clock, session_factory=sessions)
    sessions.fail_open.add(paths[1])
    with pytest.raises(ModelLoadError, match=r"cannot load .*b.onnx: cannot open .*b.onnx$"):
        time_models(paths, options, clock=clock, session_factory=sessions)
    sessions.fail_open.clear()
    sessions.fail_run.add(paths[0])
    with pytest.raises(ModelRunError, match=r"a.onnx at length 100 \(audio_signal\[1, 4, 100\], .*mismatch"):
        time_models(paths, options, clock=clock, session_factory=sessions)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": ()}, "positive"),
        ({"lengths": (0,)}, "positive"),
        ({"rounds": 2}, "at least 3"),
        ({"warmup": -1}, ">= 0"),
        ({"threads": -1}, ">= 0"),
        ({"synthesis": VerifyOptions(feeds=({"x": np.zeros(1)},))}, "real inputs"),
    ],
)
def test_bad_options(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TimingOptions(**kwargs)  # type: ignore[arg-type]


def test_default_lengths_follow_the_inputs() -> None:
    encoder = [InputSpec("audio_signal", np.float32, ["B", 128, "T"]), InputSpec("length", np.int64, ["B"])]
    image = [InputSpec("pixels", np.float32, ["N", 3, "H", "W"])]
    joint = [InputSpec("enc", np.float32, ["B", 1024, "T"]), InputSpec("targets", np.int32, ["B", "U"])]
    options = VerifyOptions()
    assert timing.default_lengths(encoder, options)[0] == timing.DEFAULT_LENGTHS
    assert timing.default_lengths(image, options)[0] == timing.IMAGE_LENGTHS
    lengths, rule = timing.default_lengths(joint, options)
    assert lengths == timing.SEVERAL_DIMS_LENGTHS and "T, U" in rule
    # one of the two fixed: a single length dim again
    assert timing.default_lengths(joint, VerifyOptions(dims={"U": 1}))[0] == timing.DEFAULT_LENGTHS


def test_default_lengths_are_the_baselines(tmp_path: Path) -> None:
    report, sessions = _time(tmp_path, options=TimingOptions(rounds=3, warmup=0))
    assert report.lengths == timing.DEFAULT_LENGTHS and report.lengths_rule.startswith("default")
    assert {n for _, n in sessions.runs} == set(timing.DEFAULT_LENGTHS)


def test_other_inputs_are_reported(tmp_path: Path) -> None:
    clock = FakeClock()
    paths = _models(tmp_path)
    other = [FakeInput("audio_signal", "tensor(float)", ["batch", 8, "time"])]
    sessions = Sessions(clock, _cost, inputs={paths[1]: other})
    report = time_models(
        paths, TimingOptions(lengths=(100,), rounds=3), clock=clock, session_factory=sessions
    )
    assert report.models[0].inputs != report.models[1].inputs
    assert "audio_signal: float32['batch', 8, 'time']" in report.models[1].inputs


@settings(max_examples=examples(25), deadline=None)
@given(
    costs=st.lists(st.floats(0.5, 50), min_size=2, max_size=2),
    noise=st.lists(st.floats(0, 0.2), min_size=10, max_size=10),
)
def test_ratio_and_interval_bracket_the_true_ratio(costs: list[float], noise: list[float]) -> None:
    """With the same noise on both models in a round, the ratio is the true ratio within the noise."""
    ref = [costs[0] * (1 + x) for x in noise]
    cand = [costs[1] * (1 + x) for x in noise]
    low, high = timing.ratio_interval(ref, cand)
    truth = costs[1] / costs[0]
    assert low <= high
    assert truth / 1.2 <= low <= truth * 1.2 and truth / 1.2 <= high <= truth * 1.2
    assert timing.ratio_interval(ref, cand) == (low, high)  # seeded


def test_ratio_interval_needs_rounds() -> None:
    with pytest.raises(ValueError, match="rounds"):
        timing.ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="rounds"):
        timing.ratio_interval([], [])


def test_run_order_rotates_beyond_five_models() -> None:
    assert timing.run_order(0, 2) == (0, 1) and timing.run_order(1, 2) == (1, 0)
    assert timing.run_order(2, 7) == (2, 3, 4, 5, 6, 0, 1)


def test_latency_statistics() -> None:
    latency = timing.Latency(1, (4.0, 1.0, 3.0, 2.0, 10.0))
    assert (latency.median_ms, latency.min_ms, latency.max_ms) == (3.0, 1.0, 10.0)
    assert (latency.q1_ms, latency.q3_ms) == (2.0, 4.0)
    assert latency.to_dict()["ratio_interval"] is None


def test_model_file_bytes_counts_external_data(tmp_path: Path) -> None:
    model = sequence_matmul_model(k=256, n=256)
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    expected = path.stat().st_size + (tmp_path / "m.onnx.data").stat().st_size
    assert model_file_bytes(str(path)) == expected
    garbage = tmp_path / "g.onnx"
    garbage.write_bytes(b"not a model")
    assert model_file_bytes(str(garbage)) == len(b"not a model")
    assert model_file_bytes(str(tmp_path / "missing.onnx")) == 0
    # Tensors sharing one data file count it once; a legacy exporter's file per tensor each count.
    per_tensor = tmp_path / "legacy"
    per_tensor.mkdir()
    onnx.save(
        sequence_matmul_model(k=256, n=256),
        per_tensor / "m.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=False,
        size_threshold=0,
    )
    files = sorted(per_tensor.iterdir())
    assert len(files) > 2
    assert model_file_bytes(str(per_tensor / "m.onnx")) == sum(f.stat().st_size for f in files)


def test_real_sessions_do_not_spin_nor_hold_a_memory_pattern(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(sequence_matmul_model(), path)
    session = timing.timed_session(str(path), 1)
    options = session.get_session_options()  # type: ignore[attr-defined]
    assert options.get_session_config_entry(timing.SPINNING_KEY) == "0"
    assert options.intra_op_num_threads == 1
    assert not options.enable_mem_pattern


def test_real_models_end_to_end(tmp_path: Path) -> None:
    """With onnxruntime and the real clock: only the shape of the report is checked."""
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"m{seed}.onnx"
        onnx.save(sequence_matmul_model(seed=seed), path)
        paths.append(str(path))
    report = time_models(paths, TimingOptions(lengths=(8, 16), rounds=3, warmup=1, threads=1))
    assert [len(m.latencies) for m in report.models] == [2, 2]
    assert all(lat.min_ms > 0 for m in report.models for lat in m.latencies)
    data = report.to_dict()
    assert data["lengths"] == {"used": [8, 16], "rule": "given"} and data["cpu"]
    assert data["models"][1]["latencies"][0]["ratio"] > 0


def test_the_default_budget_never_holds_the_original_and_its_candidates_together_when_large() -> None:
    from onnx_conv2matmul.speed.timing import Mode, choose_mode, default_budget

    gib = 2**30
    encoder = [int(2.4 * gib), *[int(0.35 * gib)] * 6]  # fp32 and six int4 candidates
    assert choose_mode(encoder, default_budget(encoder, available_bytes=20 * gib)) is Mode.ONE_AT_A_TIME
    small = [4 * 2**20, *[2**20] * 6]  # a few MiB: kept together
    assert choose_mode(small, default_budget(small, available_bytes=20 * gib)) is Mode.TOGETHER
    # never more than a share of what is available
    assert default_budget([10 * gib], available_bytes=4 * gib) < 4 * gib
    assert default_budget([int(2.4 * gib)], available_bytes=None) == int(1.2 * 2 * int(2.4 * gib))


@pytest.mark.parametrize("mode_budget", [None, 150])  # together, and one at a time (2 x 100 bytes each)
def test_timing_settles_once_every_ratio_is_known(tmp_path: Path, mode_budget: int | None) -> None:
    """A result clearly faster than the baseline stops after ``settle_after`` rounds; one whose
    ratio wobbles around 1 takes every round."""
    steady = TimingOptions(
        lengths=(100,), rounds=10, warmup=1, settle_after=5, memory_budget_bytes=mode_budget
    )
    report, _ = _time(tmp_path, options=steady)
    assert len(report.models[1].at(100).samples_ms) == 5
    assert report.options.to_dict()["settle_after"] == 5
    draws = np.random.default_rng(0)

    def wobbly(path: str, length: int) -> float:
        return 1.0 if Path(path).name == "a.onnx" else float(draws.choice([0.6, 1.5]))

    clock = FakeClock()
    noisy = time_models(_models(tmp_path), steady, clock=clock, session_factory=Sessions(clock, wobbly))
    assert len(noisy.models[1].at(100).samples_ms) == 10


def test_settled_needs_a_side_of_one_or_a_narrow_interval() -> None:
    from onnx_conv2matmul.speed.latency import settled

    assert settled([10.0] * 5, [5.0, 5.1, 4.9, 5.0, 5.2])  # faster, known
    assert settled([10.0] * 5, [10.0, 10.1, 9.9, 10.0, 10.1])  # within 5% of 1
    assert not settled([10.0] * 5, [7.0, 13.0, 9.0, 12.0, 8.0])  # could be either
    with pytest.raises(ValueError, match="3 rounds"):
        TimingOptions(settle_after=2)
