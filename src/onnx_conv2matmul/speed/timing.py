"""Latency of several models side by side on this CPU, timed so that they can be compared.

How a measurement is made (:func:`time_models`):

- Batch 1, at each of a few lengths: the inputs are made as the accuracy check makes them
  (:func:`onnx_conv2matmul.verify.feeds.synthesise_inputs`), every symbolic dim other than the batch
  taking the length. Each model gets the inputs of its own signature, with the same seed, so
  models with the same inputs run on the same values.
- Every session is made with ``session.intra_op.allow_spinning = 0``: an idle session's
  intra-op threads otherwise spin and take the CPU from the one being timed (a model timed
  against a byte-identical copy of itself measured +14% to +26%; without spinning the copies
  agree within about 2%). Graph optimizations are onnxruntime's default, as a user runs the model.
- Intra-op threads: onnxruntime's own default unless told (``threads=0``: one per physical
  core), so the figures are those of a session a user makes without options.
- Each model runs ``warmup`` times at each length first; then come ``rounds`` rounds, each one
  run of every model at every length, the models in an order that changes from round to round
  (every permutation in turn), so that no model always runs first or right after the same other
  one and a slow drift of the machine hits all of them alike.
- Per model and length: the median, the quartiles and the extremes of the runs; against the
  baseline model, the ratio of the medians and a 95% bootstrap interval of it that resamples
  whole rounds.

Memory: all sessions stay open together when their estimated size (twice the model's files:
onnxruntime keeps the weights and may pack a second copy for its kernels) fits in the budget (by
default a little more than the largest session needs, see :func:`default_budget`); otherwise
(:data:`Mode.ONE_AT_A_TIME`) each round opens the models one after the other, warms each one up
and times it, then closes it before the next: slower to measure, as each round pays the session
creations, but never more than one model in memory.

The clock and the session factory are parameters, so tests drive the measurement with a fake
timer and fake sessions: no test depends on how fast anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import itertools
import os
import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from onnx_conv2matmul.errors import InputError, ModelLoadError, ModelRunError
from onnx_conv2matmul.verify.feeds import (
    InputSpec,
    _first_line,
    _signature,
    check_names,
    dim_roles,
    synthesise_inputs,
)
from onnx_conv2matmul.verify.options import VerifyOptions
from onnx_conv2matmul.verify.plan import _image_input
from onnx_conv2matmul.verify.run import input_specs

SPINNING_KEY = "session.intra_op.allow_spinning"
DEFAULT_LENGTHS = (200, 1000)
"""Lengths for a model with one sequence dim: e.g. 2 s and 10 s of audio at 100 frames a second."""
IMAGE_LENGTHS = (224, 448)
"""Lengths for a model whose input has a symbolic height and width."""
SEVERAL_DIMS_LENGTHS = (16, 64)
"""Lengths for a model whose inputs have several distinct length dims (a joint's T and U): every
such dim takes the length, so an output can grow with its square."""
DEFAULT_ROUNDS = 10
DEFAULT_WARMUP = 2
MEMORY_SHARE = 0.7
"""The share of the memory available that the sessions kept open together may take."""
SESSION_BYTES_PER_FILE_BYTE = 2
"""Estimated session memory per byte of model files (weights, plus a packed copy)."""
BOOTSTRAP_DRAWS = 2000


class Mode(str, enum.Enum):
    """How the sessions are held while timing."""

    TOGETHER = "together"
    """All sessions open at once; every run interleaved with the other models' runs."""
    ONE_AT_A_TIME = "one_at_a_time"
    """One session open at a time: each round opens, warms up, times and closes each model."""


class Session(Protocol):
    """What timing needs of a session: an onnxruntime ``InferenceSession`` has it."""

    def get_inputs(self) -> Sequence[Any]: ...

    def run(self, output_names: Any, input_feed: Mapping[str, Any]) -> Any: ...


SessionFactory = Callable[[str, int], Session]
"""Opens the model at a path with a number of intra-op threads (0: onnxruntime's default)."""
Clock = Callable[[], float]
"""Seconds, monotonic."""


def timed_session(path: str, threads: int) -> Session:
    """A CPU session for timing next to others: ``threads`` intra-op threads (0: onnxruntime's
    default) that do not spin while idle, graph optimizations as onnxruntime's default."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 4  # fatal only: the error is in the exception
    options.add_session_config_entry(SPINNING_KEY, "0")
    session: Session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return session


def _default_clock() -> float:
    import time

    return time.perf_counter()


@dataclasses.dataclass(frozen=True)
class TimingOptions:
    """How models are timed.

    Attributes:
        lengths: The values every symbolic dim other than the batch takes in turn; None: chosen
            from the baseline model's inputs (:func:`default_lengths`).
        rounds: Timed runs of each model at each length (at least 3).
        warmup: Untimed runs of each model at each length first.
        threads: Intra-op threads of every session; 0 is onnxruntime's default (one per
            physical core).
        synthesis: How inputs are made (fixed input values, dims, the length input, seed), as
            for the accuracy check; its lengths and batch are ignored: batch 1, ``lengths``.
        memory_budget_bytes: Memory the sessions open together may take; None:
            :func:`default_budget` (a little more than the largest session, so the timing never
            holds the original and its candidates all at once when they are large).
        feeds: Inputs to time on instead of synthesised ones, each under the number the report
            gives it (its "length"); ``lengths`` and ``synthesis`` are then not used. Every
            model gets the arrays of its own inputs' names (see
            :mod:`onnx_conv2matmul.speed.inputs`, which takes them from ``--inputs`` or from the
            runs the accuracy check made).
        feeds_rule: Where ``feeds`` came from, for the report.
    """

    lengths: tuple[int, ...] | None = None
    rounds: int = DEFAULT_ROUNDS
    warmup: int = DEFAULT_WARMUP
    threads: int = 0
    synthesis: VerifyOptions = dataclasses.field(default_factory=VerifyOptions)
    memory_budget_bytes: int | None = None
    feeds: tuple[tuple[int, Mapping[str, np.ndarray]], ...] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    feeds_rule: str = ""

    def __post_init__(self) -> None:
        if self.lengths is not None and (not self.lengths or any(n < 1 for n in self.lengths)):
            raise ValueError("bench lengths must be positive integers")
        if self.rounds < 3:
            raise ValueError(f"bench rounds must be at least 3, got {self.rounds}")
        if self.warmup < 0:
            raise ValueError(f"bench warm-up runs must be >= 0, got {self.warmup}")
        if self.threads < 0:
            raise ValueError(f"bench threads must be >= 0, got {self.threads}")
        if self.synthesis.feeds is not None:
            raise ValueError("timing synthesises its inputs: real inputs are not taken")
        if self.feeds is not None and not self.feeds:
            raise ValueError("no input to time on")

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": None if self.lengths is None else list(self.lengths),
            "rounds": self.rounds,
            "warmup": self.warmup,
            "threads": self.threads,
            "batch": 1 if self.feeds is None else None,
            "inputs": "synthesised" if self.feeds is None else self.feeds_rule or "given",
        }


@dataclasses.dataclass(frozen=True)
class Latency:
    """One model at one length: milliseconds of its timed runs and what they say.

    ``ratio`` is this model's median over the baseline's (lower is faster), with a 95% bootstrap
    interval ``[ratio_low, ratio_high]``; None for the baseline itself.
    """

    length: int
    samples_ms: tuple[float, ...]
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_ms))

    @property
    def q1_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 25))

    @property
    def q3_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 75))

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def measurably_slower(self) -> bool:
        """Slower than the baseline beyond the noise: the ratio's whole 95% interval above 1 (its
        median alone when there is no interval); never the baseline itself."""
        if self.ratio is None:
            return False
        low = self.ratio_low if self.ratio_low is not None else self.ratio
        return low > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "median_ms": self.median_ms,
            "q1_ms": self.q1_ms,
            "q3_ms": self.q3_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "ratio": self.ratio,
            "ratio_interval": None if self.ratio is None else [self.ratio_low, self.ratio_high],
            "samples_ms": list(self.samples_ms),
        }


@dataclasses.dataclass(frozen=True)
class ModelTiming:
    """One model's latencies, one per length, in the order of the lengths."""

    path: str
    label: str
    file_bytes: int
    latencies: tuple[Latency, ...]
    inputs: str = ""
    """The model's inputs: names, element types and shapes."""

    def at(self, length: int) -> Latency:
        for latency in self.latencies:
            if latency.length == length:
                return latency
        raise KeyError(length)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "label": self.label,
            "file_bytes": self.file_bytes,
            "inputs": self.inputs,
            "latencies": [latency.to_dict() for latency in self.latencies],
        }


@dataclasses.dataclass(frozen=True)
class TimingReport:
    """Several models timed side by side; ``baseline`` indexes ``models``."""

    models: tuple[ModelTiming, ...]
    baseline: int
    lengths: tuple[int, ...]
    lengths_rule: str
    options: TimingOptions
    mode: Mode
    cpu: str

    def header(self) -> dict[str, Any]:
        """How the models were timed: the CPU, the options, the lengths and their rule, the mode
        (the head of this report's JSON and of the quantize report's ``latency``)."""
        return {
            "cpu": self.cpu,
            "options": self.options.to_dict(),
            "lengths": {"used": list(self.lengths), "rule": self.lengths_rule},
            "mode": self.mode.value,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "baseline": self.baseline,
            "models": [model.to_dict() for model in self.models],
        }


def cpu_name() -> str:
    """The CPU's model name as the system reports it (``model name`` in /proc/cpuinfo), and the
    number of CPUs this process may use."""
    name = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                name = value.strip()
                break
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 0
    return f"{name}, {count} CPUs"


def model_file_bytes(path: str) -> int:
    """The bytes of a model file and of the external data files it names (read from the graph
    without loading any tensor)."""
    import onnx

    total = os.path.getsize(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # onnxruntime reports an unreadable model when it opens it
        return total
    seen: set[str] = set()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value not in seen:
                seen.add(entry.value)
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(directory, entry.value))
    return total


def _all_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            if attribute.HasField("g"):
                yield from _all_tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _all_tensors(sub)


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo, or None where the system does not say."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


LARGEST_SHARE = 1.2
"""By default the sessions open together may take this multiple of what the largest one needs: the
measurement never holds several times the original model in memory (so ``quantize``'s peak stays
near the model's size), whatever the number of candidates."""
SMALL_BUDGET_BYTES = 256 * 2**20
"""Below this, sessions are kept together whatever their number (small models are cheap to hold)."""


def default_budget(file_bytes: Sequence[int], available_bytes: int | None) -> int:
    """The memory the sessions open together may take when the caller sets none: a little more than
    the largest model's session (:data:`LARGEST_SHARE`), at least :data:`SMALL_BUDGET_BYTES`, and
    never more than a share (:data:`MEMORY_SHARE`) of what the system has available."""
    largest = SESSION_BYTES_PER_FILE_BYTE * max(file_bytes, default=0)
    budget = max(SMALL_BUDGET_BYTES, int(LARGEST_SHARE * largest))
    if available_bytes is not None:
        budget = min(budget, int(available_bytes * MEMORY_SHARE))
    return budget


def choose_mode(file_bytes: Sequence[int], budget_bytes: int | None) -> Mode:
    """Together when the estimated sessions fit in ``budget_bytes`` (None: no limit known)."""
    if budget_bytes is None:
        return Mode.TOGETHER
    needed = SESSION_BYTES_PER_FILE_BYTE * sum(file_bytes)
    return Mode.TOGETHER if needed <= budget_bytes else Mode.ONE_AT_A_TIME


def default_lengths(specs: Sequence[InputSpec], synthesis: VerifyOptions) -> tuple[tuple[int, ...], str]:
    """The default bench lengths for a model's inputs, and the rule that chose them."""
    roles = dim_roles(specs, synthesis)
    image = _image_input(specs, roles)
    if image is not None:
        return IMAGE_LENGTHS, f"default for image inputs ({image!r} has a symbolic height and width)"
    names = roles.sequence
    if len(names) > 1:
        return SEVERAL_DIMS_LENGTHS, (
            f"default for inputs with several length dims ({', '.join(sorted(names))}): each takes"
            " the length; fix one with a dim value to time realistic shapes"
        )
    return DEFAULT_LENGTHS, "default: a short and a long input"


def run_order(round_index: int, models: int) -> tuple[int, ...]:
    """The order of the models in a round: every permutation in turn (AB, BA for two models).

    With more than 5 models (120 permutations), a rotation by the round's index instead."""
    if models > 5:
        return tuple((round_index + i) % models for i in range(models))
    orders = list(itertools.permutations(range(models)))
    return orders[round_index % len(orders)]


def ratio_interval(
    reference: Sequence[float], candidate: Sequence[float], draws: int = BOOTSTRAP_DRAWS
) -> tuple[float, float]:
    """95% bootstrap interval of median(candidate) / median(reference), resampling the rounds
    (sample ``i`` of both is round ``i``); seeded, so the same samples give the same interval."""
    a, b = np.asarray(reference, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if len(a) != len(b) or not len(a):
        raise ValueError("the samples must come in rounds: one of each per round")
    picks = np.random.default_rng(1).integers(0, len(a), size=(draws, len(a)))
    ratios = np.median(b[picks], axis=1) / np.median(a[picks], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


class _Model:
    """A model to time: its path, label, inputs, feeds per length and (when open) its session."""

    def __init__(self, path: str, label: str, factory: SessionFactory, threads: int) -> None:
        self.path = path
        self.label = label
        self._factory = factory
        self._threads = threads
        self.session: Session | None = None
        self.specs: list[InputSpec] = []
        self.feeds: dict[int, dict[str, np.ndarray]] = {}

    def open(self) -> Session:
        if self.session is None:
            try:
                self.session = self._factory(self.path, self._threads)
            except Exception as err:
                raise ModelLoadError(f"onnxruntime cannot load {self.label}: {_first_line(err)}") from err
        return self.session

    def close(self, collect: bool = True) -> None:
        """Drop the session; ``collect``: have its memory back now (a cycle may hold it)."""
        if self.session is None:
            return
        self.session = None
        if collect:
            gc.collect()

    def run(self, length: int) -> None:
        session = self.session
        assert session is not None
        try:
            session.run(None, self.feeds[length])
        except Exception as err:
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self.feeds[length].items())
            raise ModelRunError(
                f"onnxruntime cannot run {self.label} at length {length} ({shapes}): {_first_line(err)}"
            ) from err


def time_models(
    paths: Sequence[str | os.PathLike[str]],
    options: TimingOptions | None = None,
    *,
    baseline: int = 0,
    labels: Sequence[str] | None = None,
    clock: Clock | None = None,
    session_factory: SessionFactory | None = None,
) -> TimingReport:
    """Time the models at ``paths`` side by side (see the module's description).

    Args:
        paths: The models; ``baseline`` indexes the one the others are compared with.
        options: Lengths, rounds, threads and input synthesis.
        labels: A name per model for the report (default: the paths).
        clock: Seconds, monotonic (default ``time.perf_counter``).
        session_factory: Opens a model (default :func:`timed_session`).

    Raises:
        InputError: no model, a baseline out of range, labels that do not match the paths, or
            synthesis options naming inputs or dims a model does not have.
        ModelLoadError: onnxruntime cannot load a model.
        ModelRunError: a model cannot run at a length.
    """
    options = options or TimingOptions()
    clock = clock or _default_clock
    factory = session_factory or timed_session
    names = [os.fspath(p) for p in paths]
    if not names:
        raise InputError("no model to time")
    if not 0 <= baseline < len(names):
        raise InputError(f"baseline {baseline} out of range: {len(names)} models")
    labels = list(labels) if labels is not None else names
    if len(labels) != len(names):
        raise InputError(f"{len(labels)} labels for {len(names)} models")
    sizes = [model_file_bytes(p) for p in names]
    budget = options.memory_budget_bytes
    if budget is None:
        budget = default_budget(sizes, available_memory_bytes())
    mode = choose_mode(sizes, budget)
    synthesis = dataclasses.replace(options.synthesis, batch=1, lengths=None)
    models = [_Model(p, label, factory, options.threads) for p, label in zip(names, labels, strict=True)]
    lengths, rule = _prepare(models, baseline, options, synthesis, mode)
    samples: list[dict[int, list[float]]] = [{n: [] for n in lengths} for _ in models]
    try:
        if mode is Mode.TOGETHER:
            _warm_up(models, lengths, options.warmup)
            for index in range(options.rounds):
                for length in lengths:
                    for which in run_order(index, len(models)):
                        samples[which][length].append(_timed(models[which], length, clock))
        else:
            for index in range(options.rounds):
                for which in run_order(index, len(models)):
                    model = models[which]
                    model.open()
                    try:
                        _warm_up([model], lengths, max(1, options.warmup))
                        for length in lengths:
                            samples[which][length].append(_timed(model, length, clock))
                    finally:
                        model.close()
    finally:
        for model in models:
            model.close(collect=False)
        gc.collect()
    timings = []
    for which, model in enumerate(models):
        rows = []
        for length in lengths:
            mine = samples[which][length]
            if which == baseline:
                rows.append(Latency(length, tuple(mine)))
                continue
            reference = samples[baseline][length]
            ratio = float(np.median(mine) / np.median(reference))
            low, high = ratio_interval(reference, mine)
            rows.append(Latency(length, tuple(mine), ratio, low, high))
        signature = _signature(model.specs)
        timings.append(ModelTiming(model.path, model.label, sizes[which], tuple(rows), signature))
    return TimingReport(tuple(timings), baseline, lengths, rule, options, mode, cpu_name())


def _prepare(
    models: Sequence[_Model], baseline: int, options: TimingOptions, synthesis: VerifyOptions, mode: Mode
) -> tuple[tuple[int, ...], str]:
    """Open each model to read its inputs (closing it again when they are timed one at a time),
    choose the lengths from the baseline's, and make every model's feeds."""
    for model in models:
        try:
            model.specs = input_specs(model.open())  # no reference kept: close() ends the session
            check_names(model.specs, synthesis)
        finally:
            if mode is Mode.ONE_AT_A_TIME:
                model.close()
    if options.feeds is not None:
        for model in models:
            model.feeds = {number: _own_inputs(model, feed) for number, feed in options.feeds}
        return tuple(number for number, _ in options.feeds), options.feeds_rule or "the given inputs"
    if options.lengths is not None:
        lengths, rule = options.lengths, "given"
    else:
        lengths, rule = default_lengths(models[baseline].specs, synthesis)
    for model in models:
        roles = dim_roles(model.specs, synthesis)
        model.feeds = {
            n: synthesise_inputs(model.specs, n, synthesis, roles.values(n, synthesis, batch=1), roles)[0]
            for n in lengths
        }
    return tuple(lengths), rule


def _own_inputs(model: _Model, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of ``feed`` that ``model`` takes, by its inputs' names."""
    missing = [spec.name for spec in model.specs if spec.name not in feed]
    if missing:
        raise InputError(f"the inputs to time {model.label} on lack {', '.join(missing)}")
    return {spec.name: np.asarray(feed[spec.name]) for spec in model.specs}


def _warm_up(models: Sequence[_Model], lengths: Sequence[int], runs: int) -> None:
    for model in models:
        for length in lengths:
            for _ in range(runs):
                model.run(length)


def _timed(model: _Model, length: int, clock: Clock) -> float:
    """Milliseconds of one run."""
    start = clock()
    model.run(length)
    return (clock() - start) * 1000.0
