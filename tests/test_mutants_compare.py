"""Tests written to kill mutants of ``verify/compare.py`` and ``verify/tally.py`` that survived
(docs/mutation.md): the cosine similarity and relative error of each sample, which the accuracy
floor is checked on, and the tallies added up over blocks.

Each expected value is worked out by hand (or, for the blocked sums, by numpy in float64 on the
whole array), so a change in what is summed, over which places, in which precision, or how the
samples are cut, changes a number here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_conv2matmul.verify.compare import (
    TINY_ELEMENTS,
    _cosine,
    _rel_err,
    sample_cosines,
    sample_rel_errs,
)
from onnx_conv2matmul.verify.tally import _exact_tally, _float_tally


def _f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


@pytest.mark.parametrize(
    ("ref", "out", "expected"),
    [
        (_f32(3, 4), _f32(3, 4), 1.0),
        (_f32(3, 4), _f32(4, 3), 24 / 25),
        (_f32(3, 4), _f32(-3, -4), -1.0),
        (_f32(1, 0), _f32(0, 1), 0.0),
        (_f32(3, np.nan, 4), _f32(3, 100, 4), 1.0),  # a place not finite in one is left out
        (_f32(3, 7, 4), _f32(3, np.inf, 4), 1.0),
        (_f32(0, 0), _f32(0, 0), 1.0),  # both zero: alike
        (_f32(0, 0), _f32(1, 0), 0.0),  # one zero: nothing alike
        (_f32(1, 0), _f32(0, 0), 0.0),
        (_f32(np.nan), _f32(np.nan), 1.0),  # nothing finite in both: as both zero
        (_f32(1e20, 1e20), _f32(1e20, 1e20), 1.0),  # squares overflow float32: summed in float64
    ],
)
def test_cosine(ref: np.ndarray, out: np.ndarray, expected: float) -> None:
    assert _cosine(ref, out) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 18])
def test_cosine_in_blocks_is_the_whole_arrays(chunk: int) -> None:
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((5, 3)).astype(np.float32)
    out = ref + 0.5 * rng.standard_normal((5, 3)).astype(np.float32)
    r, o = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    expected = float(r @ o / (np.linalg.norm(r) * np.linalg.norm(o)))
    assert _cosine(ref, out, chunk) == pytest.approx(expected, rel=1e-12)


def test_sample_cosines_cut_by_the_first_axis_when_it_is_the_samples() -> None:
    ref = np.array([[1, 0], [0, 1], [3, 4]], dtype=np.float32)
    out = np.array([[1, 0], [1, 0], [4, 3]], dtype=np.float32)
    assert sample_cosines(ref, out, 3) == pytest.approx([1.0, 0.0, 24 / 25])
    whole = float(np.dot(ref.ravel(), out.ravel()) / (np.linalg.norm(ref) * np.linalg.norm(out)))
    assert sample_cosines(ref, out, 1) == pytest.approx([whole])  # one sample: the whole output
    assert sample_cosines(ref, out, 2) == pytest.approx([whole])  # the first axis is not the samples
    scalar = np.array(2.0, dtype=np.float32)
    assert sample_cosines(scalar, scalar, 3) == [1.0]  # no axis to cut


@pytest.mark.parametrize(
    ("ref", "out", "expected"),
    [
        (_f32(3, 4), _f32(3, 4), 0.0),
        (_f32(3, 4), _f32(0, 0), 1.0),
        (_f32(3, 4), _f32(3, 5), 0.2),
        (_f32(3, np.nan, 4), _f32(3, 1, 4), 0.0),  # a place not finite in one is left out
        (_f32(3, 1, 4), _f32(3, -np.inf, 4), 0.0),
        (_f32(0, 0), _f32(0, 0), 0.0),
        (_f32(0, 0), _f32(0, 1), math.inf),
        (_f32(1e20, 1e20), _f32(1e20, 0), 1 / math.sqrt(2)),  # in float64: no overflow
    ],
)
def test_rel_err(ref: np.ndarray, out: np.ndarray, expected: float) -> None:
    assert _rel_err(ref, out) == pytest.approx(expected, rel=1e-12)


def test_sample_rel_errs_only_for_tiny_outputs() -> None:
    tiny = TINY_ELEMENTS - 1
    ref = np.full((2, tiny), 2.0, dtype=np.float32)
    out = ref.copy()
    out[1, 0] = 0.0  # row 1 off by 2 at one place, its norm 2 * sqrt(tiny)
    assert sample_rel_errs(ref, out, 2) == pytest.approx([0.0, 1 / math.sqrt(tiny)])
    assert sample_rel_errs(ref, out, 1) is None  # one sample of 2 * tiny elements: not tiny
    part_ref, part_out = ref[:, :3], out[:, :3]  # 6 elements, one sample: 2 / (2 * sqrt(6))
    assert sample_rel_errs(part_ref, part_out, 1) == pytest.approx([1 / math.sqrt(6)])
    assert sample_rel_errs(part_ref, part_out, 3) == pytest.approx([1 / math.sqrt(6)])  # axis is not 3
    wide = np.ones((2, TINY_ELEMENTS), dtype=np.float32)
    assert sample_rel_errs(wide, wide, 2) is None  # TINY_ELEMENTS per sample is not tiny
    assert sample_rel_errs(wide[:, :-1], wide[:, :-1], 2) == [0.0, 0.0]
    empty = np.zeros((2, 0), dtype=np.float32)
    assert sample_rel_errs(empty, empty, 2) is None
    scalar = np.array(2.0, dtype=np.float32)
    assert sample_rel_errs(scalar, np.array(1.0, dtype=np.float32), 3) == pytest.approx([0.5])


@pytest.mark.parametrize("chunk", [1, 7, 20, 1 << 18])
def test_tallies_in_blocks_add_up_to_the_whole_arrays(chunk: int) -> None:
    """Cut into blocks of ``chunk`` elements or not, a tensor's sums and counts are the same."""
    rng = np.random.default_rng(4)
    ref = rng.standard_normal((6, 5, 4)).astype(np.float32)
    out = ref + 0.01 * rng.standard_normal((6, 5, 4)).astype(np.float32)
    ref[1, 2, 3] = np.nan
    out[1, 2, 3] = np.nan  # the same NaN: not a mismatch
    ref[4, 0, 0] = np.inf
    out[4, 0, 0] = 1.0  # an Inf that differs: a mismatch
    blocked = _float_tally(ref, out, chunk)
    assert blocked.elements == ref.size
    assert blocked.count == ref.size - 2  # the places finite in both
    assert blocked.ref_nonfinite == 2
    assert blocked.mismatches == 1
    finite = np.isfinite(ref) & np.isfinite(out)
    r, o = ref[finite].astype(np.float64), out[finite].astype(np.float64)
    assert blocked.ref_sq == pytest.approx(float(r @ r), rel=1e-12)
    assert blocked.out_sq == pytest.approx(float(o @ o), rel=1e-12)
    assert blocked.dot == pytest.approx(float(r @ o), rel=1e-12)
    assert blocked.diff_sq == pytest.approx(float((r - o) @ (r - o)), rel=1e-12)
    whole = _float_tally(ref, out, 1 << 18)
    assert blocked.max_diff == pytest.approx(whole.max_diff, rel=1e-12)
    assert blocked.sum_diff == pytest.approx(whole.sum_diff, rel=1e-12)
    assert blocked.max_ref == whole.max_ref

    ints = rng.integers(-5, 5, size=(6, 5, 4))
    other = ints.copy()
    other[0, 0, 0] += 3
    other[5, 4, 3] -= 2
    exact = _exact_tally(ints, other, chunk)
    assert (exact.elements, exact.count, exact.mismatches) == (ints.size, ints.size, 2)
    assert (exact.max_diff, exact.sum_diff) == (3.0, 5.0)


def test_two_samples_and_one_axis_are_cut_too() -> None:
    ref = np.array([[1, 0], [3, 4]], dtype=np.float32)
    out = np.array([[0, 1], [3, 4]], dtype=np.float32)
    assert sample_cosines(ref, out, 2) == pytest.approx([0.0, 1.0])  # two samples: one cosine each
    flat_ref, flat_out = _f32(1, 2, -3), _f32(1, -2, -3)  # one value per sample
    assert sample_cosines(flat_ref, flat_out, 3) == pytest.approx([1.0, -1.0, 1.0])
    assert sample_rel_errs(_f32(2, 2, 2), _f32(2, 1, 2), 3) == pytest.approx([0.0, 0.5, 0.0])
