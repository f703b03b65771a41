"""A check that cannot compare does not pass, and a correct model does not fail (issue 32, class 1).

Both directions for each output kind the check meets: a wrong candidate fails and a right one
passes, for outputs the original gives NaN in, empty outputs, outputs of one element per sample
(a score), tiny outputs (a few logits) and integer-only outputs; under each criterion.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_conv2matmul.verify.compare import (
    TINY_ELEMENTS,
    compare_arrays,
    compare_sequences,
    cosine_rel_err,
    rel_err_cosine,
    thresholds,
)
from onnx_conv2matmul.verify.options import VerifyOptions

EXACT = VerifyOptions()
FLOOR = VerifyOptions(min_cosine=0.99)
REPORT = VerifyOptions(report_only=True)
CRITERIA = {"exact": EXACT, "floor": FLOOR, "report": REPORT}


def _compare(ref: np.ndarray, out: np.ndarray, options: VerifyOptions, samples: int = 1) -> bool:
    return compare_arrays(ref, out, options, length=1, name="y", samples=samples).passed


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# (kind, reference, a right candidate, a wrong candidate): the right one within rounding of
# the reference, the wrong one what a broken model gives (same sign, same shape, same type).
def _kinds() -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    rng = _rng()
    big = rng.standard_normal((2, 64, 16)).astype(np.float32)
    score = np.array([[0.73], [0.41]], np.float32)  # one probability per sample
    logits = np.array([[0.63, 0.37], [0.2, 0.8]], np.float32)  # a 2-class softmax per sample
    labels = np.array([[3, 1, 4], [1, 5, 9]], np.int64)
    ulp = np.float32(1e-7)
    return [
        ("large", big, big + ulp, big + np.float32(0.5) * rng.standard_normal(big.shape).astype(np.float32)),
        ("scalar", score, score + ulp, score * np.float32(0.5)),
        ("tiny", logits, logits + ulp, logits[:, ::-1] * np.float32(2.0)),
        ("integer", labels, labels.copy(), labels + 1),
    ]


@pytest.mark.parametrize("criterion", ["exact", "floor"])
@pytest.mark.parametrize("kind", [k[0] for k in _kinds()])
def test_right_passes_wrong_fails(kind: str, criterion: str) -> None:
    """Every output kind under every judging criterion: the wrong candidate fails, the right passes."""
    _, ref, right, wrong = next(k for k in _kinds() if k[0] == kind)
    options = CRITERIA[criterion]
    assert _compare(ref, right, options, samples=2)
    assert not _compare(ref, wrong, options, samples=2)


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
@pytest.mark.parametrize("kind", [k[0] for k in _kinds()])
def test_empty_output_fails(kind: str, criterion: str) -> None:
    """An output with no element compared nothing: it fails in every criterion, report-only included."""
    _, ref, _, _ = next(k for k in _kinds() if k[0] == kind)
    empty = ref[:0]
    row = compare_arrays(empty, np.zeros_like(empty), CRITERIA[criterion], length=1, name="y")
    assert not row.passed
    assert "empty" in row.note


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_sample_with_nothing_finite_fails_even_when_matched(criterion: str, bad: float) -> None:
    """A sample the original gives NaN or Inf everywhere in compared nothing, even if the candidate
    has the same; the same NaN or Inf at some places of each sample leave the rest to compare."""
    ref = _rng().standard_normal((2, 8)).astype(np.float32)
    ref[0, :] = bad
    row = compare_arrays(ref, ref.copy(), CRITERIA[criterion], length=1, name="y", samples=2)
    assert not row.passed
    assert "1 of 2 samples (first: 0) have no element finite in both models" in row.note
    ref[0, :4] = 1.0
    row = compare_arrays(ref, ref.copy(), CRITERIA[criterion], length=1, name="y", samples=2)
    assert row.passed and "NaN/Inf at the same 4 places in both; the 12 finite elements compared" in row.note


def test_all_nan_reference_row_is_not_cosine_one() -> None:
    """A sample that is NaN everywhere used to count as cosine 1 (no finite place, 'both zero')."""
    ref = np.full((1, 4), np.nan, np.float32)
    assert not _compare(ref, np.zeros_like(ref), FLOOR)


@given(
    value=st.floats(0.015625, 100.0, width=32),
    factor=st.floats(0.25, 4.0, width=32),
    elements=st.integers(1, TINY_ELEMENTS - 1),
)
def test_tiny_outputs_are_judged_by_relative_error(value: float, factor: float, elements: int) -> None:
    """Property: an output of fewer than TINY_ELEMENTS per sample scaled by ``factor`` passes the
    floor exactly when its relative error |factor - 1| is within the floor's bound (a cosine
    alone would pass any factor: it sees no scale)."""
    ref = np.full((1, elements), value, np.float32)
    out = (ref * np.float32(factor)).astype(np.float32)
    row = compare_arrays(ref, out, FLOOR, length=1, name="y")
    err = float(np.linalg.norm(ref.astype(np.float64) - out) / np.linalg.norm(ref.astype(np.float64)))
    assert row.cosine is not None and row.cosine > 0.99  # the cosine alone would pass
    assert row.passed == (err <= cosine_rel_err(0.99))
    assert row.worst_cosine is not None and (row.worst_cosine >= 0.99) == row.passed


def test_cosine_and_relative_error_bounds_are_inverse() -> None:
    for c in (0.5, 0.9, 0.99, 0.99999, 1.0):
        assert rel_err_cosine(cosine_rel_err(c)) == pytest.approx(c)
    assert cosine_rel_err(-1.0) == float("inf")
    assert rel_err_cosine(float("inf")) == 0.0


def test_mean_limit_scales_with_the_output_size() -> None:
    """A mean over 2 elements is about their maximum: the mean limit rises to the max's for tiny outputs."""
    dtype = np.dtype(np.float32)
    one = thresholds(dtype, EXACT, 1)
    two = thresholds(dtype, EXACT, 2)
    large = thresholds(dtype, EXACT, 10**6)
    assert one[1] == pytest.approx(one[0])
    assert EXACT.mean_abs < large[1] < two[1] < one[1]
    assert large[1] == pytest.approx(EXACT.mean_abs, rel=0.02)
    # The case of the PP-OCR direction classifier: two probabilities that differ by 3e-6 each.
    ref = np.array([[0.63, 0.37]], np.float32)
    assert _compare(ref, ref + np.float32(3e-6), EXACT)
    assert not _compare(ref, ref + np.float32(1e-4), EXACT)


@given(st.integers(1, 5), st.integers(0, 3))
def test_sequences_of_nothing_fail(tensors: int, elements: int) -> None:
    ref = [np.zeros((elements,), np.float32) for _ in range(tensors)]
    out = [r.copy() for r in ref]
    rows = [compare_sequences(ref, out, o, length=1, name="s") for o in CRITERIA.values()]
    assert all(r.passed == (elements > 0) for r in rows)
    assert not compare_sequences([], [], FLOOR, length=1, name="s").passed


def _argmax_head(tmp_path: Path) -> Path:
    """x [N, T, 64] -> MatMul (a quantizable 64 x 40 weight) -> logits, and ids = ArgMax(logits):
    the integer output CTC and classifier heads export beside their scores."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (_rng().standard_normal((64, 40)) / 8).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["logits"], name="head"),
            helper.make_node("ArgMax", ["logits"], ["ids"], axis=-1, keepdims=0),
        ],
        "argmax_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 64])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", "T", 40]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"]),
        ],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "head.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(
    ("min_cosine", "passes"), [(None, False), ("-1", True), ("0.5", True), ("1", False)], ids=str
)
def test_an_argmax_output_is_weighed_by_agreement_not_vetoing_every_setting(
    tmp_path: Path, min_cosine: str | None, passes: bool
) -> None:
    """ids = ArgMax(logits) had to match exactly: with defaults everything stayed float at exit 0,
    with --min-cosine -1 (accept anything) the run still exited 1 (issue 43, rule 1). Under a
    minimum cosine c an integer output keeps max(0, c) of its elements, and a miss names the
    output as the cause in the run's last line."""
    import json

    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    src = _argmax_head(tmp_path)
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(src), str(out), "--no-bench", "--block-size", "16", "--report-json-stdout"]
    argv += [] if min_cosine is None else ["--min-cosine", min_cosine]
    result = CliRunner().invoke(main, argv)
    data = json.loads(result.stdout)
    rows = [r for r in data["verification"]["results"] if r["output"] == "ids"]
    assert rows
    if passes:
        assert result.exit_code == 0, result.stderr
        assert data["quantized_nodes"] == 1  # not left in float for an exact match it cannot keep
        differ = [r for r in rows if r["mismatches"]]
        assert all("agreement" in r["note"] for r in differ)
    else:  # 5 of 64 labels of this random 40-class head move at int4: below 99%
        assert result.exit_code == 1
        floor = "99%" if min_cosine is None else "100%"
        assert any("agreement" in r["note"] and f"below the {floor}" in r["note"] for r in rows), rows
        if min_cosine is None:  # the logits meet the floor (cosine 0.9975): ids alone decided
            assert "(output 'ids': 5 of 64 elements differ" in result.stderr.splitlines()[-1]
