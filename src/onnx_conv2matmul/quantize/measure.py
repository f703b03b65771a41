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
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_conv2matmul.errors import Hint, ModelLoadError, ModelRunError, OutOfMemory, is_out_of_memory
from onnx_conv2matmul.quantize.reference import Reference, feed_set

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.speed.timing import ModelTiming, TimingOptions
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
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.use_deterministic_compute = True
    return so


def open_original(path: str, verify: VerifyOptions) -> Any:
    """The original's one session.

    Raises:
        ModelLoadError: onnxruntime cannot load it.
        OutOfMemory: it does not fit in memory.
    """
    import onnxruntime as ort

    from onnx_conv2matmul.verify.run import release_freed_memory

    release_freed_memory()
    try:
        options = session_options(verify, prepack=False)
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
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
        _run_all(session, reference)
    except ModelRunError:
        if feeds.replan is None:
            raise
        # A planned length the model cannot run at: plan as the check does, running each length
        # (spares replace those that fail), then measure again.
        feeds = feeds.replan()
        reference = Reference(scratch, names, feeds)
        _run_all(session, reference)
    measurement = Measurement(reference)
    reference.feeds.replan = None  # it holds the session, whose mapped weights must go now
    from onnx_conv2matmul.verify.run import input_specs

    specs = input_specs(session)
    del session  # the timing's own session prepacks its weights, as a user's does
    gc.collect()
    if timing is not None:
        from onnx_conv2matmul.speed.timing import default_lengths, time_models

        say("Timing the original")
        rule = ""
        if timing.lengths is None and timing.feeds is None:
            synthesis = dataclasses.replace(timing.synthesis, batch=1, lengths=None)
            lengths, rule = default_lengths(specs, synthesis)
            timing = dataclasses.replace(timing, lengths=lengths[:1])
            rule = f"the shortest of {rule}" if len(lengths) > 1 else rule
        report = time_models([plan.src], timing, labels=["original"])
        measurement.timing = report.models[0]
        measurement.timing_options = timing
        measurement.timing_rule = rule or report.lengths_rule
    return measurement


def _run_all(session: Any, reference: Reference) -> None:
    """Every feed of the reference once through the original, its outputs kept."""
    from onnx_conv2matmul.quantize.search_runs import _run

    feeds = reference.feeds
    for index, feed in enumerate(feeds.feeds):
        try:
            outputs = _run(session, feed)
        except OutOfMemory:
            raise
        except Exception as err:  # onnxruntime's own errors: this run cannot be made
            shapes = ", ".join(f"{k}{list(np.asarray(v).shape)}" for k, v in feed.items())
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelRunError(
                f"onnxruntime cannot run the original model at length {feeds.lengths[index]}"
                f" ({shapes}): {first}"
            ) from err
        reference.put(index, outputs)
        del outputs
