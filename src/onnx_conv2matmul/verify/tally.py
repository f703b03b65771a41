"""The running sums of one output's comparison, read block by block.

Each float difference is divided by the magnitude of the quietest slice of the reference
output that holds the element (see :func:`element_scales`); NaN and Inf that differ between
the models are mismatches, and every element of an exact type (integer, bool, string) must
match. Outputs are read in blocks of at most :data:`CHUNK_ELEMENTS` elements, twice: once in
their own precision for the slices' magnitudes (a maximum of absolute values is exact in any
precision), once in float64 for the differences and the sums. So the memory a comparison adds
does not grow with the outputs, and the figures are running sums over the blocks; the verdict
on them is :mod:`~onnx_conv2matmul.verify.compare`'s.
"""

# Mutation testing (docs/mutation.md) covers this module from _magnitude() on; the cutting into
# blocks sits between these pragmas.
# pragma: no mutate start
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

CHUNK_ELEMENTS = 1 << 18
"""The most elements of one output a comparison works on at once (2 MiB of float64)."""


def blocks(shape: tuple[int, ...], chunk: int = CHUNK_ELEMENTS) -> Iterator[tuple[slice, ...]]:
    """Index tuples that cut an array of ``shape`` into blocks of at most ``chunk`` elements.

    Each block keeps every axis (one index is a slice of length 1): the trailing axes that
    fit whole, a range of the axis before them, single indices before that. An array with
    no element has no block; a 0-d array is one block.
    """
    ndim = len(shape)
    if any(n == 0 for n in shape):
        return
    tail, k = 1, ndim
    while k > 0 and tail * shape[k - 1] <= chunk:
        tail *= shape[k - 1]
        k -= 1
    if k == 0:
        yield tuple(slice(0, n) for n in shape)
        return
    axis = k - 1
    step = max(1, chunk // tail)
    whole = tuple(slice(0, n) for n in shape[k:])
    for lead in np.ndindex(*shape[:axis]):
        head = tuple(slice(i, i + 1) for i in lead)
        for start in range(0, shape[axis], step):
            yield (*head, slice(start, min(start + step, shape[axis])), *whole)


def _block(array: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """The block ``index`` of ``array`` as an array (a 0-d array stays one)."""
    return array[index] if index else array[...]


# pragma: no mutate end
def _magnitude(ref: np.ndarray) -> np.ndarray:
    """``|ref|`` with its non-finite values set to 0, in the reference's own precision."""
    return np.where(np.isfinite(ref), np.abs(ref), 0)


@dataclasses.dataclass
class SliceScales:
    """Per axis, each slice's scale ``max(1, max magnitude in the slice)``; see :func:`element_scales`.

    ``per_axis[a]`` is None for an axis shorter than 2 (it makes no slices); ``whole`` is
    ``max(1, peak)``, where ``peak`` is the largest magnitude of the output (0 without elements).
    """

    peak: float
    per_axis: list[np.ndarray | None]

    @property
    def whole(self) -> float:
        return max(1.0, self.peak)

    def at(self, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The element scales of the block ``index`` (of ``shape``): its smallest slice scale."""
        scale = np.full(shape, self.whole)
        for axis, per_slice in enumerate(self.per_axis):
            if per_slice is None:
                continue
            view = [1] * len(shape)
            view[axis] = shape[axis]
            np.minimum(scale, per_slice[index[axis]].reshape(view), out=scale)
        return scale


def slice_scales(ref: np.ndarray, chunk: int = CHUNK_ELEMENTS) -> SliceScales:
    """The slices' scales of the reference output ``ref``, read in blocks of ``chunk`` elements."""
    peak = 0.0
    maxima: list[np.ndarray | None] = [np.zeros(n) if n >= 2 else None for n in ref.shape]
    for index in blocks(ref.shape, chunk):
        magnitude = _magnitude(_block(ref, index))
        peak = max(peak, float(magnitude.max(initial=0.0)))
        for axis, found in enumerate(maxima):
            if found is None:
                continue
            others = tuple(a for a in range(ref.ndim) if a != axis)
            part = found[index[axis]]
            np.maximum(part, magnitude.max(axis=others, initial=0.0), out=part)
    per_axis = [None if m is None else np.maximum(1.0, m) for m in maxima]
    return SliceScales(peak, per_axis)


def element_scales(magnitude: np.ndarray) -> np.ndarray:
    """What each element's difference is divided by: the magnitude of its quietest slice.

    ``magnitude`` is ``|ref|`` with non-finite values set to 0. Along each axis of length
    > 1, slice ``i`` (every element whose index on that axis is ``i``) has the scale
    ``max(1, max magnitude in the slice)``; an element's scale is the smallest scale among
    the slices that contain it (``max(1, max magnitude)`` when no axis is longer than 1).

    So a difference is judged against the magnitude of the channel, time step or row it
    lives in, whichever is quietest: a loud channel does not hide an error confined to a
    quiet one, while a difference is never judged against less than the largest value of
    a slice it belongs to, nor against less than 1. An output whose values are all below 1 is
    also held to a relative error (:data:`onnx_conv2matmul.verify.compare.SMALL_OUTPUT_REL_ERR`).

    Limit: an exact rewrite differs by rounding, about one machine epsilon of the terms
    summed into an element. Where those terms are far larger than every value of the
    element's quietest slice (heavy cancellation, e.g. a channel that a ReLU keeps near
    zero although its inputs reach thousands), fp32 rounding can exceed the default
    ``max_abs``; that happens once the terms are about 300x the slice's magnitude.
    """
    whole = tuple(slice(0, n) for n in magnitude.shape)
    return slice_scales(magnitude).at(whole, magnitude.shape)


def nonfinite_mismatches(ref: np.ndarray, out: np.ndarray) -> int:
    """How many elements are NaN or Inf in either array without being the same in both.

    NaN matches NaN and an infinity matches the infinity of the same sign; a finite
    value matches no NaN or Inf.
    """
    odd = ~(np.isfinite(ref) & np.isfinite(out))
    same = (ref == out) | (np.isnan(ref) & np.isnan(out))
    return int(np.count_nonzero(odd & ~same))


@dataclasses.dataclass
class _Tally:
    """Sums and maxima over the compared elements of one tensor; a sequence adds its tensors'.

    ``diff`` is the scaled absolute difference for floats (see :func:`element_scales`),
    ``|ref - out|`` for numbers that must match exactly, and 0 or 1 for strings.
    ``mismatches`` counts elements that differ where an exact match is required: every
    element of an exact type, the NaN/Inf of a float type.
    """

    exact: bool
    count: int = 0
    elements: int = 0
    ref_nonfinite: int = 0
    max_diff: float = 0.0
    sum_diff: float = 0.0
    ref_sq: float = 0.0
    out_sq: float = 0.0
    diff_sq: float = 0.0
    dot: float = 0.0
    max_ref: float = 0.0
    mismatches: int = 0

    def add(self, other: _Tally) -> None:
        self.count += other.count
        self.elements += other.elements
        self.ref_nonfinite += other.ref_nonfinite
        self.max_diff = max(self.max_diff, other.max_diff)
        self.sum_diff += other.sum_diff
        self.ref_sq += other.ref_sq
        self.out_sq += other.out_sq
        self.diff_sq += other.diff_sq
        self.dot += other.dot
        self.max_ref = max(self.max_ref, other.max_ref)
        self.mismatches += other.mismatches


def _float_block(ref: np.ndarray, out: np.ndarray, scale: np.ndarray) -> _Tally:
    """Scaled differences over the places finite in both; NaN/Inf that differ are mismatches."""
    r = ref.astype(np.float64).ravel()
    o = out.astype(np.float64).ravel()
    both = np.isfinite(r) & np.isfinite(o)
    ref_nonfinite = 0
    if both.all():
        rf, of, mismatches = r, o, 0
        scale = scale.ravel()
    else:
        rf, of, mismatches = r[both], o[both], nonfinite_mismatches(r, o)
        scale = scale.ravel()[both]
        ref_nonfinite = int(np.count_nonzero(~np.isfinite(r)))
    diff = rf - of
    scaled = np.abs(diff) / scale
    return _Tally(
        exact=False,
        count=int(scaled.size),
        elements=int(r.size),
        ref_nonfinite=ref_nonfinite,
        max_diff=float(scaled.max(initial=0.0)),
        sum_diff=float(scaled.sum()),
        ref_sq=_dot(rf, rf),
        out_sq=_dot(of, of),
        diff_sq=_dot(diff, diff),
        dot=_dot(rf, of),
        mismatches=mismatches,
    )


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``sum(a * b)`` in one thread (a BLAS dot would wake its threads for every block)."""
    return float(np.einsum("i,i->", a, b))


def _float_tally(ref: np.ndarray, out: np.ndarray, chunk: int = CHUNK_ELEMENTS) -> _Tally:
    """:func:`_float_block` over every block, each difference scaled by :func:`element_scales`."""
    scales = slice_scales(ref, chunk)
    total = _Tally(exact=False)
    for index in blocks(ref.shape, chunk):
        part = _block(ref, index)
        total.add(_float_block(part, _block(out, index), scales.at(index, part.shape)))
    total.max_ref = scales.peak
    return total


def _exact_block(ref: np.ndarray, out: np.ndarray) -> _Tally:
    """Element-wise equality; strings are compared as text, never as numbers."""
    differ = np.asarray(ref != out, dtype=bool)
    if ref.dtype == object:
        diff = differ.astype(np.float64)
    else:
        diff = np.abs(ref.astype(np.float64) - out.astype(np.float64))
    return _Tally(
        exact=True,
        count=int(diff.size),
        elements=int(diff.size),
        max_diff=float(diff.max(initial=0.0)),
        sum_diff=float(diff.sum()),
        mismatches=int(np.count_nonzero(differ)),
    )


def _exact_tally(ref: np.ndarray, out: np.ndarray, chunk: int = CHUNK_ELEMENTS) -> _Tally:
    total = _Tally(exact=True)
    for index in blocks(ref.shape, chunk):
        total.add(_exact_block(_block(ref, index), _block(out, index)))
    return total


def _tally(ref: np.ndarray, out: np.ndarray) -> _Tally:
    if np.issubdtype(ref.dtype, np.floating):
        return _float_tally(ref, out)
    return _exact_tally(ref, out)


def cannot_compare(tally: _Tally) -> str | None:
    """Why a tensor's comparison compared nothing that counts, or None when it did.

    An output without elements (an empty batch), and a float output with no element finite in
    both models (the original gives NaN or Inf everywhere: its inputs broke it, or it
    overflowed), cannot tell a right candidate from a wrong one: they fail in every criterion.
    NaN and Inf at some places only (masked frames, padding) leave the finite places to judge;
    where they sit must be the same in both models (a mismatch otherwise).
    """
    if tally.elements == 0:
        return "no element to compare: the output is empty on these inputs"
    if tally.count == 0:
        return (
            f"no element is finite in both models (the original gives NaN or Inf at {tally.ref_nonfinite}"
            f" of {tally.elements}): nothing to compare (inputs on which it gives finite numbers are needed)"
        )
    return None


def nonfinite_note(tally: _Tally) -> str:
    """What a comparison that passed with NaN or Inf in the original compared, or ``""``."""
    if tally.exact or not tally.ref_nonfinite or tally.mismatches:
        return ""
    return (
        f"NaN/Inf at the same {tally.ref_nonfinite} places in both; the {tally.count} finite"
        f" elements compared"
    )
