"""How two models' outputs are compared: the numbers of a row and its verdict.

Each float difference is divided by the magnitude of the quietest slice of the reference
output that holds the element, and the figures are running sums over blocks of the outputs
(:mod:`~onnx_conv2matmul.verify.tally`). NaN and Inf must sit at the
same places with the same values in both models; integer, bool and string outputs must
match exactly; a sequence output must hold as many tensors as the reference's, each
passing on its own.

A comparison counts only when it compared numbers: an output with no element finite in both
models (the original gives NaN or Inf everywhere: the inputs broke it, or it overflowed), or
that holds no element (an empty batch), fails in every criterion, report-only included, with a
note that says so. NaN and Inf at some places only are compared by place (the same in both)
and the finite elements by value; the row's note says how many of each. A cosine cannot judge an
output of fewer than :data:`TINY_ELEMENTS` elements per sample (of one element it only sees
the sign): there a minimum cosine ``c`` also bounds each sample's relative error
``|ref - out| / |ref|`` by ``sqrt(1/c^2 - 1)``, the relative error of an error orthogonal to
the reference at cosine ``c`` (0.142 for the floor 0.99), and the row's
:attr:`OutputComparison.worst_cosine` is the lesser of the cosine and that bound's inverse
``1 / sqrt(1 + e^2)``. The mean limit of the scaled difference shrinks to the maximum's for
small outputs (see :func:`thresholds`): a mean over two elements is no quieter than their
largest.
"""

# Mutation testing (docs/mutation.md) covers this module from thresholds() to
# compare_outputs(); the rest sits between these pragmas.
# pragma: no mutate start
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.verify.options import Criterion, VerifyOptions
from onnx_conv2matmul.verify.tally import CHUNK_ELEMENTS, _Tally, _tally, cannot_compare, nonfinite_note

SMALL_OUTPUT_REL_ERR = 0.1
"""The relative error ``|ref - out| / |ref|`` (over the finite places) an output whose values are
all below 1 in magnitude may have under the exactness criterion, beside its scaled differences.
Those are taken against at least 1, as the rounding of an exact rewrite can be absolute: in a
sigmoid's tail the output's relative error is its logit's absolute one, and PP-OCRv4's detector,
whose map is around 2e-5 on synthetic inputs, differs by a relative 0.022 once exactly rewritten
(its logits, near -11, are sums that cancel). An output of values around 1e-6 that doubled
(relative error 1) or flipped its sign (2) passed on the scaled differences alone."""

TINY_ELEMENTS = 8
"""Float outputs with fewer elements per sample than this are judged by relative error too
under a minimum cosine (a score, a probability, a few logits: the cosine of one number is its
sign)."""


def agreement_floor(dtype: np.dtype[Any], options: VerifyOptions) -> float | None:
    """The share of elements an integer or bool output must keep under a minimum cosine ``c``:
    ``max(0, c)``; None where it must match exactly (no minimum cosine, or strings).

    Quantizing changes float weights only, so an integer output that differs was computed from
    floats (an ArgMax of logits, TopK indices, a threshold): the share of its elements that agree
    is the measure a cosine stands for there (issue 43), not an exact match that would veto every
    setting. A minimum cosine of -1 accepts anything, these outputs included."""
    if options.min_cosine is None or dtype.kind not in "iub":  # strings and floats: no
        return None
    return max(0.0, options.min_cosine)


def cosine_rel_err(min_cosine: float) -> float:
    """The relative error a minimum cosine allows a tiny output: ``sqrt(1/c^2 - 1)`` (inf for ``c <= 0``)."""
    if min_cosine <= 0:
        return float("inf")
    return float(np.sqrt(max(0.0, 1.0 / (min_cosine * min_cosine) - 1.0)))


def rel_err_cosine(rel_err: float) -> float:
    """The cosine a relative error stands for, the inverse of :func:`cosine_rel_err`: ``1/sqrt(1+e^2)``."""
    if not np.isfinite(rel_err):
        return 0.0
    return float(1.0 / np.sqrt(1.0 + rel_err * rel_err))


@dataclasses.dataclass
class OutputComparison:
    """One output of both models in one run.

    ``max_abs`` and ``mean_abs`` are over the scaled differences for floats (see
    :func:`element_scales`), over ``|ref - out|`` for integers and bools, and over 0 or 1
    per element for strings. ``mismatches`` counts elements that must match exactly and
    do not (NaN/Inf for floats; -1 when no comparison could be made). A sequence output
    has the dtype ``sequence(<type>)`` and the shape ``[number of tensors]``. ``length``
    is the run's length (see :class:`onnx_conv2matmul.verify.plan.Run`).

    ``samples`` is how many samples (batch rows, see :func:`sample_cosines`) a float output
    holds; with more than one, ``sample_cosine`` is the worst sample's cosine similarity
    (None otherwise: the output is one sample, ``cosine`` is its cosine), and a minimum
    cosine similarity must hold for every sample. ``sample_rel_err`` is the worst sample's
    relative error for a float output of fewer than :data:`TINY_ELEMENTS` elements per
    sample (None for larger outputs and exact types), which a minimum cosine bounds too.
    ``task`` is how the output's labels are counted when it holds class scores
    (:func:`onnx_conv2matmul.verify.labels.output_tasks`: ``labels`` or ``frames``; empty
    otherwise), ``labels`` how many labels fp32 gives there and ``label_flips`` how many of
    them (the class of the largest score) differ (:func:`onnx_conv2matmul.verify.labels.count`).
    """

    length: int
    output: str
    dtype: str
    shape: list[int]
    max_abs: float
    mean_abs: float
    rel_err: float
    cosine: float | None
    max_ref: float
    mismatches: int
    passed: bool
    note: str = ""
    samples: int = 1
    sample_cosine: float | None = None
    sample_rel_err: float | None = None
    labels: int = 0
    label_flips: int = 0
    task: str = ""

    @property
    def worst_cosine(self) -> float | None:
        """The cosine similarity of the worst sample (None for exact types); for a tiny output
        the lesser of it and the cosine its worst relative error stands for (:func:`rel_err_cosine`)."""
        if self.cosine is None:
            return None
        worst = self.cosine if self.sample_cosine is None else min(self.cosine, self.sample_cosine)
        if self.sample_rel_err is not None:
            worst = min(worst, rel_err_cosine(self.sample_rel_err))
        return worst

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def failure(
        cls, length: int, name: str, note: str, dtype: str = "", shape: list[int] | None = None
    ) -> OutputComparison:
        """A comparison that could not be made (shape, type or run failure)."""
        inf = float("inf")
        return cls(length, name, dtype, shape or [], inf, inf, inf, None, 0.0, -1, False, note)


def worst_cosine(rows: Sequence[OutputComparison]) -> float | None:
    """The lowest :attr:`OutputComparison.worst_cosine` of ``rows`` (None: they measured none)."""
    return min((c for c in (row.worst_cosine for row in rows) if c is not None), default=None)


# pragma: no mutate end
def thresholds(dtype: np.dtype[Any], options: VerifyOptions, elements: int = 0) -> tuple[float, float]:
    """(max_abs, mean_abs) limits for an output type and size: the options, raised to what the
    type can hold and to what a mean over ``elements`` elements can be.

    Conv and MatMul accumulate in different orders, so a correct fp16 rewrite differs by an
    fp16 rounding step. The limits never go below 4 and 0.5 machine epsilons of the type
    (fp16: 3.9e-3 and 4.9e-4; fp32 and fp64 keep the options' values).

    The mean limit is sized for large outputs, whose rounding errors mostly sit far below
    their largest; a mean over a few elements is about as large as their maximum (one
    element: equal). With ``elements`` (the count compared, 0: large), the mean limit is
    ``mean + (max - mean) / sqrt(elements)``: the maximum's for one element, within 10% of
    the option's beyond ten thousand.
    """
    eps = float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0
    max_limit, mean_limit = max(options.max_abs, 4 * eps), max(options.mean_abs, 0.5 * eps)
    if elements > 0 and max_limit > mean_limit:
        mean_limit += (max_limit - mean_limit) / float(np.sqrt(elements))
    return max_limit, mean_limit


def _type_name(array: np.ndarray) -> str:
    """The element type as reported: onnxruntime gives string tensors as object arrays."""
    return "string" if array.dtype == object else str(array.dtype)


def _tensor_problem(ref: Any, out: Any) -> str | None:
    """Why two values cannot be compared element-wise, or None when they can."""
    if not isinstance(ref, np.ndarray) or not isinstance(out, np.ndarray):
        return f"cannot compare a {type(ref).__name__} with a {type(out).__name__}"
    if ref.shape != out.shape or ref.dtype != out.dtype:
        given = f"{_type_name(out)}{list(out.shape)}"
        return f"candidate gives {given}, reference {_type_name(ref)}{list(ref.shape)}"
    return None


def _comparison(
    tally: _Tally,
    dtype: np.dtype[Any],
    options: VerifyOptions,
    *,
    length: int,
    name: str,
    type_name: str,
    shape: list[int],
    sample_cosines: Sequence[float] = (),
    sample_rel_errs: Sequence[float] | None = None,
) -> OutputComparison:
    """The numbers and the verdict for one tensor (or a sequence's tensors together).

    Floats: ``rel_err`` is ``|ref - out| / |ref|`` and ``cosine`` the cosine similarity,
    both over the places finite in both; with ``sample_cosines`` (one per sample, more
    than one), a minimum cosine similarity must hold for the worst of them too; with
    ``sample_rel_errs`` (a tiny output, see :data:`TINY_ELEMENTS`), a minimum cosine bounds
    the worst relative error too (:func:`cosine_rel_err`). Exact types: ``rel_err`` is the
    share of elements that differ and ``cosine`` is None. Whatever the criterion, an output
    that compared nothing that counts fails (:func:`cannot_compare`).
    """
    mean_abs = tally.sum_diff / tally.count if tally.count else 0.0
    problem = cannot_compare(tally)
    if tally.exact:
        rel_err = tally.mismatches / tally.count if tally.count else 0.0
        passed = tally.mismatches == 0 and problem is None
        note = f"{tally.mismatches} elements differ (exact match required)" if tally.mismatches else ""
        floor = agreement_floor(dtype, options)
        if floor is not None and tally.mismatches and problem is None:
            agreement = 1.0 - rel_err
            passed = agreement >= floor
            verdict = "meets" if passed else "below"
            note = (
                f"{tally.mismatches} of {tally.count} elements differ: agreement {agreement:.2%},"
                f" {verdict} the {floor:.0%} that a minimum cosine of {options.min_cosine:g} asks of an"
                " integer output"
            )
        return OutputComparison(
            length,
            name,
            type_name,
            shape,
            tally.max_diff,
            mean_abs,
            rel_err,
            None,
            0.0,
            tally.mismatches,
            passed,
            note or problem or "",
        )
    norm_ref, norm_out, norm_diff = (float(np.sqrt(v)) for v in (tally.ref_sq, tally.out_sq, tally.diff_sq))
    rel_err = norm_diff / norm_ref if norm_ref > 0 else (0.0 if norm_diff == 0 else np.inf)
    if norm_ref > 0 and norm_out > 0:
        cosine = tally.dot / (norm_ref * norm_out)
    else:
        cosine = 1.0 if norm_ref == norm_out else 0.0
    worst_sample = min(sample_cosines) if len(sample_cosines) > 1 else None
    worst_rel = max(sample_rel_errs) if sample_rel_errs else None
    note = ""
    if tally.mismatches:
        passed = False
        note = f"{tally.mismatches} elements are NaN/Inf in one model and not the same in the other"
    elif problem is not None:
        passed, note = False, problem
    elif options.criterion is Criterion.REPORT_ONLY:
        passed = True
    elif options.min_cosine is not None:
        passed = min(cosine, cosine if worst_sample is None else worst_sample) >= options.min_cosine
        if not passed and worst_sample is not None and worst_sample < options.min_cosine <= cosine:
            note = f"the worst of {len(sample_cosines)} samples is below the minimum"
        limit = cosine_rel_err(options.min_cosine)
        if passed and worst_rel is not None and not worst_rel <= limit:
            passed = False
            per = max(1, tally.elements // max(1, len(sample_cosines)))
            note = (
                f"relative error {worst_rel:.3g} above {limit:.3g}, the bound a minimum cosine of"
                f" {options.min_cosine:g} sets on an output of {per} element(s) per sample"
            )
    else:
        max_limit, mean_limit = thresholds(dtype, options, tally.count)
        passed = tally.max_diff <= max_limit and mean_abs <= mean_limit
        if not passed:
            note = f"above the limits for {dtype}: max_abs {max_limit:.3g}, mean_abs {mean_limit:.3g}"
        elif 0 < tally.max_ref < 1 and not rel_err <= SMALL_OUTPUT_REL_ERR:
            passed = False
            note = (
                f"relative error {rel_err:.3g} above {SMALL_OUTPUT_REL_ERR:g} on an output whose values"
                f" are all below 1 (largest |ref| {tally.max_ref:.3g})"
            )
    if passed and not note:
        note = nonfinite_note(tally)
    return OutputComparison(
        length,
        name,
        type_name,
        shape,
        tally.max_diff,
        mean_abs,
        rel_err,
        cosine,
        tally.max_ref,
        tally.mismatches,
        passed,
        note,
        max(1, len(sample_cosines)),
        worst_sample,
        worst_rel,
    )


def _cosine(ref: np.ndarray, out: np.ndarray, chunk: int = CHUNK_ELEMENTS) -> float:
    """Cosine similarity over the places finite in both; 1 when both are zero there, 0 when one is."""
    r, o = ref.reshape(-1), out.reshape(-1)
    dot = ref_sq = out_sq = 0.0
    for start in range(0, r.size, chunk):
        a = r[start : start + chunk].astype(np.float64)
        b = o[start : start + chunk].astype(np.float64)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            # Selecting copies the block: only where a place is NaN or Inf (8x the time otherwise).
            both = np.isfinite(a) & np.isfinite(b)
            a, b = a[both], b[both]
        dot += float(np.dot(a, b))
        ref_sq += float(np.dot(a, a))
        out_sq += float(np.dot(b, b))
    if ref_sq > 0 and out_sq > 0:
        return dot / (float(np.sqrt(ref_sq)) * float(np.sqrt(out_sq)))
    return 1.0 if ref_sq == out_sq else 0.0


def sample_cosines(ref: np.ndarray, out: np.ndarray, samples: int) -> list[float]:
    """The cosine similarity of each sample of a float output (same shapes), finite places only.

    When ``samples`` is above 1 and the output's first axis has that length, each index of
    that axis is a sample (a batch row of the inputs); otherwise the output is one sample.
    One cosine over a whole batch lets a few rows that went wrong hide among many that did
    not: a minimum is meant for every sample.
    """
    if samples > 1 and ref.ndim >= 1 and ref.shape[0] == samples:
        return [_cosine(ref[i], out[i]) for i in range(samples)]
    return [_cosine(ref, out)]


def _rel_err(ref: np.ndarray, out: np.ndarray) -> float:
    """``|ref - out| / |ref|`` over the places finite in both (0 when both are 0, inf when only ref is)."""
    r, o = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    both = np.isfinite(r) & np.isfinite(o)
    r, o = r[both], o[both]
    diff, norm = float(np.linalg.norm(r - o)), float(np.linalg.norm(r))
    if norm > 0:
        return diff / norm
    return 0.0 if diff == 0 else float("inf")


def sample_rel_errs(ref: np.ndarray, out: np.ndarray, samples: int) -> list[float] | None:
    """Each sample's relative error of a tiny float output (fewer than :data:`TINY_ELEMENTS`
    elements per sample, samples as :func:`sample_cosines` cuts them); None for a larger one."""
    per_sample = samples > 1 and ref.ndim >= 1 and ref.shape[0] == samples
    count = samples if per_sample else 1
    if ref.size == 0 or ref.size // count >= TINY_ELEMENTS:
        return None
    if per_sample:
        return [_rel_err(ref[i], out[i]) for i in range(samples)]
    return [_rel_err(ref, out)]


def compare_arrays(
    ref: np.ndarray,
    out: np.ndarray,
    options: VerifyOptions,
    *,
    length: int,
    name: str,
    samples: int = 1,
    task: str = "",
) -> OutputComparison:
    """Compare one tensor output: floats by the options' criterion, other types exactly.

    A shape or type difference fails. ``samples``: the batch rows of the inputs that made the
    outputs; a float output whose first axis has that many (above 1) is judged per sample
    too (see :func:`sample_cosines`). ``task``: how its labels are counted, when it holds class
    scores (the row's counts; the check judges them over all its rows).
    """
    problem = _tensor_problem(ref, out)
    if problem is not None:
        return OutputComparison.failure(length, name, problem, _type_name(ref), list(ref.shape))
    per_sample: list[float] = []
    rel_errs = None
    if np.issubdtype(ref.dtype, np.floating):
        if samples > 1:
            per_sample = sample_cosines(ref, out, samples)
        rel_errs = sample_rel_errs(ref, out, samples)
    row = _comparison(
        _tally(ref, out),
        ref.dtype,
        options,
        length=length,
        name=name,
        type_name=_type_name(ref),
        shape=list(ref.shape),
        sample_cosines=per_sample,
        sample_rel_errs=rel_errs,
    )
    if row.passed and np.issubdtype(ref.dtype, np.floating):
        blank = samples_without_finite(ref, out, samples)
        if blank:
            row.passed = False
            row.note = (
                f"{len(blank)} of {samples} samples (first: {blank[0]}) have no element finite in both"
                " models: nothing compared in them (inputs on which the original gives finite numbers"
                " are needed)"
            )
    if task and np.issubdtype(ref.dtype, np.floating):
        from onnx_conv2matmul.verify.labels import count

        row.task = task
        row.labels, row.label_flips = count(ref, out, task)
    return row


def samples_without_finite(ref: np.ndarray, out: np.ndarray, samples: int) -> list[int]:
    """The samples (as :func:`sample_cosines` cuts them) with no element finite in both arrays,
    read in blocks of at most :data:`CHUNK_ELEMENTS`."""
    if not (samples > 1 and ref.ndim >= 1 and ref.shape[0] == samples):
        return []
    blank = []
    for index in range(samples):
        r, o = ref[index].reshape(-1), out[index].reshape(-1)
        if not any(
            np.any(
                np.isfinite(r[start : start + CHUNK_ELEMENTS])
                & np.isfinite(o[start : start + CHUNK_ELEMENTS])
            )
            for start in range(0, r.size, CHUNK_ELEMENTS)
        ):
            blank.append(index)
    return blank


def compare_sequences(
    ref: list[Any], out: list[Any], options: VerifyOptions, *, length: int, name: str
) -> OutputComparison:
    """Compare a sequence output: the same number of tensors, each passing on its own.

    The row reports ``sequence(<type>)`` with the shape ``[number of tensors]``; its
    numbers are taken over every tensor together, and the note names the first
    tensor that fails. An empty tensor among others is no failure (its shape matched);
    a sequence that holds no element at all compared nothing and fails.
    """
    kind = f"sequence({_type_name(ref[0])})" if ref and isinstance(ref[0], np.ndarray) else "sequence"
    if len(ref) != len(out):
        note = f"candidate sequence has {len(out)} elements, reference {len(ref)}"
        return OutputComparison.failure(length, name, note, kind, [len(ref)])
    for index, (r, o) in enumerate(zip(ref, out, strict=True)):
        problem = _tensor_problem(r, o)
        if problem is not None:
            return OutputComparison.failure(length, name, f"element {index}: {problem}", kind, [len(ref)])
    dtype = ref[0].dtype if ref else np.dtype(np.bool_)
    total = _Tally(exact=not np.issubdtype(dtype, np.floating))
    first_failure = ""
    for index, (r, o) in enumerate(zip(ref, out, strict=True)):
        tally = _tally(r, o)
        total.add(tally)
        if tally.elements == 0:
            continue
        part = _comparison(tally, dtype, options, length=length, name=name, type_name=kind, shape=[])
        if not part.passed and not first_failure:
            first_failure = f"element {index}: {part.note}"
    row = _comparison(total, dtype, options, length=length, name=name, type_name=kind, shape=[len(ref)])
    if first_failure or row.passed:
        row.passed = not first_failure
        row.note = first_failure
    return row


def compare_outputs(
    ref: Any, out: Any, options: VerifyOptions, *, length: int, name: str, samples: int = 1, task: str = ""
) -> OutputComparison:
    """Compare one output of both models: a tensor, or a sequence of tensors (a list).

    ``samples`` and ``task``: see :func:`compare_arrays`.
    """
    if isinstance(ref, list) and isinstance(out, list):
        return compare_sequences(ref, out, options, length=length, name=name)
    if isinstance(ref, np.ndarray) and isinstance(out, np.ndarray):
        return compare_arrays(ref, out, options, length=length, name=name, samples=samples, task=task)
    ref_kind, out_kind = _value_kind(ref), _value_kind(out)
    if ref_kind == out_kind:
        note = f"cannot compare outputs of type {ref_kind} (tensors and sequences of tensors only)"
    else:
        note = f"candidate gives a {out_kind}, reference a {ref_kind}"
    return OutputComparison.failure(length, name, note, ref_kind)


# pragma: no mutate start
def _value_kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return "tensor"
    return "sequence" if isinstance(value, list) else type(value).__name__


# pragma: no mutate end
