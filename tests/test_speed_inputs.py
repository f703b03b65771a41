"""The speed step's inputs: the user's (``--inputs``) or shapes the accuracy check proved the model
takes, never default lengths it cannot run at; onnxruntime's own log lines stay off the terminal.
Nothing here depends on how fast anything runs: the timing's figures are not asserted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.speed.inputs import given_inputs, pick_feeds, timing_inputs
from onnx_conv2matmul.speed.timing import TimingOptions, time_models
from onnx_conv2matmul.verify.check import VerifyOptions
from processes import run_python
from speed_fakes import FakeClock, Sessions, sequence_matmul_model

WIDTH = 64


def frames_model(width: int = WIDTH) -> onnx.ModelProto:
    """x [1, T] -> Reshape [1, -1, width] -> MatMul(W) -> y: runs only when T is a multiple of
    ``width`` (the default timing lengths 200 and 1000 are not, for 64)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["frames"]),
            helper.make_node("MatMul", ["frames", "W"], ["y"], name="proj"),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "samples"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, None, width])],
        [
            numpy_helper.from_array(np.array([1, -1, width], np.int64), "shape"),
            numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "W"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def frames(tmp_path: Path) -> Path:
    path = tmp_path / "frames.onnx"
    onnx.save(frames_model(), path)
    return path


def _quantize(*args: object) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(
        main,
        ["quantize", *(str(a) for a in args), "--bench-rounds", "3", "--report-json-stdout"],
        catch_exceptions=False,
    )
    return result.exit_code, json.loads(result.stdout), result.stderr


def test_pick_feeds_takes_the_smallest_and_the_largest() -> None:
    feeds = [{"x": np.zeros(n, np.float32)} for n in (5, 2, 9, 2, 9)]
    assert pick_feeds(feeds) == [1, 2]
    assert pick_feeds(feeds[:1]) == [0]
    assert pick_feeds([feeds[1], feeds[3]]) == [0]  # one size: timed once
    assert pick_feeds([]) == []


def test_timing_runs_on_the_given_feeds_and_nothing_else(tmp_path: Path) -> None:
    paths = []
    for name in ("a.onnx", "b.onnx"):
        (tmp_path / name).write_bytes(b"x" * 100)
        paths.append(str(tmp_path / name))
    feeds = [
        {"audio_signal": np.full((1, 4, n), n, np.float32), "length": np.array([n], np.int64)}
        for n in (30, 10, 20)
    ]
    options = given_inputs(TimingOptions(lengths=(100, 400), rounds=3, warmup=1), feeds)
    clock = FakeClock()
    sessions = Sessions(clock, lambda path, length: 1.0)
    report = time_models(paths, options, clock=clock, session_factory=sessions)
    assert report.lengths == (2, 1)  # the feeds' numbers from 1: the smallest, then the largest
    assert "--inputs" in report.lengths_rule
    seen = {int(feed["length"][0]) for _, feed in sessions.feeds}
    assert seen == {10, 30}  # the given arrays, never synthesised ones at 100 or 400
    for _, feed in sessions.feeds:
        n = int(feed["length"][0])
        assert np.array_equal(feed["audio_signal"], np.full((1, 4, n), n, np.float32))
    assert report.options.to_dict()["batch"] is None


def test_a_short_timing_takes_the_smallest_given_feed_or_the_shortest_run(frames: Path) -> None:
    """The speed step's default timing (one short length): the smallest of the given inputs, or
    the shortest of the runs the check proves; lengths given are timed as given."""
    feeds = [{"x": np.zeros((1, n * WIDTH), np.float32)} for n in (3, 1, 2)]
    given = given_inputs(TimingOptions(), feeds, short=True)
    assert given.feeds is not None and [n for n, _ in given.feeds] == [2]
    assert "the smallest:" in given.feeds_rule
    full = timing_inputs(str(frames), TimingOptions(), VerifyOptions())
    short = timing_inputs(str(frames), TimingOptions(), VerifyOptions(), short=True)
    assert full.feeds is not None and short.feeds is not None and len(full.feeds) == 2
    assert [n for n, _ in short.feeds] == [full.feeds[0][0]]
    assert timing_inputs(str(frames), TimingOptions(lengths=(128,)), VerifyOptions(), short=True).lengths == (
        128,
    )


def test_without_inputs_the_timing_takes_the_checks_runs(frames: Path) -> None:
    timing = timing_inputs(str(frames), TimingOptions(), VerifyOptions())
    assert timing.feeds is not None
    shapes = [feed["x"].shape for _, feed in timing.feeds]
    assert shapes and all(s[0] == 1 and s[1] % WIDTH == 0 for s in shapes)
    assert "accuracy check" in timing.feeds_rule
    # Lengths the user gives are timed as given (synthesised).
    given = timing_inputs(str(frames), TimingOptions(lengths=(128,)), VerifyOptions())
    assert given.feeds is None and given.lengths == (128,)


def test_quantize_with_inputs_times_and_chooses_on_them(frames: Path, tmp_path: Path) -> None:
    inputs = tmp_path / "x.npz"
    np.savez(inputs, x=np.random.default_rng(1).standard_normal((1, 8 * WIDTH)).astype(np.float32))
    code, data, stderr = _quantize(frames, tmp_path / "q.onnx", "--inputs", inputs)
    assert code == 0, stderr
    # The kernel choice (--bench shapes, the default) costs each MatMul at the given input's rows.
    assert data["kernel_costs"]["lengths"] == [1]
    assert "x[1, 512]" in data["kernel_costs"]["reason"]
    assert data["latency"]["lengths"]["used"] == [1]
    assert "--inputs" in data["latency"]["lengths"]["rule"]
    assert "x[1, 512]" in data["latency"]["lengths"]["rule"]


def test_quantize_without_inputs_times_where_the_check_ran(frames: Path, tmp_path: Path) -> None:
    code, data, stderr = _quantize(frames, tmp_path / "q.onnx")
    assert code == 0, stderr
    used = data["latency"]["lengths"]["used"]
    ran = data["verification"]["lengths"]["used"]
    assert used and set(used) <= set(ran)
    assert all(n % WIDTH == 0 for n in used)


def test_onnxruntime_log_lines_stay_off_the_terminal(frames: Path) -> None:
    """A model onnxruntime cannot run at a length: one error line, with onnxruntime's message in
    it, and none of onnxruntime's own log lines."""
    done = run_python(
        "from onnx_conv2matmul.cli.app import main\nmain()\n", "bench", str(frames), "--bench-lengths", "200"
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert not [line for line in lines if re.search(r"\[[VIWEF]:onnxruntime", line)], done.stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Reshape" in errors[0], done.stderr


def test_without_inputs_the_default_lengths_are_kept_where_the_model_takes_them(tmp_path: Path) -> None:
    path = tmp_path / "seq.onnx"
    onnx.save(sequence_matmul_model(), path)
    timing = timing_inputs(str(path), TimingOptions(), VerifyOptions())
    assert timing.feeds is not None
    assert [number for number, _ in timing.feeds] == [200, 1000]
    assert [feed["x"].shape for _, feed in timing.feeds] == [(1, 200, 64), (1, 1000, 64)]
    assert "default lengths" in timing.feeds_rule


def _batch_model(path: Path, batch: int | str) -> None:
    """x [batch, T, 8] -> MatMul(W) -> y."""
    w = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [batch, "T", 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [batch, "T", 8])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_a_file_of_many_samples_is_timed_on_its_first_at_batch_1(tmp_path: Path) -> None:
    """50 lines in one file were timed as one batch of 50 (the recognizer's three models timed
    together held 2.4 GB of activations); every latency is at batch 1, so is this one. A model
    whose batch is a static 5 gets the file as it is."""
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((5, t, 8)).astype(np.float32)} for t in (30, 60)]
    path = tmp_path / "m.onnx"
    _batch_model(path, "N")
    timing = timing_inputs(str(path), TimingOptions(rounds=3, warmup=1), VerifyOptions(feeds=feeds))
    assert timing.feeds is not None
    assert [feed["x"].shape for _, feed in timing.feeds] == [(1, 30, 8), (1, 60, 8)]
    assert np.array_equal(timing.feeds[1][1]["x"][0], feeds[1]["x"][0])
    assert "first sample" in timing.feeds_rule
    _batch_model(path, 5)
    timing = timing_inputs(str(path), TimingOptions(rounds=3, warmup=1), VerifyOptions(feeds=feeds))
    assert timing.feeds is not None
    assert [feed["x"].shape for _, feed in timing.feeds] == [(5, 30, 8), (5, 60, 8)]


def capped_model(cap: int = 512, width: int = WIDTH) -> onnx.ModelProto:
    """x [1, T, width] + the first T rows of a [cap, width] table -> MatMul(W) -> y: runs while
    T <= cap, so at the timing's short default length (200) and not at its long one (1000)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["frames"], start=1, end=2),
            helper.make_node("Slice", ["table", "zero", "frames"], ["window"]),
            helper.make_node("Add", ["x", "window"], ["shifted"]),
            helper.make_node("MatMul", ["shifted", "W"], ["y"], name="proj"),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "frames", width])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, None, width])],
        [
            numpy_helper.from_array(rng.standard_normal((cap, width)).astype(np.float32), "table"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "W"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_short_timing_of_a_model_that_takes_only_some_lengths_is_of_the_checks_runs(tmp_path: Path) -> None:
    """Before: the short timing proved the short default length alone (200, which runs) and timed
    there, while the latency line and the check, which found the model failing at 1000, ran on
    the check's own lengths (silero VAD: 200 against 192, 256 and 512)."""
    path = tmp_path / "capped.onnx"
    onnx.save(capped_model(), path)
    full = timing_inputs(str(path), TimingOptions(), VerifyOptions())
    short = timing_inputs(str(path), TimingOptions(), VerifyOptions(), short=True)
    assert full.feeds is not None and short.feeds is not None
    assert [n for n, _ in short.feeds] == [full.feeds[0][0]]
    assert 200 not in [n for n, _ in full.feeds]
    assert short.feeds_rule.startswith("the accuracy check's shortest run")
