"""Tests written to kill mutants that survived mutation testing (docs/mutation.md).

The output comparison of ``verify.py``: every number of a row, checked against values
worked out by hand for small arrays, and the limits at their boundaries.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_conv2matmul.verify.check import (
    OutputComparison,
    VerifyOptions,
    compare_arrays,
    compare_outputs,
    compare_sequences,
    element_scales,
    thresholds,
)
from onnx_conv2matmul.verify.tally import nonfinite_mismatches

# |ref| has rows of max 2 and 8 and columns of max 4 and 8: the scales are
# [[min(2, 4), min(2, 8)], [min(8, 4), min(8, 8)]] = [[2, 2], [4, 8]].
REF = np.array([[0.5, 2.0], [4.0, -8.0]])
OUT = np.array([[0.5, 2.5], [4.0, -8.0]])  # differs by 0.5 where the scale is 2
REF_SQ, OUT_SQ, DOT = 84.25, 86.5, 85.25
COSINE = DOT / math.sqrt(REF_SQ * OUT_SQ)


def _row(ref: np.ndarray, out: np.ndarray, options: VerifyOptions | None = None) -> OutputComparison:
    return compare_arrays(ref, out, options or VerifyOptions(), length=7, name="y")


def test_element_scales_take_the_quietest_slice_never_below_one() -> None:
    np.testing.assert_array_equal(element_scales(np.abs(REF)), [[2.0, 2.0], [4.0, 8.0]])
    # An axis of length 1 makes no slices: here each column is one, and 1 at least.
    np.testing.assert_array_equal(element_scales(np.array([[3.0, 0.5, 6.0]])), [[3.0, 1.0, 6.0]])
    np.testing.assert_array_equal(element_scales(np.array([[[5.0]]])), [[[5.0]]])
    np.testing.assert_array_equal(element_scales(np.array([[[0.25]]])), [[[1.0]]])
    assert element_scales(np.zeros((0, 3))).shape == (0, 3)


def test_thresholds_are_the_options_raised_to_what_the_type_holds() -> None:
    options = VerifyOptions(max_abs=1e-5, mean_abs=1e-6)
    eps16 = float(np.finfo(np.float16).eps)
    assert thresholds(np.dtype(np.float16), options) == (4 * eps16, 0.5 * eps16)
    assert thresholds(np.dtype(np.float32), options) == (1e-5, 1e-6)
    assert thresholds(np.dtype(np.int64), options) == (1e-5, 1e-6)
    loose = VerifyOptions(max_abs=0.5, mean_abs=0.25)
    assert thresholds(np.dtype(np.float16), loose) == (0.5, 0.25)


def test_nonfinite_mismatches_count_nan_and_inf_that_differ() -> None:
    inf, nan = float("inf"), float("nan")
    ref = np.array([nan, inf, -inf, 1.0, 2.0, inf, nan])
    out = np.array([nan, inf, inf, nan, 2.0, 3.0, 1.0])
    assert nonfinite_mismatches(ref, out) == 4
    assert nonfinite_mismatches(out, ref) == 4
    assert nonfinite_mismatches(np.array([1.0, 2.0]), np.array([1.0, 3.0])) == 0


def test_a_float_row_has_every_number_worked_out() -> None:
    row = _row(REF, OUT)
    limits = thresholds(np.dtype(np.float64), VerifyOptions(), 4)  # the mean limit of 4 elements
    assert row == OutputComparison(
        length=7,
        output="y",
        dtype="float64",
        shape=[2, 2],
        max_abs=0.25,
        mean_abs=0.0625,
        rel_err=0.5 / math.sqrt(REF_SQ),
        cosine=pytest.approx(COSINE, rel=1e-15),
        max_ref=8.0,
        mismatches=0,
        passed=False,
        note=f"above the limits for float64: max_abs {limits[0]:.3g}, mean_abs {limits[1]:.3g}",
        sample_rel_err=0.5 / math.sqrt(REF_SQ),  # fewer than 8 elements: judged by relative error too
    )
    # float32 is widened to float64 before the differences are taken.
    row32 = _row(REF.astype(np.float32), OUT.astype(np.float32))
    assert (row32.dtype, row32.max_abs, row32.mean_abs, row32.max_ref) == ("float32", 0.25, 0.0625, 8.0)


@pytest.mark.parametrize(
    ("max_abs", "mean_abs", "passed"),
    [(0.25, 0.0625, True), (0.2499, 0.0625, False), (0.25, 0.0624, False), (1.0, 1.0, True)],
)
def test_the_scaled_difference_limits_are_inclusive(max_abs: float, mean_abs: float, passed: bool) -> None:
    # REF and OUT tiled to 64 elements (one differs per 4): a size whose mean limit is the
    # option's plus (max - mean) / 8; the options are shifted so that the limits are the values.
    ref, out = np.tile(REF, (1, 16)), np.tile(OUT, (1, 16))
    mean_option = (mean_abs * 8 - max_abs) / 7
    row = _row(ref, out, VerifyOptions(max_abs=max_abs, mean_abs=mean_option))
    assert thresholds(np.dtype(np.float64), VerifyOptions(max_abs=max_abs, mean_abs=mean_option), 64) == (
        max_abs,
        pytest.approx(mean_abs),
    )
    assert row.passed is passed
    assert (row.note == "") is passed


@pytest.mark.parametrize(("delta", "passed"), [(0.0, True), (1e-9, False), (-0.5, True)])
def test_the_min_cosine_limit_is_inclusive(delta: float, passed: bool) -> None:
    ref, out = np.tile(REF, (1, 2)), np.tile(OUT, (1, 2))  # 8 elements: the cosine alone judges
    cosine = _row(ref, out).cosine
    assert cosine is not None
    row = _row(ref, out, VerifyOptions(min_cosine=cosine + delta))
    assert row.passed is passed
    assert row.note == ""


def test_report_only_passes_any_difference_but_not_nan_that_differ() -> None:
    assert _row(REF, -OUT, VerifyOptions(report_only=True)).passed
    nan_row = _row(np.array([1.0, float("nan")]), np.array([1.0, 2.0]), VerifyOptions(report_only=True))
    assert nan_row.passed is False
    assert nan_row.note == "1 elements are NaN/Inf in one model and not the same in the other"


def test_nan_and_inf_are_left_out_of_the_numbers() -> None:
    inf, nan = float("inf"), float("nan")
    ref = np.array([nan, inf, -inf, 1.0, 3.0])
    out = np.array([nan, inf, inf, nan, 2.0])
    row = _row(ref, out, VerifyOptions(max_abs=1.0, mean_abs=1.0))
    # Finite in both: only the last element; the scale is max(1, 3) (0 for non-finite |ref|).
    assert (row.max_abs, row.mean_abs, row.max_ref, row.mismatches) == (1 / 3, 1 / 3, 3.0, 2)
    assert row.rel_err == pytest.approx(1 / 3)
    assert row.cosine == pytest.approx(1.0)
    assert row.passed is False
    assert row.note == "2 elements are NaN/Inf in one model and not the same in the other"


def test_a_non_finite_reference_counts_as_zero_in_the_magnitude() -> None:
    inf = float("inf")
    row = _row(np.array([inf, 0.5]), np.array([inf, 0.25]), VerifyOptions(report_only=True))
    assert (row.max_ref, row.max_abs, row.mismatches) == (0.5, 0.25, 0)


def test_float16_is_judged_by_its_own_limits() -> None:
    """One fp16 rounding step (2**-10 at 1) passes the default options, raised to 4 eps of fp16."""
    ref = np.array([1.0, 1.0], dtype=np.float16)
    row = _row(ref, np.array([1.0 + 2**-10, 1.0], dtype=np.float16))
    assert (row.max_abs, row.passed, row.note) == (2**-10, True, "")
    assert not _row(ref.astype(np.float32), np.array([1.0 + 2**-10, 1.0], dtype=np.float32)).passed


def test_zero_and_empty_float_outputs() -> None:
    zeros = np.zeros((2, 3))
    same = _row(zeros, zeros.copy())
    assert (same.rel_err, same.cosine, same.max_abs, same.mean_abs, same.passed) == (0.0, 1.0, 0.0, 0.0, True)
    other = _row(zeros, np.ones((2, 3)), VerifyOptions(report_only=True))
    assert (other.rel_err, other.cosine, other.max_abs, other.mean_abs) == (float("inf"), 0.0, 1.0, 1.0)
    gone = _row(np.ones((2, 3)), zeros, VerifyOptions(report_only=True))
    assert (gone.rel_err, gone.cosine) == (1.0, 0.0)
    small = _row(np.array([0.5]), np.array([0.25]), VerifyOptions(report_only=True))
    assert (small.rel_err, small.cosine, small.max_ref) == (0.5, 1.0, 0.5)  # below 1 too
    empty = _row(np.zeros((0, 4)), np.zeros((0, 4)))  # nothing compared: fails (issue 32)
    assert (empty.mean_abs, empty.rel_err, empty.cosine, empty.passed, empty.shape) == (
        0.0,
        0.0,
        1.0,
        False,
        [0, 4],
    )
    assert "empty" in empty.note


def test_exact_types_compare_every_element() -> None:
    row = _row(np.array([1, 5, -3], dtype=np.int64), np.array([1, 2, -3], dtype=np.int64))
    assert row == OutputComparison(
        7, "y", "int64", [3], 3.0, 1.0, 1 / 3, None, 0.0, 1, False, "1 elements differ (exact match required)"
    )
    # Large integers: differences taken in float64, not in the integer type.
    big = _row(np.array([2**40], dtype=np.int64), np.array([-(2**40)], dtype=np.int64))
    assert big.max_abs == 2.0**41
    small = _row(np.array([-100], dtype=np.int8), np.array([100], dtype=np.int8))
    assert (small.max_abs, small.mean_abs) == (200.0, 200.0)
    bools = _row(np.array([True, False, False]), np.array([True, True, True]))
    assert (bools.max_abs, bools.mean_abs, bools.mismatches, bools.rel_err) == (1.0, 2 / 3, 2, 2 / 3)
    same = _row(np.array([4, 4], dtype=np.int32), np.array([4, 4], dtype=np.int32))
    assert same == OutputComparison(7, "y", "int32", [2], 0.0, 0.0, 0.0, None, 0.0, 0, True, "")
    empty = _row(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert (empty.max_abs, empty.mean_abs, empty.rel_err, empty.passed) == (0.0, 0.0, 0.0, False)


def test_strings_compare_as_text() -> None:
    ref = np.array(["1", "b", "c"], dtype=object)
    row = _row(ref, np.array(["1.0", "b", "d"], dtype=object))
    assert row == OutputComparison(
        7,
        "y",
        "string",
        [3],
        1.0,
        2 / 3,
        2 / 3,
        None,
        0.0,
        2,
        False,
        "2 elements differ (exact match required)",
    )
    assert _row(ref, ref.copy()).passed


def test_a_shape_or_type_difference_fails_without_numbers() -> None:
    inf = float("inf")
    row = _row(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    assert row == OutputComparison(
        7,
        "y",
        "float32",
        [2, 3],
        inf,
        inf,
        inf,
        None,
        0.0,
        -1,
        False,
        "candidate gives float32[3, 2], reference float32[2, 3]",
    )
    row = _row(np.zeros(2, np.float32), np.zeros(2, np.float64))
    assert row.note == "candidate gives float64[2], reference float32[2]"


def test_sequences_sum_their_tensors_and_name_the_first_that_fails() -> None:
    options = VerifyOptions(max_abs=0.3, mean_abs=0.1)
    ref = [REF, REF, np.array([1.0])]
    out = [REF.copy(), OUT, np.array([2.0])]
    row = compare_sequences(ref, out, options, length=3, name="s")
    assert (row.length, row.output, row.dtype, row.shape) == (3, "s", "sequence(float64)", [3])
    assert (row.max_abs, row.mean_abs, row.max_ref, row.mismatches) == (1.0, 1.25 / 9, 8.0, 0)
    ref_sq, out_sq = 2 * REF_SQ + 1, REF_SQ + OUT_SQ + 4
    assert row.rel_err == pytest.approx(math.sqrt(0.25 + 1) / math.sqrt(ref_sq))
    assert row.cosine == pytest.approx((REF_SQ + DOT + 2) / math.sqrt(ref_sq * out_sq))
    limits = thresholds(np.dtype(np.float64), options, 1)  # element 2 holds one number
    assert not row.passed
    assert (
        row.note
        == f"element 2: above the limits for float64: max_abs {limits[0]:.3g}, mean_abs {limits[1]:.3g}"
    )
    # Each tensor passes on its own (mean_abs 0.0625 <= 0.1), though not the three together.
    passing = compare_sequences(ref[:2], out[:2], options, length=3, name="s")
    assert (passing.passed, passing.note, passing.shape) == (True, "", [2])


def test_a_float32_sequence_is_judged_as_floats() -> None:
    ref = [REF.astype(np.float32)]
    row = compare_sequences(ref, [OUT.astype(np.float32)], VerifyOptions(), length=1, name="s")
    assert row.dtype == "sequence(float32)"
    assert row.cosine == pytest.approx(COSINE)
    assert row.rel_err == pytest.approx(0.5 / math.sqrt(REF_SQ))


def test_sequences_of_exact_types_and_empty_sequences() -> None:
    ints = [np.array([1, 2]), np.array([3, 4])]
    row = compare_sequences(ints, [np.array([1, 2]), np.array([3, 5])], VerifyOptions(), length=1, name="s")
    assert (row.dtype, row.mismatches, row.max_abs, row.mean_abs, row.cosine) == (
        "sequence(int64)",
        1,
        1.0,
        0.25,
        None,
    )
    assert row.note == "element 1: 1 elements differ (exact match required)"
    both = compare_sequences(ints, [np.array([0, 2]), np.array([3, 0])], VerifyOptions(), length=1, name="s")
    assert (both.mismatches, both.rel_err, both.max_abs) == (2, 0.5, 4.0)
    empty = compare_sequences([], [], VerifyOptions(), length=1, name="s")
    assert (empty.dtype, empty.shape, empty.passed, empty.cosine, empty.mean_abs) == (
        "sequence",
        [0],
        False,  # nothing compared (issue 32)
        None,
        0.0,
    )


def test_sequences_that_cannot_be_compared() -> None:
    inf = float("inf")
    options = VerifyOptions()
    row = compare_sequences([REF], [REF, REF], options, length=2, name="s")
    assert row == OutputComparison(
        2,
        "s",
        "sequence(float64)",
        [1],
        inf,
        inf,
        inf,
        None,
        0.0,
        -1,
        False,
        "candidate sequence has 2 elements, reference 1",
    )
    row = compare_sequences([REF, REF], [REF, REF[:1]], options, length=2, name="s")
    assert (row.length, row.output) == (2, "s")
    assert row.note == "element 1: candidate gives float64[1, 2], reference float64[2, 2]"
    assert (row.dtype, row.shape, row.passed) == ("sequence(float64)", [2], False)
    row = compare_sequences([REF, REF], [REF, "x"], options, length=2, name="s")
    assert row.note == "element 1: cannot compare a ndarray with a str"
    assert compare_sequences(["a"], ["a"], options, length=2, name="s").note.startswith("element 0: ")


def test_compare_outputs_dispatches_on_the_kind_of_value() -> None:
    options = VerifyOptions()
    assert compare_outputs(REF, REF.copy(), options, length=1, name="y") == OutputComparison(
        1, "y", "float64", [2, 2], 0.0, 0.0, 0.0, pytest.approx(1.0), 8.0, 0, True, "", sample_rel_err=0.0
    )
    seq = compare_outputs([REF], [REF], options, length=4, name="z")
    assert (seq.dtype, seq.passed, seq.length, seq.output) == ("sequence(float64)", True, 4, "z")
    mixed = compare_outputs([REF], REF, options, length=5, name="w")
    assert (mixed.length, mixed.output) == (5, "w")
    assert (mixed.note, mixed.dtype, mixed.passed) == (
        "candidate gives a tensor, reference a sequence",
        "sequence",
        False,
    )
    mixed = compare_outputs(REF, [REF], options, length=1, name="y")
    assert (mixed.note, mixed.dtype) == ("candidate gives a sequence, reference a tensor", "tensor")
    maps = compare_outputs({"a": 1}, {"a": 1}, options, length=1, name="y")
    assert (maps.note, maps.dtype, maps.passed) == (
        "cannot compare outputs of type dict (tensors and sequences of tensors only)",
        "dict",
        False,
    )
