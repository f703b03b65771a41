"""Prove two models compute the same thing, by running both in onnxruntime.

Inputs are synthesised from each graph input's type and shape (see
:func:`synthesise_inputs`); both sessions run with onnxruntime's graph
optimizations off, so none of its fusions can hide a wrong rewrite. Each symbolic
dim other than the batch takes a series of lengths in turn (see :func:`plan_lengths`):
the given ones, or by default :data:`DEFAULT_LENGTHS`, or :data:`IMAGE_LENGTHS`
(multiples of 32) when an input has a symbolic height and width; a default length the
original model cannot run at is replaced by a spare one, and the report says which
lengths were used.

Each float difference is divided by the magnitude of the quietest slice of the
reference output that holds the element (see :func:`element_scales`): along every
axis longer than 1, a slice's magnitude is ``max(1, max|ref|)`` over the slice. Deep
models with large outputs are judged against their own magnitude, and a channel 1000x
louder than the others does not hide an error confined to a quiet channel or time
step. ``max_abs`` and ``mean_abs`` are taken over these scaled differences;
``rel_err`` and ``cosine`` over the whole output. NaN and Inf must sit at the same
places with the same values in both models (NaN matches NaN, +Inf only +Inf); the
finite rest is compared. Integer, bool and string outputs must match exactly (strings
as text). A sequence output must hold as many tensors as the reference's, each
passing by these rules on its own.

Real inputs can replace the synthesised ones (:func:`load_inputs`, ``VerifyOptions.feeds``):
each feed is one run, checked against the model's input names, types and ranks; a row's
``length`` is then the feed's number, from 1.

Sessions are created from file paths and run one after the other, so external data is
memory-mapped by onnxruntime and only one model is loaded at a time.
"""

# Mutation testing (docs/mutation.md) covers only the output comparison, thresholds() to
# compare_outputs(): everything else in this module sits between these pragmas.
# pragma: no mutate start
from __future__ import annotations

import dataclasses
import enum
import gc
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import Hint, InputError, ModelLoadError
from onnx_conv2matmul.errors import ModelRunError as ModelRunError  # its home before errors.py

DEFAULT_LENGTHS = (64, 80, 97, 128, 191)
# Image inputs: multiples of 32, the stride of the deepest features of most image networks
# (detectors join them, upsampled, to shallower ones); 96 and 160 are odd multiples of 32,
# the counterpart of the odd sequence lengths.
IMAGE_LENGTHS = (64, 96, 128, 160)
# Tried in turn when the original cannot run at a default length (networks of stride 64
# or 128, or sequence models that need even or aligned lengths).
IMAGE_SPARE_LENGTHS = (192, 256, 384, 512)
SPARE_LENGTHS = (96, 160, 192, 256, 512)
DEFAULT_MAX_ABS = 3e-5
DEFAULT_MEAN_ABS = 2e-6

_STATE_NAME = re.compile(r"(state|cache|hidden|memory|^h0?$|^c0?$|^h_|^c_)", re.IGNORECASE)
_LENGTH_NAME = re.compile(r"(^|_)(len|length|lengths|seq_len|n_frames)s?($|_)", re.IGNORECASE)
_ORT_TYPES: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


class Criterion(str, enum.Enum):
    """How float outputs are judged (integer, bool and string outputs always match exactly).

    In every criterion an output fails when it cannot be compared (shape, type, a candidate
    that does not run) or when its NaN/Inf differ.
    """

    SCALED_DIFFERENCE = "scaled_difference"
    """``max_abs`` and ``mean_abs`` of the scaled differences at most the options' limits."""
    MIN_COSINE = "min_cosine"
    """Cosine similarity at least the options' ``min_cosine`` (quantized models)."""
    REPORT_ONLY = "report_only"
    """Measured and reported; any cosine similarity and difference pass."""


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """How inputs are synthesised and outputs judged.

    Attributes:
        lengths: Each symbolic dim other than the batch takes these values in turn. None:
            chosen from the model's inputs, with spares for lengths the original model
            cannot run at (see :func:`plan_lengths`).
        batch: Value of the batch dim (the first symbolic dim of an input).
        seed: Seed of the random inputs.
        max_abs: Largest allowed scaled absolute difference (see :func:`element_scales`).
        mean_abs: Largest allowed mean scaled absolute difference.
        min_cosine: When set, the criterion is cosine similarity >= this (for
            quantized models), instead of the absolute thresholds.
        report_only: Measure float outputs without judging them (see
            :attr:`Criterion.REPORT_ONLY`); excludes ``min_cosine``.
        signal_input: Name of the main signal input (random normal; others may be zero).
        length_input: Name of the length input (gets the length per batch row);
            by default an integer input of rank 1 whose name says length.
        output_indices: Indices of outputs to compare (default: all).
        inputs: Fixed values per input name: a scalar fill.
        dims: Fixed values per symbolic dim name.
        deterministic: One thread, sequential execution, deterministic compute.
        feeds: Real inputs instead of synthesised ones: one run per feed (a mapping of
            input name to array, e.g. from :func:`load_inputs`). Excludes ``lengths``,
            ``inputs`` and ``dims``.
    """

    lengths: tuple[int, ...] | None = None
    batch: int = 1
    seed: int = 0
    max_abs: float = DEFAULT_MAX_ABS
    mean_abs: float = DEFAULT_MEAN_ABS
    min_cosine: float | None = None
    signal_input: str | None = None
    length_input: str | None = None
    output_indices: tuple[int, ...] | None = None
    inputs: Mapping[str, float] = dataclasses.field(default_factory=dict)
    dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
    deterministic: bool = False
    report_only: bool = False
    # Arrays have no truth value: options holding feeds compare as equal whatever the arrays.
    feeds: tuple[Mapping[str, np.ndarray], ...] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.feeds is not None:
            if not self.feeds:
                raise ValueError("verify feeds must hold at least one set of inputs")
            given = [
                name
                for name, value in (
                    ("lengths", self.lengths),
                    ("input values", self.inputs),
                    ("dim values", self.dims),
                )
                if value
            ]
            if given:
                raise ValueError(f"real inputs cannot be combined with {' or '.join(given)}")
        if self.report_only and self.min_cosine is not None:
            raise ValueError("a report-only verification takes no minimum cosine similarity")
        if self.lengths is not None and (not self.lengths or any(n < 1 for n in self.lengths)):
            raise ValueError("verify lengths must be positive integers")
        if self.batch < 1:
            raise ValueError("verify batch must be >= 1")
        if any(v < 1 for v in self.dims.values()):
            raise ValueError("verify dims must be >= 1")

    @property
    def criterion(self) -> Criterion:
        """How float outputs are judged: report only, minimum cosine, or scaled differences."""
        if self.report_only:
            return Criterion.REPORT_ONLY
        if self.min_cosine is not None:
            return Criterion.MIN_COSINE
        return Criterion.SCALED_DIFFERENCE

    def criterion_dict(self) -> dict[str, Any]:
        """The criterion for the report: its ``kind`` and the limits it uses."""
        criterion = self.criterion
        if criterion is Criterion.MIN_COSINE:
            return {"kind": criterion.value, "min_cosine": self.min_cosine}
        if criterion is Criterion.SCALED_DIFFERENCE:
            return {"kind": criterion.value, "max_abs": self.max_abs, "mean_abs": self.mean_abs}
        return {"kind": criterion.value}

    def to_dict(self) -> dict[str, Any]:
        feeds = self.feeds
        data = dataclasses.asdict(dataclasses.replace(self, feeds=None))
        data["inputs"] = dict(self.inputs)
        data["dims"] = dict(self.dims)
        data["feeds"] = None if feeds is None else [feed_source(feed, i) for i, feed in enumerate(feeds)]
        return data


class Feed(dict[str, np.ndarray]):
    """One set of real inputs (input name to array) and the file it was read from."""

    def __init__(self, arrays: Mapping[str, np.ndarray], source: str) -> None:
        super().__init__(arrays)
        self.source = source


def feed_source(feed: Mapping[str, np.ndarray], index: int) -> str:
    """Where a feed came from: its file, or ``feed <n>`` (from 1) for one made in memory."""
    return getattr(feed, "source", None) or f"feed {index + 1}"


def load_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Feed]:
    """Read real inputs: each ``.npz`` file is one feed, its keys the model's input names.

    A directory stands for the ``.npz`` files in it, in name order. The arrays are checked
    against a model later (``VerifyOptions.feeds``); here only the files.

    Raises:
        InputError: a path that does not exist, a directory without ``.npz`` files, or a
            file that is not a readable ``.npz`` of plain arrays.
    """
    files: list[str] = []
    for path in (os.fspath(p) for p in paths):
        if os.path.isdir(path):
            found = sorted(
                os.path.join(path, name)
                for name in os.listdir(path)
                if name.endswith(".npz") and os.path.isfile(os.path.join(path, name))
            )
            if not found:
                raise InputError(f"no .npz files in the inputs directory {path}")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise InputError(f"inputs file not found: {path}")
    if not files:
        raise InputError("no inputs files given")
    return [_read_npz(path) for path in files]


def _read_npz(path: str) -> Feed:
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise InputError(f"not an .npz file (a single .npy array): {path}")
        with data:
            arrays = {name: np.asarray(data[name]) for name in data.files}
    except InputError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        # numpy takes any file that is neither zip nor .npy for a pickle, and says so.
        pickle_guess = isinstance(err, ValueError) and not zipfile.is_zipfile(path)
        why = "not an .npz file (numpy.savez writes a zip archive)" if pickle_guess else _first_line(err)
        raise InputError(f"cannot read inputs file {path}: {why}") from err
    if not arrays:
        raise InputError(f"inputs file holds no arrays: {path}")
    return Feed(arrays, path)


def check_feeds_for_graph(graph_inputs: Sequence[Any], feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
    """:func:`check_feeds` against an onnx-ir graph's inputs (initializers aside), before any run.

    Raises:
        InputError: as :func:`check_feeds`.
    """
    specs = []
    for value in graph_inputs:
        if value.is_initializer() or value.dtype is None:
            continue
        shape = value.shape
        dims: list[int | str | None] = (
            [d if isinstance(d, int) else (d.value if d.value else None) for d in shape] if shape else []
        )
        specs.append(_InputSpec(value.name, value.dtype.numpy(), dims))
    check_feeds(specs, feeds)


def check_feeds(specs: Sequence[_InputSpec], feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Refuse feeds that do not fit the model: names, element types, ranks and static dims.

    Raises:
        InputError: one line naming the feed and the first problem found.
    """
    by_name = {spec.name: spec for spec in specs}
    for index, feed in enumerate(feeds):
        where = f"inputs {feed_source(feed, index)}"
        missing = [name for name in by_name if name not in feed]
        unknown = [name for name in feed if name not in by_name]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing {_named('input', missing)}")
            if unknown:
                parts.append(f"unknown {_named('input', unknown)}")
            known = ", ".join(by_name) or "none"
            raise InputError(f"{where}: {'; '.join(parts)} (the model's inputs: {known})")
        for name, spec in by_name.items():
            array = feed[name]
            want = np.dtype(spec.dtype)
            if array.dtype != want:
                raise InputError(f"{where}: input {name!r} is {array.dtype}, the model takes {want}")
            if array.ndim != len(spec.shape):
                raise InputError(
                    f"{where}: input {name!r} has rank {array.ndim} {list(array.shape)},"
                    f" the model takes rank {len(spec.shape)} {spec.shape}"
                )
            for axis, (got, dim) in enumerate(zip(array.shape, spec.shape, strict=True)):
                if isinstance(dim, int) and dim > 0 and got != dim:
                    raise InputError(
                        f"{where}: input {name!r} has {got} on axis {axis}, the model takes {dim}"
                        f" {spec.shape}"
                    )


@dataclasses.dataclass
class OutputComparison:
    """One output of both models at one length.

    ``max_abs`` and ``mean_abs`` are over the scaled differences for floats (see
    :func:`element_scales`), over ``|ref - out|`` for integers and bools, and over 0 or 1
    per element for strings. ``mismatches`` counts elements that must match exactly and
    do not (NaN/Inf for floats; -1 when no comparison could be made). A sequence output
    has the dtype ``sequence(<type>)`` and the shape ``[number of tensors]``.
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def failure(
        cls, length: int, name: str, note: str, dtype: str = "", shape: list[int] | None = None
    ) -> OutputComparison:
        """A comparison that could not be made (shape, type or run failure)."""
        inf = float("inf")
        return cls(length, name, dtype, shape or [], inf, inf, inf, None, 0.0, -1, False, note)


@dataclasses.dataclass
class VerifyReport:
    """Two models compared: the options, how inputs were made, one row per output and length.

    ``passed`` when there is at least one row and every row passed; ``to_dict()`` is the
    ``verification`` section of a report (the verify command's report wraps it, see
    :class:`onnx_conv2matmul.verify.report.VerifyCommandReport`).
    """

    original: str
    candidate: str
    options: VerifyOptions
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    results: list[OutputComparison] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    lengths_rule: str = ""
    lengths_not_run: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def input_files(self) -> list[dict[str, Any]]:
        """The real inputs used, one per run: file (or ``feed <n>``) and each input's shape."""
        return [
            {"file": feed_source(feed, i), "shapes": {name: list(a.shape) for name, a in feed.items()}}
            for i, feed in enumerate(self.options.feeds or ())
        ]

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[OutputComparison]:
        return [r for r in self.results if not r.passed]

    @property
    def return_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "original": self.original,
            "candidate": self.candidate,
            "criterion": self.options.criterion_dict(),
            "scaling": (
                "each difference divided by the smallest max(1, max|reference|) among the"
                " slices of the output that hold it (one slice per index of every axis longer than 1)"
            ),
            "options": self.options.to_dict(),
            "inputs": self.inputs,
            "input_files": self.input_files,
            "lengths": {
                "used": self.lengths,
                "rule": self.lengths_rule,
                "not_run": [{"length": n, "error": error} for n, error in self.lengths_not_run],
            },
            "results": [r.to_dict() for r in self.results],
            "failures": [
                {
                    "output": r.output,
                    "length": r.length,
                    "max_abs": r.max_abs,
                    "mean_abs": r.mean_abs,
                    "rel_err": r.rel_err,
                    "note": r.note,
                }
                for r in self.failures
            ],
        }


@dataclasses.dataclass
class _InputSpec:
    name: str
    dtype: Any
    shape: list[int | str | None]


def _session(path: str, options: VerifyOptions) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    if options.deterministic:
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.use_deterministic_compute = True
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _specs(session: Any) -> list[_InputSpec]:
    specs = []
    for arg in session.get_inputs():
        dtype = _ORT_TYPES.get(arg.type)
        if dtype is None:
            raise InputError(f"cannot synthesise input {arg.name!r} of type {arg.type}")
        specs.append(_InputSpec(arg.name, dtype, list(arg.shape)))
    return specs


def _dim_plan(spec: _InputSpec, options: VerifyOptions, batch_names: set[str]) -> list[int | None]:
    """Each dim's value; None for the dims that take the length."""
    dims: list[int | None] = []
    seen_batch = False
    for dim in spec.shape:
        if isinstance(dim, int) and dim > 0:
            dims.append(dim)
            continue
        name = dim if isinstance(dim, str) else None
        if len(spec.shape) == 1 and not (name is not None and name in options.dims):
            # A rank-1 input is per batch row (lengths) only when its dim is a batch dim of
            # another input, or, unnamed, when it holds integers; otherwise it is a signal.
            per_row = name in batch_names if name is not None else np.issubdtype(spec.dtype, np.integer)
            dims.append(options.batch if per_row else None)
        elif name is not None and name in options.dims:
            dims.append(options.dims[name])
        elif (name is not None and name in batch_names) or not seen_batch:
            dims.append(options.batch)
        else:
            dims.append(None)
        seen_batch = True
    return dims


def _resolve_dims(spec: _InputSpec, length: int, options: VerifyOptions, batch_names: set[str]) -> list[int]:
    return [length if dim is None else dim for dim in _dim_plan(spec, options, batch_names)]


def _batch_names(specs: Sequence[_InputSpec]) -> set[str]:
    """Names of the first symbolic dim of every input of rank 2 or more."""
    names = set()
    for spec in specs:
        if len(spec.shape) < 2:
            continue
        for dim in spec.shape:
            if not (isinstance(dim, int) and dim > 0):
                if isinstance(dim, str):
                    names.add(dim)
                break
    return names


def _is_length_input(spec: _InputSpec, options: VerifyOptions) -> bool:
    if options.length_input is not None:
        return spec.name == options.length_input
    return (
        np.issubdtype(spec.dtype, np.integer)
        and len(spec.shape) == 1
        and bool(_LENGTH_NAME.search(spec.name))
    )


def synthesise_inputs(
    specs: Sequence[_InputSpec], length: int, options: VerifyOptions
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Inputs for one run at ``length``, and how each was made.

    With real inputs (``options.feeds``), ``length`` is the feed's number, from 1.
    """
    if options.feeds is not None:
        feed = options.feeds[length - 1]
        return {spec.name: feed[spec.name] for spec in specs}, {
            spec.name: "from the input files" for spec in specs
        }
    rng = np.random.default_rng([options.seed, length])
    batch_names = _batch_names(specs)
    feeds: dict[str, np.ndarray] = {}
    how: dict[str, str] = {}
    for spec in specs:
        dims = _resolve_dims(spec, length, options, batch_names)
        if spec.name in options.inputs:
            feeds[spec.name] = np.full(dims, options.inputs[spec.name], dtype=spec.dtype)
            how[spec.name] = f"fixed {options.inputs[spec.name]}"
        elif _is_length_input(spec, options):
            feeds[spec.name] = np.full(dims, length, dtype=spec.dtype)
            how[spec.name] = "length per batch row"
        elif np.issubdtype(spec.dtype, np.floating):
            if spec.name != options.signal_input and _STATE_NAME.search(spec.name):
                feeds[spec.name] = np.zeros(dims, dtype=spec.dtype)
                how[spec.name] = "zeros (state)"
            else:
                feeds[spec.name] = rng.standard_normal(dims).astype(spec.dtype)
                how[spec.name] = "standard normal"
        elif spec.dtype is np.bool_:
            feeds[spec.name] = rng.integers(0, 2, size=dims).astype(np.bool_)
            how[spec.name] = "random bool"
        else:
            feeds[spec.name] = rng.integers(0, 4, size=dims).astype(spec.dtype)
            how[spec.name] = "random integers in [0, 4)"
    return feeds, how


@dataclasses.dataclass(frozen=True)
class LengthPlan:
    """The lengths a verification runs at.

    Attributes:
        wanted: The lengths to run at.
        spares: Tried in order, one for each wanted length the original model cannot run
            at; empty when the options give the lengths, which are then used as given.
        rule: How the lengths were chosen, for the report.
    """

    wanted: tuple[int, ...]
    spares: tuple[int, ...]
    rule: str


def plan_lengths(specs: Sequence[_InputSpec], options: VerifyOptions) -> LengthPlan:
    """The options' lengths, or defaults that suit the model's inputs.

    An input of rank 4 or more with two or more dims that take the length (an image:
    height and width, NCHW or NHWC) gets :data:`IMAGE_LENGTHS`, multiples of 32, so that
    a network of stride 32 whose upsampled features are joined to shallower ones can run;
    any other model (sequences: [B, C, T] and the like) gets :data:`DEFAULT_LENGTHS`,
    odd ones included. Default lengths come with spares; given ones are used as given.
    """
    if options.feeds is not None:
        rule = "real inputs: one run per file, each row's length is the file's number from 1"
        return LengthPlan(tuple(range(1, len(options.feeds) + 1)), (), rule)
    if options.lengths is not None:
        return LengthPlan(options.lengths, (), "given")
    image = _image_input(specs, options)
    if image is not None:
        rule = f"default for image inputs: multiples of 32, as {image!r} has a symbolic height and width"
        return LengthPlan(IMAGE_LENGTHS, IMAGE_SPARE_LENGTHS, rule)
    return LengthPlan(DEFAULT_LENGTHS, SPARE_LENGTHS, "default")


def _image_input(specs: Sequence[_InputSpec], options: VerifyOptions) -> str | None:
    """The first input of rank >= 4 with two or more dims that take the length, if any."""
    batch_names = _batch_names(specs)
    for spec in specs:
        if len(spec.shape) >= 4 and _dim_plan(spec, options, batch_names).count(None) >= 2:
            return spec.name
    return None


def _open(
    path: str, label: str, options: VerifyOptions, specs: list[_InputSpec] | None = None
) -> tuple[Any, list[_InputSpec], list[str]]:
    """A session, the inputs (``specs`` when given: the other model's, checked to match) and
    the output names; the options' names and output indices are checked against them."""
    try:
        session = _session(path, options)
    except Exception as err:
        raise ModelLoadError(f"onnxruntime cannot load the {label} model: {_first_line(err)}") from err
    own_specs = _specs(session)
    if specs is not None and not _same_signature(specs, own_specs):
        raise InputError(
            f"the two models have different inputs: {_signature(specs)} vs {_signature(own_specs)}"
        )
    use = specs or own_specs
    check_names(use, options)
    if options.feeds is not None:
        check_feeds(use, options.feeds)
    names = [o.name for o in session.get_outputs()]
    for index in options.output_indices or ():
        if not 0 <= index < len(names):
            raise InputError(f"output index {index} out of range: the model has {len(names)} outputs")
    return session, use, names


def _run_at(session: Any, specs: list[_InputSpec], length: int, options: VerifyOptions, label: str) -> Any:
    """The outputs at one length; ModelRunError when onnxruntime cannot run the model."""
    import onnxruntime as ort

    feeds, _ = synthesise_inputs(specs, length, options)
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a failure is raised with its message; not logged as well
    try:
        return session.run(None, feeds, quiet)
    except Exception as err:
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in feeds.items())
        where = (
            f"on inputs {feed_source(options.feeds[length - 1], length - 1)}"
            if options.feeds is not None
            else f"at length {length}"
        )
        raise ModelRunError(
            f"onnxruntime cannot run the {label} model {where} ({shapes}): {_first_line(err)}",
            hint=Hint.INPUT_FILES if options.feeds is not None else None,
        ) from err


def _run_original(
    session: Any, specs: list[_InputSpec], options: VerifyOptions, plan: LengthPlan
) -> tuple[dict[int, list[Any]], list[tuple[int, str]]]:
    """The original's outputs by length, and the lengths it could not run at (with why).

    Each wanted length the model cannot run at is replaced by the next spare it runs at.

    Raises:
        ModelRunError: a given length cannot be run, or no length at all.
    """
    outputs: dict[int, list[Any]] = {}
    not_run: list[tuple[int, str]] = []
    first_error: ModelRunError | None = None
    for length in _candidates(plan):
        if len(outputs) == len(plan.wanted):
            break
        try:
            outputs[length] = _run_at(session, specs, length, options, "original")
        except ModelRunError as err:
            if not plan.spares:
                if options.feeds is not None:
                    raise
                raise ModelRunError(f"{err}; fix input values, dim values or lengths") from err
            first_error = first_error or err
            not_run.append((length, _first_line(err.__cause__ or err)))
    if not outputs:
        tried = ", ".join(str(n) for n, _ in not_run)
        raise ModelRunError(
            f"{first_error}; it fails at every length tried ({tried}):"
            " fix input values, dim values or lengths"
        ) from first_error
    return outputs, not_run


def _candidates(plan: LengthPlan) -> list[int]:
    """The wanted lengths, then the spares that are not among them."""
    return list(plan.wanted) + [n for n in plan.spares if n not in plan.wanted]


def _symbolic_dims(specs: Sequence[_InputSpec]) -> list[str]:
    """The named symbolic dims of the inputs, in order of first appearance."""
    names: dict[str, None] = {}
    for spec in specs:
        names.update((dim, None) for dim in spec.shape if isinstance(dim, str))
    return list(names)


def check_names(specs: Sequence[_InputSpec], options: VerifyOptions) -> None:
    """Refuse option names that match no input or symbolic dim of the model.

    A misspelt name would otherwise be ignored and the input synthesised as usual,
    checking something other than what was asked for (e.g. the other branch of an If).

    Raises:
        InputError: one line naming every unknown name and the names that exist.
    """
    inputs = [spec.name for spec in specs]
    dims = _symbolic_dims(specs)
    known_inputs = f"(the model's inputs: {', '.join(inputs) or 'none'})"
    known_dims = f"(the inputs' symbolic dims: {', '.join(dims) or 'none'})"
    problems = []
    unknown = [name for name in options.inputs if name not in inputs]
    if unknown:
        problems.append(f"unknown {_named('input', unknown)} {known_inputs}")
    unknown = [name for name in options.dims if name not in dims]
    if unknown:
        problems.append(f"unknown {_named('dim', unknown)} {known_dims}")
    for role, name in (("signal", options.signal_input), ("length", options.length_input)):
        if name is not None and name not in inputs:
            problems.append(f"unknown {role} input {name!r} {known_inputs}")
    if problems:
        raise InputError("; ".join(problems))


def _named(noun: str, names: Sequence[str]) -> str:
    """``input 'a'`` or ``inputs 'a', 'b'``."""
    return f"{noun}{'s' if len(names) > 1 else ''} {', '.join(repr(name) for name in names)}"


def _signature(specs: Sequence[_InputSpec]) -> str:
    return ", ".join(f"{s.name}: {np.dtype(s.dtype).name}{s.shape}" for s in specs)


def _same_signature(a: Sequence[_InputSpec], b: Sequence[_InputSpec]) -> bool:
    """Same names and types; same rank and the same value wherever both dims are static."""
    by_name = {s.name: s for s in b}
    if len(a) != len(b) or set(by_name) != {s.name for s in a}:
        return False
    for spec in a:
        other = by_name[spec.name]
        if np.dtype(spec.dtype) != np.dtype(other.dtype) or len(spec.shape) != len(other.shape):
            return False
        for x, y in zip(spec.shape, other.shape, strict=True):
            if isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0 and x != y:
                return False
    return True


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else err.__class__.__name__


# pragma: no mutate end
def thresholds(dtype: np.dtype[Any], options: VerifyOptions) -> tuple[float, float]:
    """(max_abs, mean_abs) limits for an output type: the options, raised to what the type can hold.

    Conv and MatMul accumulate in different orders, so a correct fp16 rewrite differs by an
    fp16 rounding step. The limits never go below 4 and 0.5 machine epsilons of the type
    (fp16: 3.9e-3 and 4.9e-4; fp32 and fp64 keep the options' values).
    """
    eps = float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0
    return max(options.max_abs, 4 * eps), max(options.mean_abs, 0.5 * eps)


def element_scales(magnitude: np.ndarray) -> np.ndarray:
    """What each element's difference is divided by: the magnitude of its quietest slice.

    ``magnitude`` is ``|ref|`` with non-finite values set to 0. Along each axis of length
    > 1, slice ``i`` (every element whose index on that axis is ``i``) has the scale
    ``max(1, max magnitude in the slice)``; an element's scale is the smallest scale among
    the slices that contain it (``max(1, max magnitude)`` when no axis is longer than 1).

    So a difference is judged against the magnitude of the channel, time step or row it
    lives in, whichever is quietest: a loud channel does not hide an error confined to a
    quiet one, while a difference is never judged against less than the largest value of
    a slice it belongs to, nor against less than 1.

    Limit: an exact rewrite differs by rounding, about one machine epsilon of the terms
    summed into an element. Where those terms are far larger than every value of the
    element's quietest slice (heavy cancellation, e.g. a channel that a ReLU keeps near
    zero although its inputs reach thousands), fp32 rounding can exceed the default
    ``max_abs``; that happens once the terms are about 300x the slice's magnitude.
    """
    scale = np.full(magnitude.shape, max(1.0, float(magnitude.max(initial=0.0))))
    for axis, size in enumerate(magnitude.shape):
        if size < 2:
            continue
        others = tuple(a for a in range(magnitude.ndim) if a != axis)
        per_slice = np.maximum(1.0, magnitude.max(axis=others, keepdims=True, initial=0.0))
        np.minimum(scale, per_slice, out=scale)
    return scale


def _nonfinite_mismatches(ref: np.ndarray, out: np.ndarray) -> int:
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
        self.max_diff = max(self.max_diff, other.max_diff)
        self.sum_diff += other.sum_diff
        self.ref_sq += other.ref_sq
        self.out_sq += other.out_sq
        self.diff_sq += other.diff_sq
        self.dot += other.dot
        self.max_ref = max(self.max_ref, other.max_ref)
        self.mismatches += other.mismatches


def _float_tally(ref: np.ndarray, out: np.ndarray) -> _Tally:
    """Scaled differences over the places finite in both; NaN/Inf that differ are mismatches."""
    r = ref.astype(np.float64)
    o = out.astype(np.float64)
    finite_ref = np.isfinite(r)
    both = finite_ref & np.isfinite(o)
    magnitude = np.where(finite_ref, np.abs(r), 0.0)
    rf, of = r[both], o[both]
    diff = rf - of
    scaled = np.abs(diff) / element_scales(magnitude)[both]
    return _Tally(
        exact=False,
        count=int(scaled.size),
        max_diff=float(scaled.max(initial=0.0)),
        sum_diff=float(scaled.sum()),
        ref_sq=float(np.dot(rf, rf)),
        out_sq=float(np.dot(of, of)),
        diff_sq=float(np.dot(diff, diff)),
        dot=float(np.dot(rf, of)),
        max_ref=float(magnitude.max(initial=0.0)),
        mismatches=_nonfinite_mismatches(r, o),
    )


def _exact_tally(ref: np.ndarray, out: np.ndarray) -> _Tally:
    """Element-wise equality; strings are compared as text, never as numbers."""
    differ = np.asarray(ref != out, dtype=bool)
    if ref.dtype == object:
        diff = differ.astype(np.float64)
    else:
        diff = np.abs(ref.astype(np.float64) - out.astype(np.float64))
    return _Tally(
        exact=True,
        count=int(diff.size),
        max_diff=float(diff.max(initial=0.0)),
        sum_diff=float(diff.sum()),
        mismatches=int(np.count_nonzero(differ)),
    )


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


def _tally(ref: np.ndarray, out: np.ndarray) -> _Tally:
    if np.issubdtype(ref.dtype, np.floating):
        return _float_tally(ref, out)
    return _exact_tally(ref, out)


def _comparison(
    tally: _Tally,
    dtype: np.dtype[Any],
    options: VerifyOptions,
    *,
    length: int,
    name: str,
    type_name: str,
    shape: list[int],
) -> OutputComparison:
    """The numbers and the verdict for one tensor (or a sequence's tensors together).

    Floats: ``rel_err`` is ``|ref - out| / |ref|`` and ``cosine`` the cosine similarity,
    both over the places finite in both. Exact types: ``rel_err`` is the share of
    elements that differ and ``cosine`` is None.
    """
    mean_abs = tally.sum_diff / tally.count if tally.count else 0.0
    if tally.exact:
        rel_err = tally.mismatches / tally.count if tally.count else 0.0
        passed = tally.mismatches == 0
        note = "" if passed else f"{tally.mismatches} elements differ (exact match required)"
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
            note,
        )
    norm_ref, norm_out, norm_diff = (float(np.sqrt(v)) for v in (tally.ref_sq, tally.out_sq, tally.diff_sq))
    rel_err = norm_diff / norm_ref if norm_ref > 0 else (0.0 if norm_diff == 0 else np.inf)
    if norm_ref > 0 and norm_out > 0:
        cosine = tally.dot / (norm_ref * norm_out)
    else:
        cosine = 1.0 if norm_ref == norm_out else 0.0
    note = ""
    if tally.mismatches:
        passed = False
        note = f"{tally.mismatches} elements are NaN/Inf in one model and not the same in the other"
    elif options.criterion is Criterion.REPORT_ONLY:
        passed = True
    elif options.min_cosine is not None:
        passed = cosine >= options.min_cosine
    else:
        max_limit, mean_limit = thresholds(dtype, options)
        passed = tally.max_diff <= max_limit and mean_abs <= mean_limit
        if not passed:
            note = f"above the limits for {dtype}: max_abs {max_limit:.3g}, mean_abs {mean_limit:.3g}"
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
    )


def compare_arrays(
    ref: np.ndarray, out: np.ndarray, options: VerifyOptions, *, length: int, name: str
) -> OutputComparison:
    """Compare one tensor output: floats by the options' criterion, other types exactly.

    A shape or type difference fails.
    """
    problem = _tensor_problem(ref, out)
    if problem is not None:
        return OutputComparison.failure(length, name, problem, _type_name(ref), list(ref.shape))
    return _comparison(
        _tally(ref, out),
        ref.dtype,
        options,
        length=length,
        name=name,
        type_name=_type_name(ref),
        shape=list(ref.shape),
    )


def compare_sequences(
    ref: list[Any], out: list[Any], options: VerifyOptions, *, length: int, name: str
) -> OutputComparison:
    """Compare a sequence output: the same number of tensors, each passing on its own.

    The row reports ``sequence(<type>)`` with the shape ``[number of tensors]``; its
    numbers are taken over every tensor together, and the note names the first
    tensor that fails.
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
        part = _comparison(tally, dtype, options, length=length, name=name, type_name=kind, shape=[])
        if not part.passed and not first_failure:
            first_failure = f"element {index}: {part.note}"
    row = _comparison(total, dtype, options, length=length, name=name, type_name=kind, shape=[len(ref)])
    row.passed = not first_failure
    row.note = first_failure
    return row


def compare_outputs(
    ref: Any, out: Any, options: VerifyOptions, *, length: int, name: str
) -> OutputComparison:
    """Compare one output of both models: a tensor, or a sequence of tensors (a list)."""
    if isinstance(ref, list) and isinstance(out, list):
        return compare_sequences(ref, out, options, length=length, name=name)
    if isinstance(ref, np.ndarray) and isinstance(out, np.ndarray):
        return compare_arrays(ref, out, options, length=length, name=name)
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


def verify_models(
    original: str, candidate: str, options: VerifyOptions | None = None, *, candidate_given: bool = False
) -> VerifyReport:
    """Run both models on the same synthesised inputs and compare their outputs.

    The candidate runs at the lengths the original ran at (see :func:`plan_lengths`);
    a candidate that onnxruntime cannot load or run gives a failed report, except that with
    ``candidate_given`` (a file the user named, not one this package wrote) a candidate it
    cannot load at all is an error, as an original it cannot load is.

    Raises:
        ModelRunError: the original cannot be loaded, or run on the synthesised inputs
            (the inputs need fixing); with ``candidate_given``, the candidate cannot be
            loaded (:class:`ModelLoadError`).
        InputError: an option names no input or dim of the model, an output index is
            out of range, or the models' inputs or outputs differ.
    """
    options = options or VerifyOptions()
    specs, names, plan, ref_outputs, not_run = _reference_outputs(original, options)
    given = options.lengths is not None or options.feeds is not None
    lengths = list(ref_outputs) if given else sorted(ref_outputs)
    report = VerifyReport(original, candidate, options, _how(specs, lengths[0], options))
    report.lengths, report.lengths_rule, report.lengths_not_run = lengths, plan.rule, not_run
    try:
        cand_outputs = _candidate_outputs(candidate, specs, names, lengths, options)
    except ModelRunError as err:
        if candidate_given and isinstance(err, ModelLoadError):
            raise
        report.results.append(OutputComparison.failure(0, "*", str(err)))
        return report
    indices = list(options.output_indices) if options.output_indices else list(range(len(names)))
    for length in lengths:
        for index in indices:
            report.results.append(
                compare_outputs(
                    ref_outputs[length][index],
                    cand_outputs[length][index],
                    options,
                    length=length,
                    name=names[index],
                )
            )
    return report


def _reference_outputs(
    path: str, options: VerifyOptions
) -> tuple[list[_InputSpec], list[str], LengthPlan, dict[int, list[Any]], list[tuple[int, str]]]:
    """The original's inputs, output names, length plan, outputs by length and the lengths
    it could not run at; its session is closed before returning."""
    session, specs, names = _open(path, "original", options)
    plan = plan_lengths(specs, options)
    outputs, not_run = _run_original(session, specs, options, plan)
    del session
    gc.collect()
    return specs, names, plan, outputs, not_run


def _candidate_outputs(
    path: str, specs: list[_InputSpec], names: list[str], lengths: Sequence[int], options: VerifyOptions
) -> dict[int, list[Any]]:
    """The candidate's outputs at each length; its session is closed before returning.

    Raises:
        ModelRunError: onnxruntime cannot load or run the candidate.
        InputError: its inputs or outputs differ from the original's.
    """
    session, _, cand_names = _open(path, "candidate", options, specs)
    if cand_names != names:
        raise InputError(f"the two models have different outputs: {names} vs {cand_names}")
    outputs = {length: _run_at(session, specs, length, options, "candidate") for length in lengths}
    del session
    gc.collect()
    return outputs


def _how(specs: list[_InputSpec], length: int, options: VerifyOptions) -> dict[str, str]:
    """How each input is synthesised (the same at every length)."""
    return synthesise_inputs(specs, length, options)[1]


# pragma: no mutate end
