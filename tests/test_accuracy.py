"""Accuracy you can trust by default: the floor, the search below it, per-sample cosines, the
user's own metric, and the search's reference kept on disk."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import examples, run
from onnx_conv2matmul.api import quantize_file
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import ValidationError
from onnx_conv2matmul.quantize import search as auto
from onnx_conv2matmul.quantize.metric import MetricTarget, load_function
from onnx_conv2matmul.quantize.nbits import QuantizeOptions
from onnx_conv2matmul.quantize.plan import DEFAULT_MIN_COSINE
from onnx_conv2matmul.quantize.search import AutoOptions
from onnx_conv2matmul.verify.check import VerifyOptions, compare_arrays, feed_samples, sample_cosines

K, N = 64, 48


def outlier_model(seed: int = 0, k: int = K) -> onnx.ModelProto:
    """``y = (x * s) @ W``: row 0 of W is 60 everywhere, and ``s`` scales input channel 0 by 1e-3.

    The outlier row sets the int4 scale of every block of 64 (about 4 per step), so the other
    weights, of order 1, round to a few levels: the output loses most of its energy (cosine
    about 0.45 with round-to-nearest int4, block 64), while int8 keeps it above 0.997. Trained
    models have such rows for inputs that are rarely large.
    """
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((k, N)).astype(np.float32)
    weight[0, :] = 60.0
    scale = np.ones(k, np.float32)
    scale[0] = 1e-3
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "s"], ["h"], name="scale"),
            helper.make_node("MatMul", ["h", "W"], ["y"], name="proj"),
        ],
        "outliers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", N])],
        [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(weight, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "outliers.onnx"
    onnx.save(outlier_model(), path)
    return path


def _invoke(*args: object) -> tuple[int, str, str]:
    """The command line; quantize runs with --no-bench: these tests assert on the accuracy's
    outcome and warnings, which timing (a slower-than-the-original warning) must not change."""
    words = [str(a) for a in args]
    if words[:1] == ["quantize"] and "--no-bench" not in words:
        words.append("--no-bench")
    result = CliRunner().invoke(main, words, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _cosines(original: Path, candidate: Path, feeds: list[dict[str, np.ndarray]]) -> list[float]:
    """Each sample's cosine of the output, measured here in onnxruntime (not by the tool)."""
    found = []
    for feed in feeds:
        (ref,), (out,) = run(str(original), feed), run(str(candidate), feed)
        for r, o in zip(ref, out, strict=True):
            found.append(float(np.dot(r.ravel(), o.ravel()) / np.linalg.norm(r) / np.linalg.norm(o)))
    return found


FEEDS = [
    {"x": np.random.default_rng(seed).standard_normal((2, 20, K)).astype(np.float32)} for seed in range(3)
]


# --------------------------------------------------------------------------- #
# Item 1: the defaults never hand over a broken model silently
# --------------------------------------------------------------------------- #


def test_int4_breaks_the_outlier_model_and_settings_given_are_refused(model: Path, tmp_path: Path) -> None:
    """Round-to-nearest int4 breaks the model; asked for explicitly, it falls below the default
    floor: exit 1, one message naming the floor, --auto and --inputs, and nothing is written."""
    out = tmp_path / "out.onnx"
    code, stdout, stderr = _invoke("quantize", model, out, "--bits", "4", "--report-json-stdout")
    assert code == 1
    data = json.loads(stdout)
    assert data["output"] is None and data["accuracy"]["min_cosine_source"] == "default floor"
    worst = min(r["cosine"] for r in data["verification"]["results"])
    assert worst < 0.6
    assert data["error"].startswith("accuracy below the accuracy floor --min-cosine 0.99")
    for helps in (
        "--auto searches for settings that meet it",
        "--inputs",
        "--min-cosine X sets another floor",
    ):
        assert helps in data["error"]
    assert "Verification FAILED" in stderr and "nothing was written" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outliers.onnx"]


def test_default_settings_below_the_floor_search_and_say_so(model: Path, tmp_path: Path) -> None:
    """With the default settings the model falls below the floor, so the one pass decides a mix
    from predicted sensitivity: two candidates built and checked, the second written; it meets
    the floor on every sample (measured here too), and the run warns."""
    out = tmp_path / "out.onnx"
    code, stdout, stderr = _invoke("quantize", model, out, "--report-json-stdout")
    assert code == 0, stderr
    data = json.loads(stdout)
    fallback = data["accuracy"]["fallback"]
    assert fallback["worst_cosine"] < 0.6 and fallback["settings"]["bits"] == 4
    assert any("fell below the accuracy criterion" in w for w in data["warnings"])
    assert "warning:" in stderr and "fell below the accuracy criterion" in stderr
    assert data["auto"] is None
    candidates = data["one_pass"]["candidates"]
    assert [c["passed"] for c in candidates] == [False, True]
    assert candidates[0]["worst_cosine"] == fallback["worst_cosine"]
    assert data["one_pass"]["decision"]["settings"] == candidates[1]["settings"]
    assert min(r["cosine"] for r in data["verification"]["results"]) >= DEFAULT_MIN_COSINE
    assert min(_cosines(model, out, FEEDS)) >= DEFAULT_MIN_COSINE
    # Quantized all the same, smaller than fp32.
    assert data["quantized_nodes"] == 1 and out.stat().st_size < model.stat().st_size
    # The terminal states the criterion and the caveat of synthesised inputs.
    assert "the default accuracy floor" in stderr and "synthesised inputs, which can overstate" in stderr


def test_a_run_that_meets_the_floor_exits_0_without_warning(model: Path, tmp_path: Path) -> None:
    """int8 meets the floor: written, no warning, the table says ok against a stated criterion."""
    out = tmp_path / "out.onnx"
    code, stdout, _ = _invoke("quantize", model, out, "--bits", "8", "--report-json-stdout")
    assert code == 0
    data = json.loads(stdout)
    assert data["warnings"] == [] and data["accuracy"]["fallback"] is None
    assert data["verification"]["criterion"] == {
        "kind": "min_cosine",
        "min_cosine": DEFAULT_MIN_COSINE,
        "labels": "auto",
    }
    assert min(_cosines(model, out, FEEDS)) >= DEFAULT_MIN_COSINE


def test_the_table_says_measured_where_nothing_was_judged(model: Path, tmp_path: Path) -> None:
    """The Python API's report_only: the rows say measured, never ok; with a criterion, ok."""
    from rich.console import Console

    from onnx_conv2matmul.cli.render.verify import print_verification

    measured = quantize_file(
        model,
        tmp_path / "m.onnx",
        options=QuantizeOptions(bits=4),
        verify=VerifyOptions(report_only=True, lengths=(16,)),
    )
    judged = quantize_file(
        model,
        tmp_path / "j.onnx",
        options=QuantizeOptions(bits=8),
        verify=VerifyOptions(lengths=(16,)),
    )
    for report, word, other in ((measured, "measured", " ok "), (judged, " ok ", "measured")):
        console = Console(record=True, width=200)
        assert report.verification is not None
        print_verification(console, report.verification, cosine=True)
        text = console.export_text()
        assert word in text and other not in text
    assert measured.output_path is not None  # report only: any cosine passes


def test_given_inputs_drop_the_caveat(model: Path, tmp_path: Path) -> None:
    feed = tmp_path / "f.npz"
    np.savez(feed, **FEEDS[0])
    code, stdout, stderr = _invoke("quantize", model, tmp_path / "o.onnx", "--bits", "8", "--inputs", feed,
                                   "--report-json-stdout")  # fmt: skip
    assert code == 0
    accuracy = json.loads(stdout)["accuracy"]
    assert accuracy["inputs"] == "files" and accuracy["caveat"] is None
    assert "overstate" not in stderr


# --------------------------------------------------------------------------- #
# Per-sample cosine
# --------------------------------------------------------------------------- #


def test_one_bad_sample_in_a_batch_fails_the_minimum() -> None:
    """Seven rows exact and one reversed: the cosine over the batch is 0.75, above a 0.7 minimum,
    but the worst sample's is -1, so the row fails and says why."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((8, 10, 4)).astype(np.float32)
    out = ref.copy()
    out[5] = -ref[5]
    cosines = sample_cosines(ref, out, 8)
    assert len(cosines) == 8 and min(cosines) == pytest.approx(-1.0) and cosines[0] == pytest.approx(1.0)
    row = compare_arrays(ref, out, VerifyOptions(min_cosine=0.7), length=1, name="y", samples=8)
    assert row.cosine is not None and row.cosine > 0.7
    assert not row.passed and row.sample_cosine == pytest.approx(-1.0) and row.samples == 8
    assert "worst of 8 samples" in row.note
    # Without a batch the output is one sample, judged as before.
    whole = compare_arrays(ref, out, VerifyOptions(min_cosine=0.7), length=1, name="y")
    assert whole.passed and whole.samples == 1 and whole.sample_cosine is None


@settings(max_examples=examples(50))
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    noise=st.floats(0, 3),
)
def test_sample_cosines_agree_with_the_whole_output(rows: int, cols: int, seed: int, noise: float) -> None:
    """One sample: the same cosine as the row's; several: each row's own cosine, and the worst
    is never above the best."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((rows, cols)).astype(np.float32)
    out = (ref + noise * rng.standard_normal((rows, cols))).astype(np.float32)
    (whole,) = sample_cosines(ref, out, 1)
    row = compare_arrays(ref, out, VerifyOptions(report_only=True), length=1, name="y")
    assert row.cosine is not None and whole == pytest.approx(row.cosine, abs=1e-12)
    each = sample_cosines(ref, out, rows)
    assert len(each) == rows
    for r, o, c in zip(ref, out, each, strict=True):
        r64, o64 = r.astype(np.float64), o.astype(np.float64)
        expected = float(r64 @ o64 / np.linalg.norm(r64) / np.linalg.norm(o64))
        assert c == pytest.approx(expected, abs=1e-9)


def test_feed_samples_is_the_batch_of_the_float_inputs() -> None:
    x = np.zeros((3, 5, 2), np.float32)
    assert feed_samples({"x": x, "length": np.array([5, 5, 5], np.int64)}) == 3
    assert feed_samples({"x": x, "state": np.zeros((2, 3, 4), np.float32)}) == 1  # they disagree
    assert feed_samples({"audio": np.zeros((7,), np.float32)}) == 1


# --------------------------------------------------------------------------- #
# The user's metric
# --------------------------------------------------------------------------- #

_METRIC = '''
import numpy as np
import onnxruntime as ort

CALLS = []
_X = np.random.default_rng(7).standard_normal((4, 20, 64)).astype(np.float32)
_TARGET = None


def score(path):
    """Minus the mean absolute difference to the first model scored (the original)."""
    global _TARGET
    CALLS.append(path)
    y = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": _X})[0]
    if _TARGET is None:
        _TARGET = y
    return -float(np.abs(y - _TARGET).mean())


def broken(path):
    raise ValueError("boom")


def not_a_number(path):
    return "high"
'''


@pytest.fixture
def metric_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_metric.py"
    path.write_text(_METRIC)
    return path


def test_validate_below_max_drop_is_refused_with_settings_given(model: Path, metric_file: Path) -> None:
    out = model.parent / "o.onnx"
    code, stdout, stderr = _invoke(
        "quantize", model, out, "--bits", "4", "--validate", f"{metric_file}:score", "--max-drop", "0.05",
        "--report-json-stdout",
    )  # fmt: skip
    assert code == 1, stderr
    data = json.loads(stdout)
    metric = data["accuracy"]["metric"]
    assert metric["original_score"] == 0 and metric["score"] < -0.05 and metric["passed"] is False
    assert "dropped from" in data["error"] and "--max-drop 0.05" in data["error"]
    assert not out.exists()
    # The cosine is measured, not judged: the metric is the criterion.
    assert data["verification"]["criterion"] == {"kind": "report_only"}
    assert "measured" in stderr


def test_validate_with_default_settings_searches_to_the_metric(model: Path, metric_file: Path) -> None:
    """Below --max-drop with the default settings: the search, with the metric as its target,
    writes a model whose score (measured again here) dropped by at most that much."""
    out = model.parent / "o.onnx"
    code, stdout, stderr = _invoke(
        "quantize", model, out, "--validate", f"{metric_file}:score", "--max-drop", "0.05",
        "--report-json-stdout",
    )  # fmt: skip
    assert code == 0, stderr
    data = json.loads(stdout)
    metric = data["accuracy"]["metric"]
    assert metric["passed"] is True and -0.05 <= metric["score"] <= 0 and metric["drop"] <= 0.05
    assert data["accuracy"]["fallback"]["score"] < -0.05
    assert data["auto"]["metric"]["function"] == f"{metric_file}:score"
    assert data["auto"]["min_cosine"] is None
    assert all(e["min_cosine"] is None for e in data["auto"]["evaluations"])  # cosine not asked for
    x = np.random.default_rng(7).standard_normal((4, 20, 64)).astype(np.float32)
    (ref,), (got,) = run(str(model), {"x": x}), run(str(out), {"x": x})
    assert float(np.abs(got - ref).mean()) <= 0.05


def test_auto_with_a_relative_drop_and_a_minimum_cosine(model: Path, tmp_path: Path) -> None:
    """Both targets: the search's evaluations measure both, and the result meets both."""
    calls: list[str] = []

    def score(path: str) -> float:
        calls.append(path)
        x = np.ones((1, 4, K), np.float32)
        return 10.0 - float(np.abs(run(path, {"x": x})[0] - run(str(model), {"x": x})[0]).mean())

    metric = MetricTarget(score, max_drop=0.01, relative=True, name="score")
    report = quantize_file(
        model,
        tmp_path / "o.onnx",
        verify=VerifyOptions(lengths=(16,)),
        auto=AutoOptions(min_cosine=0.995, metric=metric, max_evaluations=4),
    )
    assert report.return_code == 0 and report.auto is not None
    assert report.auto.original_score == pytest.approx(10.0)
    assert report.auto.reached_score is not None and report.auto.reached_score >= 10.0 * 0.99
    assert report.auto.reached_cosine is not None and report.auto.reached_cosine >= 0.995
    assert calls[0] == str(model)  # the original first, then candidates and the output
    assert report.accuracy["metric"]["passed"] is True and report.accuracy["metric"]["relative"] is True


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("broken", "failed on the original model: ValueError: boom"),
        ("not_a_number", "returned 'high' for the original model: a finite number is needed"),
    ],
)
def test_a_failing_validation_function_is_exit_2_before_any_work(
    model: Path, metric_file: Path, function: str, message: str
) -> None:
    out = model.parent / "o.onnx"
    code, _, stderr = _invoke("quantize", model, out, "--validate", f"{metric_file}:{function}")
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists()


@settings(max_examples=examples(100))
@given(
    original=st.floats(-1e6, 1e6),
    score=st.floats(-1e6, 1e6),
    max_drop=st.floats(0, 10),
    relative=st.booleans(),
)
def test_drop_is_nncf_s(original: float, score: float, max_drop: float, relative: bool) -> None:
    """A score at or above the original's always meets the target; below, the drop is the
    difference (or that over |original|) and meets it when at most max_drop."""
    target = MetricTarget(lambda _path: 0.0, max_drop=max_drop, relative=relative)
    drop = target.drop(original, score)
    if relative and original != 0:
        assert drop == pytest.approx((original - score) / abs(original))
    elif not relative:
        assert drop == original - score
    if score >= original:
        assert target.meets(original, score)
    else:
        assert target.meets(original, score) is (drop <= max_drop)


def test_load_function_takes_modules_and_files(metric_file: Path) -> None:
    assert load_function("json:dumps")([1]) == "[1]"
    assert load_function("os.path:join")("a", "b") == "a/b"
    assert callable(load_function(f"{metric_file}:score"))
    with pytest.raises(ValidationError, match="no such file"):
        load_function(f"{metric_file.parent / 'missing.py'}:score")
    with pytest.raises(ValidationError, match="is not callable"):
        load_function("math:pi")


def test_metric_target_checks_its_values() -> None:
    with pytest.raises(ValueError, match="largest drop"):
        MetricTarget(lambda _p: 0.0, max_drop=-1)
    with pytest.raises(ValueError, match="largest drop"):
        MetricTarget(lambda _p: 0.0, max_drop=math.nan)
    assert MetricTarget(lambda _p: 0.0, max_drop=0.02, relative=True).max_drop_text == "2%"
    with pytest.raises(ValidationError, match="returned nan"):
        MetricTarget(lambda _p: math.nan).score("m.onnx", "a model")
    assert MetricTarget(lambda _p: np.float32(0.5)).score("m.onnx", "a model") == 0.5


# --------------------------------------------------------------------------- #
# The search: reference on disk, early stop, the final check without fp32
# --------------------------------------------------------------------------- #


def test_failing_evaluations_stop_at_the_first_feed_below(model: Path, tmp_path: Path) -> None:
    """Three feeds: the smallest configuration (int4) fails on the first feed it runs and stops
    there; a passing one runs all three."""
    report = quantize_file(
        model,
        tmp_path / "o.onnx",
        verify=VerifyOptions(feeds=tuple(FEEDS)),
        auto=AutoOptions(min_cosine=0.99, max_evaluations=4),
    )
    assert report.auto is not None
    first = report.auto.evaluations[0]
    assert (
        not first.passed and first.feeds_run == 1 and first.min_cosine is not None and first.min_cosine < 0.6
    )
    assert all(e.feeds_run == len(FEEDS) for e in report.auto.evaluations if e.passed)
    assert report.verification is not None and len(report.verification.results) == len(FEEDS)
    assert all(r.samples == 2 for r in report.verification.results)  # each feed holds a batch of 2


def test_the_final_check_reuses_the_search_reference(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --auto the fp32 model runs once: the final check compares against the reference the
    search kept on disk (verify_models, which would run it again, is not called)."""
    from onnx_conv2matmul.quantize import check_publish

    def fail(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the original ran again")

    monkeypatch.setattr(check_publish, "verify_models", fail)
    loads: list[str] = []
    original_get = auto.Reference.get

    def get(self: auto.Reference, feed: int) -> list[object]:
        values = original_get(self, feed)
        loads.extend(type(v).__name__ for v in values)
        return values

    monkeypatch.setattr(auto.Reference, "get", get)
    report = quantize_file(
        model, tmp_path / "o.onnx", verify=VerifyOptions(lengths=(16, 24)), auto=AutoOptions(min_cosine=0.99)
    )
    assert report.return_code == 0 and report.verification is not None
    assert [r.length for r in report.verification.results] == [16, 24]
    assert loads and set(loads) == {"memmap"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".auto-")] == []


def test_the_sensitivity_is_measured_once_whatever_the_target(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-node errors of the ladder are computed once per search, not per evaluation."""
    calls: list[int] = []
    original = auto._sensitivities

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(auto, "_sensitivities", counted)
    report = quantize_file(
        model, tmp_path / "o.onnx", verify=VerifyOptions(lengths=(16,)), auto=AutoOptions(min_cosine=0.999)
    )
    assert report.auto is not None and len(report.auto.evaluations) >= 2
    assert calls == [1]


# --------------------------------------------------------------------------- #
# Synthesised inputs shaped like what the model sees
# --------------------------------------------------------------------------- #


def _first_op_model(first: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "W")
    graph = helper.make_graph(
        [*first, helper.make_node("MatMul", ["h", "W"], ["y"], name="proj")],
        "first_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 4])],
        [*inits, weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("first", "inits", "low", "high", "how"),
    [
        (
            [helper.make_node("Clip", ["x", "lo", "hi"], ["h"])],
            [numpy_helper.from_array(np.float32(-1.5), "lo"), numpy_helper.from_array(np.float32(6), "hi")],
            -1.5,
            6.0,
            "uniform in [-1.5, 6] (the model clips it to that)",
        ),
        (
            [helper.make_node("Div", ["x", "c"], ["h"])],
            [numpy_helper.from_array(np.float32(255), "c")],
            0.0,
            255.0,
            "uniform in [0, 255] (pixel values: the model divides it by 255)",
        ),
        (
            [
                helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(1 / 255))),
                helper.make_node("Mul", ["x", "c"], ["h"]),
            ],
            [],
            0.0,
            255.0,
            "uniform in [0, 255] (pixel values: the model divides it by 255)",
        ),
        (
            [helper.make_node("Mul", ["x", "c"], ["h"])],
            [numpy_helper.from_array(np.float32(3), "c")],
            None,
            None,
            "standard normal",
        ),
    ],
    ids=["clip", "div-255", "mul-1/255-constant", "other"],
)
def test_inputs_take_the_range_the_first_op_states(
    tmp_path: Path,
    first: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    low: float | None,
    high: float | None,
    how: str,
) -> None:
    from onnx_conv2matmul.quantize.reference import feed_set

    path = tmp_path / "m.onnx"
    onnx.save(_first_op_model(first, inits), path)
    options = VerifyOptions(lengths=(50,))
    assert feed_set(str(path), options).how == {"x": how}
    x = auto.synthesised_feeds(str(path), options)[0]["x"]
    if low is None:
        assert x.min() < 0 < x.max()
    else:
        assert low <= x.min() and x.max() <= high and x.max() - x.min() > (high - low) / 2  # type: ignore[operator]


def test_int8_dynamic_below_the_criterion_is_refused_never_searched(model: Path, tmp_path: Path) -> None:
    """One node, per channel and per tensor both below: nothing to step back to, so a refusal
    (exit 2) that gives both figures, and no search."""
    out = tmp_path / "o.onnx"
    code, stdout, _ = _invoke("quantize", model, out, "--int8-dynamic", "--min-cosine", "0.999999",
                              "--report-json-stdout")  # fmt: skip
    assert code == 2 and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outliers.onnx"]
    error = json.loads(stdout)["error"]
    assert error.startswith("int8 dynamic quantization misses the accuracy criterion")
    assert "its one quantizable node (proj)" in error and "search" not in error
    assert re.search(r"worst cosine 0\.\d{4} per channel, worst cosine 0\.\d{4} per tensor", error)


def _even_lengths_model() -> onnx.ModelProto:
    """``x [B, T, 3]`` reshaped to pairs, so T must be even: the check's default lengths 97 and
    191 fail, and spares take their place."""
    weight = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["pairs"]),
            helper.make_node("MatMul", ["pairs", "W"], ["y"], name="proj"),
        ],
        "even",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", None, 8])],
        [
            numpy_helper.from_array(np.array([0, -1, 2], np.int64), "shape"),
            numpy_helper.from_array(weight, "W"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_search_replaces_lengths_the_model_cannot_run_at(tmp_path: Path) -> None:
    """The search makes its synthesised inputs as it runs them: lengths the model cannot run at
    are replaced by spares as the check replaces them, listed in the same order, without a run
    of the model beforehand; the final check reports what the plain check reports."""
    src = tmp_path / "even.onnx"
    onnx.save(_even_lengths_model(), src)
    searched = quantize_file(src, tmp_path / "a.onnx", auto=AutoOptions(min_cosine=0.9, max_evaluations=2))
    plain = quantize_file(src, tmp_path / "p.onnx", options=QuantizeOptions(bits=8))
    assert searched.verification is not None and plain.verification is not None
    assert searched.verification.lengths == plain.verification.lengths == [64, 80, 96, 128, 160]
    assert [n for n, _ in searched.verification.lengths_not_run] == [97, 191]
    assert [r.length for r in searched.verification.results] == [64, 80, 96, 128, 160]
    assert searched.verification.inputs == plain.verification.inputs
    assert searched.auto is not None and searched.auto.feeds == 5
    # The same inputs, the same fp32 outputs, the model is int8 in both: the same cosines.
    if searched.auto.config.nodes["proj"] == auto.Setting(8, 64, False):
        assert [r.cosine for r in searched.verification.results] == [
            r.cosine for r in plain.verification.results
        ]


def test_auto_on_external_data_works_from_its_copy_and_replays(tmp_path: Path) -> None:
    """A model with external data: the search lets the rewritten model go and builds the output
    from its own fp32 copy (memory-mapped); the output is complete, meets the minimum, and
    --config replays it to the same bytes."""
    src = tmp_path / "m.onnx"
    onnx.save(outlier_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    searched = quantize_file(
        src, tmp_path / "a.onnx", verify=VerifyOptions(lengths=(16,)), auto=AutoOptions(min_cosine=0.99)
    )
    assert searched.return_code == 0 and searched.external_data and searched.auto is not None
    assert min(_cosines(src, tmp_path / "a.onnx", FEEDS)) >= 0.99
    options = QuantizeOptions.from_config(searched.auto.config.to_config())
    (tmp_path / "again").mkdir()
    again = tmp_path / "again" / "a.onnx"  # the same name: the data file's is inside the model
    replay = quantize_file(src, again, options=options, verify=VerifyOptions(lengths=(16,)))
    assert replay.return_code == 0
    assert (tmp_path / "a.onnx").read_bytes() == again.read_bytes()
    assert (tmp_path / "a.onnx.data").read_bytes() == (tmp_path / "again" / "a.onnx.data").read_bytes()


_TAMPERING = """
import onnx
from onnx import helper

def score(path):
    if "outliers" not in path:  # the candidate: overwritten with a model of the user's own
        model = onnx.load(path)
        model.graph.node.append(helper.make_node("Identity", [model.graph.output[0].name], ["extra"]))
        model.graph.output.append(helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, None))
        onnx.save(model, path)
    return 1.0
"""


@pytest.mark.parametrize("settings", [[], ["--bits", "4"]], ids=["default", "settings-given"])
def test_a_validate_function_that_changes_the_candidate_is_refused(
    model: Path, tmp_path: Path, settings: list[str]
) -> None:
    """A --validate function could rewrite the file it was handed, and that file was published
    unchecked (issue 43, rule 4): the bytes published must be the bytes checked."""
    metric = tmp_path / "tamper.py"
    metric.write_text(_TAMPERING)
    out = model.parent / "o.onnx"
    code, _, stderr = _invoke("quantize", model, out, *settings, "--validate", f"{metric}:score")
    assert code == 2, stderr
    assert "changed" in stderr and "it may only read the file" in stderr
    assert not out.exists()


def test_a_decided_mix_that_keeps_every_layer_in_float_names_the_criterion(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one pass's decision expresses float for every layer by excluding '*': the report's
    reason is the accuracy criterion, not the include and exclude patterns (PP-OCRv4 rec on 50
    real lines said 'the include and exclude patterns ('*') left all 30 ... in float')."""
    import math

    from onnx_conv2matmul.quantize import onepass

    real = onepass._decide.decide

    def all_float(sens: Any, options: Any, uniform_loss: float, **kwargs: Any) -> Any:
        return real(sens, options, math.inf, **kwargs)  # no error allowed: every layer in float

    monkeypatch.setattr(onepass._decide, "decide", all_float)
    out = tmp_path / "out.onnx"
    code, stdout, _ = _invoke("quantize", model, out, "--min-cosine", "0.999", "--report-json-stdout")
    assert code == 0
    data = json.loads(stdout)
    assert data["quantized_nodes"] == 0 and data["one_pass"]["decision"] is not None
    assert data["unchanged"]["cause"] == "accuracy_floor", data["unchanged"]
