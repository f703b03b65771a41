"""The measure stage of the one quantize pass: one session of the original, used for everything
the run needs of it.

That session plans the check's inputs (and probes the model's dims), runs every feed once (its
outputs become the :class:`~onnx_conv2matmul.quantize.reference.Reference` every candidate is
compared with, kept in files of the run's scratch folder, read back memory-mapped) and, when the
run times its result, times the original at the timing's lengths. It is made as a user makes
one (onnxruntime's default graph optimizations, idle threads not spinning), and closed before any
candidate is built. It does not prepack its weights (see :func:`session_options`); the
original is timed in a session of its own that does, as a user's session does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_conv2matmul.errors import (
    Conv2MatMulError,
    Hint,
    ModelLoadError,
    ModelRunError,
    OutOfMemory,
    first_line,
    is_out_of_memory,
)
from onnx_conv2matmul.quantize.reference import Reference, feed_set
from onnx_conv2matmul.verify.run import release_freed_memory, run_deterministic

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.speed.timing import ModelTiming, TimingOptions
    from onnx_conv2matmul.verify.feeds import InputSpec
    from onnx_conv2matmul.verify.options import VerifyOptions


@dataclasses.dataclass
class Measurement:
    """What the original gave: the reference outputs per feed, and its latency (None: not timed)."""

    reference: Reference
    timing: ModelTiming | None = None
    timing_options: TimingOptions | None = None
    timing_rule: str = ""


PREPACKING_KEY = "session.disable_prepacking"


def session_options(verify: VerifyOptions, *, prepack: bool = True) -> Any:
    """The settings of every checking session of the pass: onnxruntime's default graph
    optimizations, idle threads not spinning, the check's determinism when asked for. Without
    ``prepack`` (the original's session), onnxruntime runs on the weights where they lie (the
    external data memory-mapped) instead of copying each into its kernels' layout first (on the
    2.4 GB encoder: 0.1 s and 0.1 GB to open instead of 6 s and 2.2 GB; runs of the check's
    lengths take about as long). MatMulNBits needs its prepacked layout to run fast, and the
    timing's sessions prepack, as a user's do."""
    import onnxruntime as ort

    from onnx_conv2matmul.speed.timing import SPINNING_KEY

    so = ort.SessionOptions()
    so.log_severity_level = 4  # fatal only: the error is in the exception
    so.add_session_config_entry(SPINNING_KEY, "0")
    if not prepack:
        so.add_session_config_entry(PREPACKING_KEY, "1")
    if verify.deterministic:
        run_deterministic(so)
    return so


def open_original(path: str, verify: VerifyOptions) -> Any:
    """The original's one session.

    Raises:
        ModelLoadError: onnxruntime cannot load it.
        OutOfMemory: it does not fit in memory.
    """
    import onnxruntime as ort

    release_freed_memory()
    try:
        options = session_options(verify, prepack=False)
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as err:
        first = first_line(err)
        if is_out_of_memory(err):
            raise OutOfMemory(
                f"out of memory loading the original model: {first}", hint=Hint.VERIFY_OUT_OF_MEMORY
            ) from err
        raise ModelLoadError(f"onnxruntime cannot load the original model: {first}") from err


def measure(
    plan: QuantizePlan, scratch: str, timing: TimingOptions | None, say: Callable[[str], None]
) -> Measurement:
    """Plan the check's inputs, run the original once on each into a reference in ``scratch``,
    and with ``timing``, time it (see :func:`onnx_conv2matmul.speed.timing.time_models`; without
    lengths, at the shortest of the default ones). ``say`` announces each step.

    Raises:
        ModelRunError, InputError, OutOfMemory: as the accuracy check raises them.
    """
    say("Measuring the original on the check's inputs")
    session = open_original(plan.src, plan.verify)
    names = [o.name for o in session.get_outputs()]
    feeds = feed_set(plan.src, plan.verify, session=session)
    reference = Reference(scratch, names, feeds)
    try:
        _run_all(session, reference, plan.verify)
    except ModelRunError:
        if feeds.replan is None:
            raise
        # A planned length the model cannot run at: plan as the check does, running each length
        # (spares replace those that fail), then measure again.
        feeds = feeds.replan()
        reference = Reference(scratch, names, feeds)
        _run_all(session, reference, plan.verify)
    measurement = Measurement(reference)
    reference.feeds.replan = None  # it holds the session, whose mapped weights must go now
    from onnx_conv2matmul.verify.run import input_specs

    specs = input_specs(session)
    if timing is not None:
        from onnx_conv2matmul.speed.timing import time_models

        timing, rule = _timing(session, specs, timing, plan, reference)
        del session  # the timing's own session prepacks its weights, as a user's does
        release_freed_memory()
        rule = rule or "given"
        cache = _timing_cache(plan, timing) if keeps_figures(plan) else None
        cached = _cached_timing(cache) if cache is not None else None
        if cached is not None:
            measurement.timing, when = cached
            rule = f"{rule}; the original's latency from this machine's cache (timed {when})"
        else:
            say("Timing the original")
            report = time_models([plan.src], timing, labels=["original"])
            measurement.timing = report.models[0]
            if cache is not None:
                _keep_timing(cache, measurement.timing)
        measurement.timing_options = timing
        measurement.timing_rule = rule
    return measurement


def _run_all(session: Any, reference: Reference, verify: VerifyOptions) -> None:
    """Every feed of the reference once through the original, its outputs kept.

    Raises:
        ModelRunError: onnxruntime cannot run it on a feed (naming the file, for real inputs).
        OutOfMemory: memory ran out.
    """
    from onnx_conv2matmul.verify.options import feed_source
    from onnx_conv2matmul.verify.run import run_feeds

    feeds = reference.feeds
    for index, feed in enumerate(feeds.feeds):
        hint = None
        where = f"at length {feeds.lengths[index]}"
        if verify.feeds is not None:
            number = feeds.lengths[index]
            where = f"on inputs {feed_source(verify.feeds[number - 1], number - 1)}"
            hint = Hint.INPUT_FILES
        outputs = run_feeds(session, feed, "original", where, hint)
        reference.put(index, outputs)
        del outputs


def _timing(
    session: Any, specs: Sequence[InputSpec], timing: TimingOptions, plan: QuantizePlan, reference: Reference
) -> tuple[TimingOptions, str]:
    """What the default latency line times, and how it was chosen: the smallest of the given
    inputs (``--inputs``), at batch 1; the lengths given (``--bench-lengths``); else the shortest
    of the timing's default lengths when the original runs there, or the check's shortest run."""
    from onnx_conv2matmul.speed.inputs import first_sample, input_shapes, pick_feeds, shapes_text
    from onnx_conv2matmul.speed.timing import default_lengths
    from onnx_conv2matmul.verify.options import feed_source

    if plan.verify.feeds is not None:
        given = plan.verify.feeds
        smallest = pick_feeds(given)[0]
        sample = first_sample(given[smallest], input_shapes(plan.src))
        described = (
            f"the smallest of the given inputs (--inputs), batch 1: {smallest + 1}:"
            f" {feed_source(given[smallest], smallest)} ({shapes_text(sample)})"
        )
        return dataclasses.replace(timing, feeds=((smallest + 1, sample),), feeds_rule=described), described
    if timing.lengths is not None or timing.feeds is not None:
        return timing, ""
    synthesis = dataclasses.replace(timing.synthesis, batch=1, lengths=None)
    lengths, rule = default_lengths(specs, synthesis)
    short = lengths[0]
    # Planned as the check plans (the dims and values it discovers) and run once to prove them.
    # A model the check found failing at some lengths takes only some: the default lengths are
    # proved all, and where one fails the check's own shortest run is timed instead (silero VAD
    # runs at 200 samples, not at 1000 nor at most lengths). Any other model proves only the
    # shortest, the one timed (on the Parakeet-shaped encoder a run at 1000 frames here cost 1.3 s
    # of a cold run; `bench` and `--bench full` prove the lengths they time).
    proved = tuple(lengths) if reference.feeds.not_run else (short,)
    options = dataclasses.replace(plan.verify, batch=1, lengths=proved, feeds=None)
    try:
        planned = feed_set(plan.src, options, session=session)
    except Conv2MatMulError:  # it cannot run there (a fixed height, a value it needs)
        planned = None
    if planned is not None and set(proved) <= set(planned.lengths):  # the planner may add runs
        at = {n: planned.feeds[i] for i, n in enumerate(planned.lengths) if n in proved}
        try:
            for feed in at.values():
                session.run(None, dict(feed))
            runs_there = True
        except Exception:  # onnxruntime's own errors: it cannot run there
            runs_there = False
        if runs_there:
            shortest = f"the shortest of {rule}" if len(lengths) > 1 else rule
            return dataclasses.replace(timing, feeds=((short, at[short]),), feeds_rule=shortest), shortest
    feeds = reference.feeds
    runs = list(feeds.runs) if feeds.runs else []
    usable = [i for i in range(len(feeds.feeds)) if not (i < len(runs) and getattr(runs[i], "long", False))]
    usable = usable or list(range(len(feeds.feeds)))
    index = usable[pick_feeds([feeds.feeds[i] for i in usable])[0]]  # the smallest
    chosen = first_sample(feeds.feeds[index], input_shapes(plan.src))
    number = feeds.lengths[index]
    described = f"the accuracy check's shortest run, batch 1: {number}: {shapes_text(chosen)}"
    return dataclasses.replace(timing, feeds=((number, chosen),), feeds_rule=described), described


# The original's latency is kept in the cache folder (``original-latency/``, beside the kernel
# costs; ``--no-bench-cache`` neither reads nor writes it) under a key of the model's files (the
# .onnx's bytes, its data files' sizes and times), this CPU, onnxruntime's version and the timing
# (threads, rounds, warm-up, the inputs' shapes): opening the original in a session that prepacks
# its weights, as a user's does, costs most of a default run's timing (6 s of 8 on the 2.4 GB
# encoder), and a second run on the same model and machine need not pay it again. A small model's
# session opens in a moment: it is timed afresh, as the result is.

CACHE_MIN_BYTES = 64 * 2**20
"""Models whose files hold at least this many bytes have the original's latency kept, and the
losses of their classes of layers (:mod:`~onnx_conv2matmul.quantize.classes`): a small model
measures both in a moment."""


def keeps_figures(plan: QuantizePlan) -> bool:
    """Whether the run reads and keeps its model's figures in the cache folder (the original's
    latency, the classes' losses): not with ``--no-bench-cache``, nor for a model of fewer than
    :data:`CACHE_MIN_BYTES`."""
    from onnx_conv2matmul.files.paths import model_file_bytes

    return (plan.speed is None or plan.speed.cache) and model_file_bytes(plan.src) >= CACHE_MIN_BYTES


def model_cache_file(
    kind: str, path: str, what: Sequence[Any], arrays: Iterable[tuple[str, Any]] = ()
) -> str:
    """The file in the cache folder's ``kind/`` that keeps a figure of the model at ``path``: named
    by a digest of the model's ``.onnx`` bytes, each data file's name, size and modification time
    beside it, this CPU, onnxruntime's version, ``what`` (JSON) and the named ``arrays``' bytes."""
    import hashlib
    import json
    import os

    import onnxruntime as ort

    from onnx_conv2matmul.speed.costs import cache_dir
    from onnx_conv2matmul.speed.machine import cpu_name

    h = hashlib.sha256()
    with open(path, "rb") as file:
        h.update(file.read())
    folder = os.path.dirname(os.path.abspath(path))
    stem = os.path.basename(path)
    for name in sorted(os.listdir(folder)):
        if name.startswith(stem) and name != stem:  # its data files (model.onnx.data, ...)
            stat = os.stat(os.path.join(folder, name))
            h.update(f"{name} {stat.st_size} {stat.st_mtime_ns}".encode())
    h.update(json.dumps([cpu_name(), ort.__version__, *what]).encode())
    for name, array in arrays:
        data = np.ascontiguousarray(array)
        h.update(f"{name} {data.dtype} {data.shape}".encode())
        h.update(data.tobytes())
    return os.path.join(cache_dir(), kind, h.hexdigest()[:32] + ".json")


def _timing_cache(plan: QuantizePlan, timing: TimingOptions) -> str:
    """The file the original's latency under ``timing`` is kept in."""
    feeds = [
        (n, {k: (list(np.shape(v)), str(np.asarray(v).dtype)) for k, v in f.items()})
        for n, f in timing.feeds or ()
    ]
    what = [timing.threads, timing.rounds, timing.warmup, timing.lengths, feeds]
    return model_cache_file("original-latency", plan.src, what)


def _cached_timing(path: str) -> tuple[ModelTiming, str] | None:
    """The original's latency kept at ``path``, and when it was timed (None: none kept)."""
    import json

    from onnx_conv2matmul.speed.latency import Latency
    from onnx_conv2matmul.speed.timing import ModelTiming

    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        latencies = tuple(
            Latency(int(lat["length"]), tuple(float(x) for x in lat["samples_ms"]))
            for lat in data["latencies"]
        )
        timing = ModelTiming(
            str(data["path"]), "original", int(data["file_bytes"]), latencies, str(data["inputs"])
        )
        return timing, str(data["timed"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _keep_timing(path: str, timing: ModelTiming) -> None:
    from onnx_conv2matmul.speed.costs import keep_cached, now_text

    data = {
        "path": timing.path,
        "file_bytes": timing.file_bytes,
        "inputs": timing.inputs,
        "timed": now_text(),
        "latencies": [{"length": lat.length, "samples_ms": list(lat.samples_ms)} for lat in timing.latencies],
    }
    keep_cached(path, data)
