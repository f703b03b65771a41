"""NNCF's mixed-precision criteria as rankers of the search (quantize/sensitivity.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.quantize import search as auto
from onnx_conv2matmul.quantize.options import CRITERIA, FLOAT, AutoOptions, Setting
from onnx_conv2matmul.quantize.reference import InputStats
from onnx_conv2matmul.quantize.sensitivity import NNCF_RANKERS, int8_errors, rank, score

INT4 = Setting(4, 32, False)
INT8 = Setting(8, 32, False)


@dataclasses.dataclass
class _Node:
    name: str
    a_name: str | None
    options: dict[Setting, tuple[float, int]]


def _stats(x: np.ndarray) -> InputStats:
    stats = InputStats()
    stats.add(x)
    return stats


def test_input_statistics_are_per_channel_over_tokens() -> None:
    """x [tokens 2, channels 2]: channel 0 is 0, 2 (variance 1, |max| 2), channel 1 is 1, 1."""
    stats = _stats(np.array([[0.0, 1.0], [2.0, 1.0]]))
    assert stats.mean("mean_variance") == pytest.approx(0.5)
    assert stats.mean("max_variance") == pytest.approx(1.0)
    assert stats.mean("mean_magnitude") == pytest.approx(1.5)
    assert stats.mean("mean_square") == pytest.approx((0 + 1 + 4 + 1) / 4)
    stats.add(np.array([[0.0, 1.0], [2.0, 1.0]]) * 2)  # a second run: the means over runs
    assert stats.mean("max_variance") == pytest.approx((1.0 + 4.0) / 2)


def test_int8_error_is_zero_on_the_grid_and_grows_with_an_outlier() -> None:
    on_grid = np.arange(256, dtype=np.float32).reshape(256, 1) * 0.5  # 255 steps of 0.5 from 0
    assert int8_errors(on_grid) == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.0, abs=1e-9))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    spiky = w.copy()
    spiky[0, 3] = 100.0  # one column's range widens: its error grows
    assert int8_errors(spiky)[0] > 10 * int8_errors(w)[0]


def test_rankers_follow_their_statistic() -> None:
    """Same weights, the second node's input varies 100x more: every data-aware ranker scores it
    higher; the data-free weight error cannot tell them apart."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    quiet = _stats(rng.standard_normal((32, 16)))
    loud = _stats(10 * rng.standard_normal((32, 16)))
    for criterion in ("hawq", "mean_variance", "max_variance", "mean_magnitude"):
        assert score(criterion, w, loud) > 5 * score(criterion, w, quiet), criterion
    assert score("weight_error", w, loud) == score("weight_error", w, quiet)


def test_weight_error_sends_the_weight_int8_hurts_most_to_fewer_bits_first() -> None:
    """As NNCF's data-free baseline: the score is the inverse of the int8 error."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    spiky = w.copy()
    spiky[0, 0] = 50.0
    assert score("weight_error", spiky, None) < score("weight_error", w, None)


def test_rank_rescales_each_node_and_keeps_its_own_ratios() -> None:
    """After ranking, a node's error at its smallest setting is its normalised score; the ratio
    of its settings' errors and their bytes stay; a float-only node is left alone."""
    rng = np.random.default_rng(3)
    weights = {"a": rng.standard_normal((16, 8)), "b": rng.standard_normal((16, 8))}
    a = _Node("a", "xa", {INT4: (0.04, 100), INT8: (0.004, 200)})
    b = _Node("b", "xb", {INT4: (0.02, 100), INT8: (0.001, 200)})
    f = _Node("f", None, {FLOAT: (0.0, 10)})
    stats = {"xa": _stats(rng.standard_normal((8, 16))), "xb": _stats(20 * rng.standard_normal((8, 16)))}
    scores = rank("mean_variance", [a, b, f], weights.__getitem__, stats)
    assert set(scores) == {"a", "b"}
    assert sum(scores.values()) == pytest.approx(0.04 + 0.02)  # the predicted total, normalised
    assert scores["b"] > scores["a"]
    assert a.options[INT4][0] == pytest.approx(scores["a"])
    assert a.options[INT8][0] / a.options[INT4][0] == pytest.approx(0.1)
    assert b.options[INT8][1] == 200 and f.options == {FLOAT: (0.0, 10)}


def test_unknown_criteria_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown criterion"):
        AutoOptions(min_cosine=0.99, criterion="nope")
    with pytest.raises(ValueError, match="unknown ranker"):
        rank("measured", [], lambda _n: np.zeros((1, 1)), {})
    assert set(NNCF_RANKERS) < set(CRITERIA)


def _two_branch_model(path: Path) -> None:
    """x [B, T, 32] -> MatMul a [32, 64] -> Relu -> MatMul b [64, 16] -> y, and z = x @ c [32, 8]."""
    rng = np.random.default_rng(4)

    def init(name: str, shape: tuple[int, int]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) / 4, name)

    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["ha"], name="a"),
        helper.make_node("Relu", ["ha"], ["ra"], name="relu"),
        helper.make_node("MatMul", ["ra", "wb"], ["y"], name="b"),
        helper.make_node("MatMul", ["x", "wc"], ["z"], name="c"),
    ]
    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 32])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 16]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", "T", 8]),
        ],
        [init("wa", (32, 64)), init("wb", (64, 16)), init("wc", (32, 8))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


@pytest.mark.parametrize("criterion", NNCF_RANKERS)
def test_every_criterion_drives_the_search_to_the_target(tmp_path: Path, criterion: str) -> None:
    """Each criterion plugs into the search on a built model; what it returns meets the target
    in onnxruntime (the search's own evaluation), and the result's cosine is checked again here."""
    path = tmp_path / "two.onnx"
    _two_branch_model(path)
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.standard_normal((2, 12, 32)).astype(np.float32)} for _ in range(2)]
    options = AutoOptions(min_cosine=0.999, criterion=criterion, max_evaluations=3)
    (tmp_path / "work").mkdir()
    result = auto.search(ir.load(path), feeds, options, str(tmp_path / "work"))
    assert result.reached_cosine is not None and result.reached_cosine >= 0.999
    assert {c.name for c in result.choices} == {"a", "b", "c"}
    quantized = ir.load(path)
    auto.apply(quantized, result.config)
    out = tmp_path / "q.onnx"
    ir.save(quantized, out)
    import onnxruntime as ort

    fp32 = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    candidate = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for feed in feeds:
        for want, got in zip(fp32.run(None, feed), candidate.run(None, feed), strict=True):
            for row_want, row_got in zip(want, got, strict=True):
                a, b = row_want.ravel(), row_got.ravel()
                assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999 - 1e-6
