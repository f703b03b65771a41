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
creations, but never more than one model in memory. When the baseline and the largest other
model fit in the budget together (:func:`~onnx_conv2matmul.speed.machine.keeps_baseline`: an
original and its quantized candidates, each several times smaller), the baseline's session stays
open instead, and each other model is opened once and timed in rounds of its own, alternating
with the baseline's; its ratio is taken against the baseline's runs of those rounds.

The clock and the session factory are parameters, so tests drive the measurement with a fake
timer and fake sessions: no test depends on how fast anything runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from onnx_conv2matmul.errors import InputError, ModelLoadError, ModelRunError, first_line
from onnx_conv2matmul.files.paths import model_file_bytes
from onnx_conv2matmul.speed.latency import BOOTSTRAP_DRAWS as BOOTSTRAP_DRAWS
from onnx_conv2matmul.speed.latency import DEFAULT_ROUNDS as DEFAULT_ROUNDS
from onnx_conv2matmul.speed.latency import DEFAULT_WARMUP as DEFAULT_WARMUP
from onnx_conv2matmul.speed.latency import Latency as Latency
from onnx_conv2matmul.speed.latency import Mode as Mode
from onnx_conv2matmul.speed.latency import ModelTiming as ModelTiming
from onnx_conv2matmul.speed.latency import TimingOptions as TimingOptions
from onnx_conv2matmul.speed.latency import TimingReport as TimingReport
from onnx_conv2matmul.speed.latency import ratio_interval as ratio_interval
from onnx_conv2matmul.speed.latency import settled
from onnx_conv2matmul.speed.machine import LARGEST_SHARE as LARGEST_SHARE
from onnx_conv2matmul.speed.machine import MEMORY_SHARE as MEMORY_SHARE
from onnx_conv2matmul.speed.machine import SESSION_BYTES_PER_FILE_BYTE as SESSION_BYTES_PER_FILE_BYTE
from onnx_conv2matmul.speed.machine import SMALL_BUDGET_BYTES as SMALL_BUDGET_BYTES
from onnx_conv2matmul.speed.machine import CpuWait, keeps_baseline
from onnx_conv2matmul.speed.machine import available_memory_bytes as available_memory_bytes
from onnx_conv2matmul.speed.machine import choose_mode as choose_mode
from onnx_conv2matmul.speed.machine import cpu_name as cpu_name
from onnx_conv2matmul.speed.machine import default_budget as default_budget
from onnx_conv2matmul.verify.feeds import (
    InputSpec,
    check_names,
    dim_roles,
    inputs_signature,
    synthesise_inputs,
)
from onnx_conv2matmul.verify.options import VerifyOptions
from onnx_conv2matmul.verify.plan import image_input
from onnx_conv2matmul.verify.run import input_specs, release_freed_memory

SPINNING_KEY = "session.intra_op.allow_spinning"
DEFAULT_LENGTHS = (200, 1000)
"""Lengths for a model with one sequence dim: e.g. 2 s and 10 s of audio at 100 frames a second."""
IMAGE_LENGTHS = (224, 448)
"""Lengths for a model whose input has a symbolic height and width."""
SEVERAL_DIMS_LENGTHS = (16, 64)
"""Lengths for a model whose inputs have several distinct length dims (a joint's T and U): every
such dim takes the length, so an output can grow with its square."""


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
    default) that do not spin while idle, graph optimizations as onnxruntime's default, and no
    memory pattern.

    The memory pattern (onnxruntime's default) keeps, per input shape, one block sized for every
    activation of a run, held between runs; timed side by side, each session held its own. Without
    it the activations come from the arena one by one: on a YOLO detector at 640x640 one session
    held 183 MiB after its runs instead of 279 MiB, at the same latency (1.007x, interleaved; 0.94x
    to 1.00x on PP-OCR models), which three sessions timed together pay three times."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 4  # fatal only: the error is in the exception
    options.add_session_config_entry(SPINNING_KEY, "0")
    options.enable_mem_pattern = False
    session: Session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return session


def _default_clock() -> float:
    import time

    return time.perf_counter()


REAL_CLOCK = _default_clock
"""The machine's clock as this module defines it, kept apart from ``_default_clock`` (which tests
replace with fake clocks): only a timing on it says anything of the machine's load (see
:class:`onnx_conv2matmul.speed.machine.CpuWait`)."""


def default_lengths(specs: Sequence[InputSpec], synthesis: VerifyOptions) -> tuple[tuple[int, ...], str]:
    """The default bench lengths for a model's inputs, and the rule that chose them."""
    roles = dim_roles(specs, synthesis)
    image = image_input(specs, roles)
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
                raise ModelLoadError(f"onnxruntime cannot load {self.label}: {first_line(err)}") from err
        return self.session

    def close(self, collect: bool = True) -> None:
        """Drop the session; ``collect``: have its memory back now (a cycle may hold it)."""
        if self.session is None:
            return
        self.session = None
        if collect:
            release_freed_memory()

    def run(self, length: int) -> None:
        session = self.session
        assert session is not None
        try:
            session.run(None, self.feeds[length])
        except Exception as err:
            shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self.feeds[length].items())
            raise ModelRunError(
                f"onnxruntime cannot run {self.label} at length {length} ({shapes}): {first_line(err)}"
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
    kept = baseline if mode is Mode.ONE_AT_A_TIME and keeps_baseline(sizes, baseline, budget) else None
    synthesis = dataclasses.replace(options.synthesis, batch=1, lengths=None)
    models = [_Model(p, label, factory, options.threads) for p, label in zip(names, labels, strict=True)]
    lengths, rule = _prepare(models, baseline, options, synthesis, mode, kept)
    samples: list[dict[int, list[float]]] = [{n: [] for n in lengths} for _ in models]
    paired: dict[int, dict[int, list[float]]] = {}  # the baseline's runs beside each model, if apart
    wait = CpuWait(enabled=clock is REAL_CLOCK)
    try:
        with wait:
            if mode is Mode.TOGETHER:
                _warm_up(models, lengths, options.warmup)
                for index in range(options.rounds):
                    for length in lengths:
                        for which in run_order(index, len(models)):
                            samples[which][length].append(_timed(models[which], length, clock))
                    if _settled(samples, baseline, index + 1, options):
                        break
            elif kept is not None:
                paired = _beside_baseline(models, baseline, lengths, samples, options, clock)
            else:
                for index in range(options.rounds):
                    if index and _settled(samples, baseline, index, options):
                        break
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
        release_freed_memory()
    timings = []
    for which, model in enumerate(models):
        rows = []
        for length in lengths:
            mine = samples[which][length]
            if which == baseline:
                rows.append(Latency(length, tuple(mine)))
                continue
            reference = paired[which][length] if which in paired else samples[baseline][length]
            ratio = float(np.median(mine) / np.median(reference))
            low, high = ratio_interval(reference, mine)
            rows.append(Latency(length, tuple(mine), ratio, low, high))
        signature = inputs_signature(model.specs)
        timings.append(ModelTiming(model.path, model.label, sizes[which], tuple(rows), signature))
    return TimingReport(tuple(timings), baseline, lengths, rule, options, mode, cpu_name(), wait.share)


def _beside_baseline(
    models: Sequence[_Model],
    baseline: int,
    lengths: Sequence[int],
    samples: Sequence[dict[int, list[float]]],
    options: TimingOptions,
    clock: Clock,
) -> dict[int, dict[int, list[float]]]:
    """Time each other model in rounds of its own beside the baseline, whose session stays open
    (see :func:`~onnx_conv2matmul.speed.machine.keeps_baseline`): each is opened and warmed up
    once, then runs alternate with the baseline's (AB, BA, ...), and its ratio is taken against
    the baseline's runs of the same rounds, which are returned by model (every run of the
    baseline goes into ``samples`` too)."""
    base = models[baseline]
    base.open()
    _warm_up([base], lengths, max(1, options.warmup))
    paired: dict[int, dict[int, list[float]]] = {}
    for which in (i for i in range(len(models)) if i != baseline):
        model = models[which]
        pair = paired[which] = {n: [] for n in lengths}
        model.open()
        try:
            _warm_up([model], lengths, max(1, options.warmup))
            for index in range(options.rounds):
                if index and _settled([pair, samples[which]], 0, index, options):
                    break
                for slot in run_order(index, 2):
                    for length in lengths:
                        if slot == 0:
                            ms = _timed(base, length, clock)
                            pair[length].append(ms)
                            samples[baseline][length].append(ms)
                        else:
                            samples[which][length].append(_timed(model, length, clock))
        finally:
            model.close()
    return paired


def _settled(
    samples: Sequence[Mapping[int, Sequence[float]]], baseline: int, done: int, options: TimingOptions
) -> bool:
    """Whether the timing may stop after ``done`` rounds (see ``TimingOptions.settle_after``)."""
    if options.settle_after is None or done < options.settle_after:
        return False
    reference = samples[baseline]
    return all(
        settled(reference[length], mine[length])
        for which, mine in enumerate(samples)
        if which != baseline
        for length in mine
    )


def _prepare(
    models: Sequence[_Model],
    baseline: int,
    options: TimingOptions,
    synthesis: VerifyOptions,
    mode: Mode,
    kept: int | None = None,
) -> tuple[tuple[int, ...], str]:
    """Open each model to read its inputs (closing it again when they are timed one at a time,
    but the ``kept`` one), choose the lengths from the baseline's, and make every model's feeds."""
    for index, model in enumerate(models):
        try:
            model.specs = input_specs(model.open())  # no reference kept: close() ends the session
            check_names(model.specs, synthesis)
        finally:
            if mode is Mode.ONE_AT_A_TIME and index != kept:
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
