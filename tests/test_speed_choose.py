"""speed.choose and speed.bench: kernel settings chosen by measurement, with a fake timer only."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantType, quantize_dynamic

from helpers import all_nodes
from onnx_conv2matmul.speed import choose
from onnx_conv2matmul.speed.bench import bench_models, quantization_of
from onnx_conv2matmul.speed.choose import Candidate, choose_kernel, level_candidates, reference_accuracy
from onnx_conv2matmul.speed.timing import TimingOptions
from onnx_conv2matmul.verify.check import VerifyOptions
from speed_fakes import FakeClock, Sessions, quantized, sequence_matmul_model

OPTIONS = TimingOptions(lengths=(100, 400), rounds=3, warmup=0)


def _levels(model: onnx.ModelProto) -> list[int]:
    return [
        next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
        for node in all_nodes(model.graph)
        if node.op_type == "MatMulNBits"
    ]


def _files(tmp_path: Path, *names: str) -> list[str]:
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    return [str(tmp_path / name) for name in names]


def _choose(
    tmp_path: Path,
    cost: dict[str, float],
    cosine: dict[str, float],
    min_cosine: float | None = 0.99,
    **kwargs: object,
) -> tuple[choose.KernelChoice, Sessions]:
    """Candidates level 0 (l0.onnx) and level 4 (l4.onnx) of orig.onnx: ``cost`` in ms per 100
    frames by file name, ``cosine`` by file name."""
    original, l0, l4 = _files(tmp_path, "orig.onnx", "l0.onnx", "l4.onnx")
    clock = FakeClock()
    sessions = Sessions(clock, lambda path, n: cost[Path(path).name] * n / 100)
    candidates = [Candidate("accuracy level 0", l0, 0), Candidate("accuracy level 4", l4, 4)]
    result = choose_kernel(
        original,
        candidates,
        lambda path: (cosine[Path(path).name], ""),
        min_cosine=min_cosine,
        timing=OPTIONS,
        clock=clock,
        session_factory=sessions,
        **kwargs,  # type: ignore[arg-type]
    )
    return result, sessions


def test_the_faster_level_that_meets_the_target_wins(tmp_path: Path) -> None:
    result, _ = _choose(
        tmp_path, {"orig.onnx": 10, "l0.onnx": 9, "l4.onnx": 7}, {"l0.onnx": 0.995, "l4.onnx": 0.994}
    )
    assert result.chosen.candidate.accuracy_level == 4
    assert result.chosen.speed == pytest.approx(0.7)
    assert result.candidates[0].speed == pytest.approx(0.9)
    assert "accuracy level 4 meets the accuracy target" in result.reason and "0.700x" in result.reason
    assert not result.warnings
    data = result.to_dict()
    assert data["winner"] == "accuracy level 4" and data["accuracy_level"] == 4
    assert [c["cosine"] for c in data["candidates"]] == [0.995, 0.994]
    assert data["original"]["latencies"][0]["median_ms"] == pytest.approx(10.0)


def test_a_gain_within_min_gain_keeps_the_first(tmp_path: Path) -> None:
    cost = {"orig.onnx": 10, "l0.onnx": 8, "l4.onnx": 7.9}
    result, _ = _choose(tmp_path, cost, {"l0.onnx": 0.995, "l4.onnx": 0.994})
    assert result.chosen.candidate.accuracy_level == 0
    assert "must be 2% faster" in result.reason
    result, _ = _choose(tmp_path, cost, {"l0.onnx": 0.995, "l4.onnx": 0.994}, min_gain=0.0)
    assert result.chosen.candidate.accuracy_level == 4


def test_a_faster_level_below_the_target_is_not_timed(tmp_path: Path) -> None:
    result, sessions = _choose(
        tmp_path, {"orig.onnx": 10, "l0.onnx": 9, "l4.onnx": 5}, {"l0.onnx": 0.995, "l4.onnx": 0.98}
    )
    assert result.chosen.candidate.accuracy_level == 0
    assert result.candidates[1].latencies is None and not result.candidates[1].meets_target
    assert "l4.onnx" not in {Path(p).name for p, _ in sessions.opened}
    assert "below the target: accuracy level 4 (cosine 0.98000)" in result.reason


@pytest.mark.parametrize(
    ("cosine", "timed"),
    [
        ({"l0.onnx": 0.995, "l4.onnx": 0.98}, False),  # one meets it: nothing to choose by speed
        ({"l0.onnx": 0.95, "l4.onnx": 0.96}, False),  # none does: the most accurate, untimed
        ({"l0.onnx": 0.995, "l4.onnx": 0.994}, True),  # two do: timed to choose
    ],
)
def test_a_caller_that_times_the_result_after_has_only_a_choice_timed(
    tmp_path: Path, cosine: dict[str, float], timed: bool
) -> None:
    """The Transposes' trade times both layouts against the original after: each layout's own
    kernel step times its candidates only when speed has a choice to make among them."""
    cost = {"orig.onnx": 10, "l0.onnx": 9, "l4.onnx": 7}
    result, sessions = _choose(tmp_path, cost, cosine, time_one=False)
    assert bool(sessions.opened) is timed
    assert (result.timing is not None) is timed and (result.original is not None) is timed
    assert result.chosen.candidate.accuracy_level == (4 if timed else 0 if cosine["l0.onnx"] > 0.99 else 4)
    assert all((r.latencies is not None) is (timed and r.meets_target) for r in result.candidates)
    data = result.to_dict()
    assert (data["cpu"] is None) is not timed
    if not timed:
        assert "runs at" not in result.reason
    again, _ = _choose(tmp_path, cost, cosine)  # a caller that does not time after: always timed
    assert again.timing is not None


def test_no_candidate_meets_the_target(tmp_path: Path) -> None:
    result, _ = _choose(
        tmp_path, {"orig.onnx": 10, "l0.onnx": 9, "l4.onnx": 5}, {"l0.onnx": 0.95, "l4.onnx": 0.96}
    )
    assert result.chosen.candidate.accuracy_level == 4
    assert "most accurate" in result.reason
    assert any("no candidate meets" in w for w in result.warnings)
    assert all(c.latencies is not None for c in result.candidates)  # all timed, for the report


def test_a_winner_slower_than_the_original_is_warned_about(tmp_path: Path) -> None:
    cost = {"orig.onnx": 10, "l0.onnx": 12, "l4.onnx": 11}
    result, _ = _choose(tmp_path, cost, {"l0.onnx": 0.995, "l4.onnx": 0.995})
    assert result.chosen.candidate.accuracy_level == 4
    assert [w for w in result.warnings if "slower than the original" in w] == [
        "accuracy level 4 is slower than the original at length 100: 1.10x its latency",
        "accuracy level 4 is slower than the original at length 400: 1.10x its latency",
    ]


@pytest.mark.parametrize(("level4", "wins"), [(0.98899, False), (0.98901, True)])
def test_without_a_target_the_first_candidates_cosine_sets_the_bar(
    tmp_path: Path, level4: float, wins: bool
) -> None:
    # level 0: 1 - cosine = 0.01; level 4 may be up to 10% further from 1: 0.011
    cost = {"orig.onnx": 10, "l0.onnx": 9, "l4.onnx": 5}
    result, _ = _choose(tmp_path, cost, {"l0.onnx": 0.99, "l4.onnx": level4}, min_cosine=None)
    assert (result.chosen.candidate.accuracy_level == 4) is wins
    assert "at least 0.989" in result.target


def test_choose_kernel_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose_kernel("x.onnx", [], lambda p: (1.0, ""))
    with pytest.raises(ValueError, match="min_gain"):
        choose_kernel("x.onnx", [Candidate("a", "a.onnx", 0)], lambda p: (1.0, ""), min_gain=1.0)


def test_set_accuracy_level_shares_the_external_data(tmp_path: Path) -> None:
    model = quantized(sequence_matmul_model(k=128, n=128))
    path = tmp_path / "q.onnx"
    onnx.save(model, path, save_as_external_data=True, location="q.onnx.data", size_threshold=0)
    assert choose.set_accuracy_level(str(path), 4, str(tmp_path / "q4.onnx")) == 2
    level4 = onnx.load(tmp_path / "q4.onnx", load_external_data=False)
    assert _levels(level4) == [4, 4]
    assert os.path.getsize(tmp_path / "q4.onnx") < os.path.getsize(tmp_path / "q.onnx.data")
    assert choose.set_accuracy_level(str(tmp_path / "q4.onnx"), 0, str(tmp_path / "q0.onnx")) == 2
    assert _levels(onnx.load(tmp_path / "q0.onnx", load_external_data=False)) == [0, 0]
    with pytest.raises(ValueError, match="beside the model"):
        choose.set_accuracy_level(str(path), 4, str(tmp_path / "sub" / "q4.onnx"))
    with pytest.raises(ValueError, match="0-4"):
        choose.set_accuracy_level(str(path), 5, str(tmp_path / "q5.onnx"))


def test_set_accuracy_level_reaches_subgraphs(tmp_path: Path) -> None:
    inner = quantized(sequence_matmul_model()).graph
    inner.ClearField("input")  # x comes from the outer scope
    inner.name = "then"
    other = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "else", [], list(inner.output)
    )
    cond = onnx.helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "time", 64])
    node = onnx.helper.make_node("If", ["cond"], ["y"], then_branch=inner, else_branch=other)
    graph = onnx.helper.make_graph([node], "g", [cond, x], list(inner.output))
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    )
    path = tmp_path / "if.onnx"
    onnx.save(model, path)
    assert choose.set_accuracy_level(str(path), 4, str(tmp_path / "if4.onnx")) == 2
    assert choose.accuracy_levels(str(tmp_path / "if4.onnx")) == {4}


def test_level_candidates_are_files_beside_the_model_removed_after(tmp_path: Path) -> None:
    path = tmp_path / "q.onnx"
    onnx.save(quantized(sequence_matmul_model()), path)
    with level_candidates(str(path)) as candidates:
        assert [(c.name, c.accuracy_level) for c in candidates] == [
            ("accuracy level 0", 0),
            ("accuracy level 4", 4),
        ]
        assert candidates[0].path == str(path)  # already level 0: the model itself
        assert candidates[1].path == str(tmp_path / "q.level4.onnx")
        assert choose.accuracy_levels(candidates[1].path) == {4}
    assert sorted(os.listdir(tmp_path)) == ["q.onnx"]
    with level_candidates(str(path), (4,), block_size=16) as candidates:
        assert [c.to_dict() for c in candidates] == [
            {"name": "block 16, accuracy level 4", "accuracy_level": 4, "block_size": 16}
        ]
    with pytest.raises(RuntimeError), level_candidates(str(path), (4, 0)) as candidates:
        assert [c.accuracy_level for c in candidates] == [4, 0]
        raise RuntimeError
    assert sorted(os.listdir(tmp_path)) == ["q.onnx"]


def test_level_candidates_refuse_a_model_without_matmulnbits(tmp_path: Path) -> None:
    path = tmp_path / "f.onnx"
    onnx.save(sequence_matmul_model(), path)
    with pytest.raises(ValueError, match="no MatMulNBits"), level_candidates(str(path)):
        pass
    with pytest.raises(ValueError, match="no accuracy level"), level_candidates(str(path), ()):
        pass


def test_reference_accuracy_in_onnxruntime(tmp_path: Path) -> None:
    original = tmp_path / "f.onnx"
    onnx.save(sequence_matmul_model(), original)
    onnx.save(quantized(sequence_matmul_model()), tmp_path / "q.onnx")
    check = reference_accuracy(str(original), VerifyOptions(lengths=(8, 20)))
    assert check(str(original)) == (pytest.approx(1.0), "")
    with level_candidates(str(tmp_path / "q.onnx")) as candidates:
        cosines = [check(c.path)[0] for c in candidates]
    assert 0.98 < cosines[0] < 0.99999 and 0.98 < cosines[1] < 0.99999
    assert cosines[0] != cosines[1]  # level 4 quantizes the activations too
    other = sequence_matmul_model(n=40)
    onnx.save(other, tmp_path / "other.onnx")
    cosine, note = check(str(tmp_path / "other.onnx"))
    assert cosine == -1.0 and "'y'" in note


def test_choose_with_onnxruntime_accuracy_and_a_fake_timer(tmp_path: Path) -> None:
    original = tmp_path / "f.onnx"
    onnx.save(sequence_matmul_model(), original)
    onnx.save(quantized(sequence_matmul_model()), tmp_path / "q.onnx")
    clock = FakeClock()
    cost = {"f.onnx": 10.0, "q.onnx": 9.0, "q.level4.onnx": 6.0}
    sessions = Sessions(clock, lambda path, n: cost[Path(path).name], real=True)
    check = reference_accuracy(str(original), VerifyOptions(lengths=(8, 20)))
    with level_candidates(str(tmp_path / "q.onnx")) as candidates:
        result = choose_kernel(
            str(original),
            candidates,
            check,
            min_cosine=0.98,
            timing=TimingOptions(lengths=(8, 16), rounds=3),
            clock=clock,
            session_factory=sessions,
        )
    assert result.chosen.candidate.accuracy_level == 4 and result.chosen.speed == pytest.approx(0.6)
    assert result.timing is not None and result.timing.lengths == (8, 16)


# --------------------------------------------------------------------------- #
# bench
# --------------------------------------------------------------------------- #


def _bench_models(tmp_path: Path) -> list[str]:
    fp32 = tmp_path / "fp32.onnx"
    onnx.save(sequence_matmul_model(), fp32)
    onnx.save(quantized(sequence_matmul_model(), accuracy_level=4), tmp_path / "int4.onnx")
    quantize_dynamic(str(fp32), str(tmp_path / "int8.onnx"), weight_type=QuantType.QInt8)
    return [str(fp32), str(tmp_path / "int4.onnx"), str(tmp_path / "int8.onnx")]


def test_quantization_of_each_kind(tmp_path: Path) -> None:
    fp32, int4, int8 = _bench_models(tmp_path)
    assert quantization_of(fp32).kind == "float" and not quantization_of(fp32).quantized
    assert quantization_of(int4).kind == "int4"
    assert quantization_of(int4).to_dict()["matmul_nbits"] == [{"bits": 4, "accuracy_level": 4, "nodes": 2}]
    assert quantization_of(int8).kind == "int8"
    assert quantization_of(int8).to_dict()["int8_ops"]["MatMulInteger"] == 2


def test_bench_warns_where_a_quantized_model_is_slower(tmp_path: Path) -> None:
    paths = _bench_models(tmp_path)
    clock = FakeClock()
    cost = {"fp32.onnx": 10.0, "int4.onnx": 6.0, "int8.onnx": 12.0}
    sessions = Sessions(clock, lambda path, n: cost[Path(path).name] * (1 if n == 8 else 0.5), real=True)
    report = bench_models(paths, (8, 32), options=OPTIONS, clock=clock, session_factory=sessions)
    assert report.warnings == (
        f"{paths[2]} (int8) is slower than {paths[0]}: 1.20x at length 8, 1.20x at length 32",
    )
    data = report.to_dict()
    assert [m["quantization"]["kind"] for m in data["models"]] == ["float", "int4", "int8"]
    assert [m["latencies"][0]["ratio"] for m in data["models"]] == [
        None,
        pytest.approx(0.6),
        pytest.approx(1.2),
    ]
    assert data["lengths"]["used"] == [8, 32] and data["warnings"] == list(report.warnings)
    # against the int8 model: no float baseline, so no warning about quantized models
    report = bench_models(paths, (8,), baseline=2, options=OPTIONS, clock=clock, session_factory=sessions)
    assert report.warnings == ()


def test_bench_warns_about_models_with_other_inputs(tmp_path: Path) -> None:
    paths = _bench_models(tmp_path)
    onnx.save(sequence_matmul_model(k=32), tmp_path / "other.onnx")
    clock = FakeClock()
    sessions = Sessions(clock, lambda path, n: 1.0, real=True)
    report = bench_models(
        [paths[0], str(tmp_path / "other.onnx")], (8,), options=OPTIONS, clock=clock, session_factory=sessions
    )
    assert len(report.warnings) == 1 and "has other inputs" in report.warnings[0]
    assert "x: float32['batch', 'time', 32]" in report.warnings[0]


def test_bench_on_real_sessions(tmp_path: Path) -> None:
    """The real clock and onnxruntime: only the report's shape is checked."""
    paths = _bench_models(tmp_path)
    report = bench_models(paths[:2], (4,), options=TimingOptions(rounds=3, warmup=1, threads=1))
    assert len(report.timing.models) == 2 and report.return_code == 0
    assert np.isfinite(report.timing.models[1].latencies[0].ratio or np.nan)


def test_speed_options() -> None:
    options = choose.SpeedOptions()
    assert options.chooses and options.levels == (0, 4) and options.block_sizes == (64, 128, 256)
    assert not choose.SpeedOptions(levels=(4,), block_sizes=(64,)).chooses
    assert choose.SpeedOptions(levels=(4,), block_sizes=(64, 128)).chooses
    assert options.to_dict()["accuracy_levels"] == [0, 4] and options.to_dict()["batch"] == 1
    for kwargs in (
        {"levels": ()},
        {"levels": (5,)},
        {"block_sizes": (96,)},
        {"block_sizes": (8,)},
        {"min_gain": 1},
    ):
        with pytest.raises(ValueError):
            choose.SpeedOptions(**kwargs)  # type: ignore[arg-type]
