"""Running the models of a check in onnxruntime: sessions, runs, and what runs out of memory.

Sessions run with onnxruntime's graph optimizations off (no fusion can hide a wrong
rewrite). Their memory arena is shrunk at the end of each run, so what a run allocates is given
back when it ends (:func:`run_options`).
One model is loaded at a time: the original runs every planned run first, then the
candidate. A run that runs out of memory (numpy's ``MemoryError``, onnxruntime's
``bad_alloc`` or failed allocation) raises :class:`onnx_conv2matmul.errors.OutOfMemory`,
never a failed comparison.
"""

# pragma: no mutate start
from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import (
    Hint,
    InputError,
    ModelLoadError,
    ModelRunError,
    OutOfMemory,
    first_line,
    is_out_of_memory,
)
from onnx_conv2matmul.verify.feeds import inputs_signature, same_signature, synthesise_inputs
from onnx_conv2matmul.verify.given import check_feeds, check_names
from onnx_conv2matmul.verify.options import VerifyOptions, feed_source, format_size
from onnx_conv2matmul.verify.plan import LengthPlan, Run, feed_dims, probe_values
from onnx_conv2matmul.verify.ranges import input_value_ranges
from onnx_conv2matmul.verify.roles import InputSpec, Roles
from onnx_conv2matmul.verify.sizes import OutputSizes, declared_bytes, measure, output_decl, value_bytes
from onnx_conv2matmul.verify.stream import Spill, Spilled, cut_inputs, sample_rows

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
PROBE_LENGTHS = (16, 32, 64)
"""The base length of the runs that measure outputs whose size the model does not declare,
tried in turn until the original runs."""

SHRINK_ARENA_KEY = "memory.enable_memory_arena_shrinkage"
"""onnxruntime's run setting that gives the CPU arena's free memory back when a run ends."""


def session(path: str, options: VerifyOptions) -> Any:
    """An onnxruntime CPU session for a check (see the module's documentation).

    Raises:
        OutOfMemory: the model does not fit in memory.
        Exception: whatever onnxruntime raises for a model it cannot load.
    """
    import onnxruntime as ort

    so = session_options(options.deterministic)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def session_options(deterministic: bool) -> Any:
    """The settings of a checking session (the check's and the search's): no graph
    optimization, errors raised rather than logged, one thread when ``deterministic``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4  # fatal only: the error is in the exception
    if deterministic:
        run_deterministic(so)
    return so


def run_deterministic(so: Any) -> None:
    """Make the session options ``so`` give the same outputs run after run (``--deterministic``):
    one thread, nodes one after another, onnxruntime's deterministic kernels."""
    import onnxruntime as ort

    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.use_deterministic_compute = True


def run_options() -> Any:
    """The settings of one run of a checking session: errors raised rather than logged, and
    the memory arena shrunk when the run ends, so what the run allocated is given back.

    Within a run the arena serves each activation from memory the run already touched. Without
    an arena every activation of 4 MiB or more is a fresh mapping from the system (the console
    script fixes the C allocator's mmap threshold there: see ``cli.entry``), each of its pages
    faulted in anew: on PP-OCRv4's recognizer with 50 text lines, ``--auto --inputs`` spent 36 s
    of system time in 52 s; with the arena, 5 s in 33 s, and a lower peak (458 MB, not 500 MB)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = 4  # a failure is raised with its message; not logged as well
    options.add_run_config_entry(SHRINK_ARENA_KEY, "cpu:0")
    return options


def input_specs(session: Any) -> list[InputSpec]:
    specs = []
    for arg in session.get_inputs():
        dtype = _ORT_TYPES.get(arg.type)
        if dtype is None:
            raise InputError(f"cannot synthesise input {arg.name!r} of type {arg.type}")
        specs.append(InputSpec(arg.name, dtype, list(arg.shape)))
    return specs


# A full collection walks every object of the process: 0.1 s and more in a program with a large
# heap (a test runner, a notebook, an application), and about 30 ms in the command line, for
# nothing when little memory is held. So it runs only when the resident memory has grown by
# _COLLECT_AFTER since the lowest point seen after the last one: only then can it give back an
# amount that matters.
_COLLECT_AFTER = 256 << 20
_low_water: int | None = None


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux), or ``None`` where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_freed_memory(*, always: bool = False) -> None:
    """Give the memory this process freed back to the system before a model is loaded.

    A model's weights are freed when its session or its quantization ends, but a reference
    cycle can hold them until the next full collection, and the C allocator keeps the freed
    pages for later use: on the Parakeet-sized encoder that was about 350 MB held while the
    next model loaded. ``gc.collect`` and ``malloc_trim`` (glibc) return them, when the resident
    memory has grown by 256 MiB or more since the lowest point seen since the last time (see
    ``_COLLECT_AFTER``); where the resident memory cannot be read, or ``always``, every time.
    """
    global _low_water
    resident = resident_bytes()
    if resident is not None and _low_water is not None and not always:
        _low_water = min(_low_water, resident)
        if resident < _low_water + _COLLECT_AFTER:
            return
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        trim = None
    if trim is not None:
        trim(0)
    _low_water = resident_bytes() if resident is not None else None


def open_model(
    path: str,
    label: str,
    options: VerifyOptions,
    specs: list[InputSpec] | None = None,
    opened: Any = None,
) -> tuple[Any, list[InputSpec], list[str]]:
    """A session, the inputs (``specs`` when given: the other model's, checked to match) and
    the output names; the options' names and output indices are checked against them.
    What the process freed before is given back first (see :func:`release_freed_memory`).
    ``opened``: a session of the model at ``path`` made already (the quantize pass's one
    session of the original), used instead of a new one.

    Raises:
        ModelLoadError: onnxruntime cannot load the model.
        OutOfMemory: it does not fit in memory.
        InputError: the inputs differ from ``specs``, or an option names no input, dim or output.
    """
    try:
        if opened is None:
            release_freed_memory()
            opened = session(path, options)
    except Exception as err:
        if is_out_of_memory(err):
            raise OutOfMemory(
                f"out of memory loading the {label} model: {first_line(err)}", hint=Hint.VERIFY_OUT_OF_MEMORY
            ) from err
        raise ModelLoadError(f"onnxruntime cannot load the {label} model: {first_line(err)}") from err
    own_specs = input_specs(opened)
    if specs is None:
        ranges = input_value_ranges(path)
        for spec in own_specs:
            spec.value_range = ranges.get(spec.name)
    if specs is not None and not same_signature(specs, own_specs):
        raise InputError(
            "the two models have different inputs: "
            f"{inputs_signature(specs)} vs {inputs_signature(own_specs)}"
        )
    use = specs or own_specs
    check_names(use, options)
    if options.feeds is not None:
        check_feeds(use, options.feeds)
    names = [o.name for o in opened.get_outputs()]
    for index in options.output_indices or ():
        if not 0 <= index < len(names):
            raise InputError(f"output index {index} out of range: the model has {len(names)} outputs")
    return opened, use, names


def output_sizes(opened: Any) -> OutputSizes:
    """The outputs as the model declares them (measured later where that is not enough)."""
    return OutputSizes([output_decl(o.name, o.type, o.shape) for o in opened.get_outputs()])


def run_feeds(opened: Any, feeds: Mapping[str, np.ndarray], label: str, where: str, hint: Hint | None) -> Any:
    """The outputs of one run.

    Raises:
        OutOfMemory: memory ran out.
        ModelRunError: onnxruntime cannot run the model on these inputs (with ``hint``).
    """
    shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in feeds.items())
    try:
        return opened.run(None, dict(feeds), run_options())
    except Exception as err:
        if is_out_of_memory(err):
            raise OutOfMemory(
                f"out of memory running the {label} model {where} ({shapes}): {first_line(err)}",
                hint=Hint.VERIFY_OUT_OF_MEMORY,
            ) from err
        raise ModelRunError(
            f"onnxruntime cannot run the {label} model {where} ({shapes}): {first_line(err)}", hint=hint
        ) from err


def probe_run(opened: Any, feeds: Mapping[str, np.ndarray]) -> None:
    """Run the original once on probe inputs, dropping its outputs (see
    :mod:`onnx_conv2matmul.verify.discover`).

    Raises:
        ModelRunError: onnxruntime cannot run it on them.
        OutOfMemory: memory ran out.
    """
    run_feeds(opened, feeds, "original", "probing the sizes it takes", None)
    release_freed_memory()


def run_at(
    opened: Any, specs: list[InputSpec], run: Run, options: VerifyOptions, label: str, roles: Roles
) -> Any:
    """The outputs of ``run``; see :func:`run_feeds`."""
    if options.feeds is not None:
        feed = options.feeds[run.length - 1]
        feeds: Mapping[str, np.ndarray] = (
            sample_rows(feed, dict(run.cut), *run.rows) if run.rows is not None else feed
        )
        where = f"on inputs {feed_source(feed, run.length - 1)}"
        if run.rows is not None:
            where += f" (samples {run.rows[0] + 1} to {run.rows[1]})"
        hint: Hint | None = Hint.INPUT_FILES
    else:
        feeds, _ = synthesise_inputs(specs, run.length, options, run.dims, roles)
        where = f"at {_dims_text(run)}"
        hint = None
    return run_feeds(opened, feeds, label, where, hint)


def _dims_text(run: Run) -> str:
    text = ", ".join(f"{k} {v}" for k, v in run.dims.items())
    return f"length {run.length}" + (f" ({text})" if text else "")


def measure_outputs(
    opened: Any, specs: list[InputSpec], roles: Roles, options: VerifyOptions, sizes: OutputSizes
) -> OutputSizes:
    """``sizes``, measured where the declared shapes do not give an output's size.

    Runs the original at :data:`PROBE_LENGTHS` in turn until it runs, then once per dim with
    that dim doubled (see :func:`onnx_conv2matmul.verify.sizes.measure`); the outputs are
    dropped at once. Real inputs need no measurement: their runs are estimated from the
    first feed's measured outputs when the declarations are not enough.
    """
    if options.feeds is not None:
        if not sizes.unknown(feed_dims(options.feeds[0], roles, specs)):
            return sizes
        return _measure_feeds(opened, specs, roles, options, sizes)
    probe_base = roles.values(PROBE_LENGTHS[0], options, batch=1)
    if not sizes.unknown(probe_base):
        return sizes
    for length in PROBE_LENGTHS:
        base_values, varied_values = probe_values(roles, options, length)
        try:
            base = _probe(opened, specs, roles, options, base_values)
        except ModelRunError:
            continue
        varied = {}
        for key, values in varied_values.items():
            try:
                varied[key] = (values, _probe(opened, specs, roles, options, values))
            except ModelRunError:
                continue  # the dim cannot be doubled: its size is taken as it is at the base
            finally:
                release_freed_memory()
        sizes.measured = measure(base_values, base, varied)
        sizes.how = f"measured at length {length} and with each dim doubled"
        return sizes
    return sizes


def _probe(
    opened: Any, specs: list[InputSpec], roles: Roles, options: VerifyOptions, values: Mapping[str, int]
) -> list[Any]:
    feeds, _ = synthesise_inputs(specs, 1, options, values, roles)
    dims = ", ".join(f"{k} {v}" for k, v in values.items())
    where = f"measuring its outputs ({dims})" if dims else "measuring its outputs"
    outputs: list[Any] = run_feeds(opened, feeds, "original", where, None)
    return outputs


def _measure_feeds(
    opened: Any, specs: list[InputSpec], roles: Roles, options: VerifyOptions, sizes: OutputSizes
) -> OutputSizes:
    """With real inputs: the outputs the declarations leave unknown are measured on the first
    feed, and taken in proportion to each feed's input bytes (the feeds are not changed)."""
    assert options.feeds is not None
    whole = options.feeds[0]
    cut = cut_inputs(specs, whole)
    first = sample_rows(whole, cut, 0, 1) if cut else dict(whole)  # one sample is enough
    outputs = run_feeds(opened, first, "original", f"on inputs {feed_source(whole, 0)}", Hint.INPUT_FILES)
    values = feed_dims(first, roles, specs)
    unknown = sum(
        value_bytes(value)
        for decl, value in zip(sizes.decls, outputs, strict=True)
        if declared_bytes(decl, values) is None
    )
    inputs = max(1, sum(int(np.asarray(first[s.name]).nbytes) for s in specs))
    sizes.per_input_byte = unknown / inputs
    sizes.how = "measured on the first inputs file, in proportion to each file's input bytes"
    return sizes


def reference_runs(
    opened: Any,
    specs: list[InputSpec],
    plan: LengthPlan,
    options: VerifyOptions,
    planner_fit: Callable[..., Any],
    spill: Spill | None = None,
) -> tuple[list[tuple[Run, list[Any]]], list[tuple[int, str]]]:
    """The original's outputs of every run, and the lengths it could not run at (with why).

    A default run the original cannot run at is replaced by the next spare it runs at,
    fitted to the same share of the budget (``planner_fit(length, share)``).

    Raises:
        ModelRunError: a given length or real input cannot be run, or no length at all.
        OutOfMemory: memory ran out.
    """
    done: list[tuple[Run, list[Any]]] = []
    not_run: list[tuple[int, str]] = list(plan.left_out)
    spares = [n for n in plan.spares if n not in plan.wanted]
    first_error: ModelRunError | None = None
    for run in plan.runs:
        candidate: Run | None = run
        while candidate is not None:
            try:
                outputs = run_at(opened, specs, candidate, options, "original", plan.roles)
                if spill is not None:
                    outputs = spill.put(len(done), outputs)
                done.append((candidate, outputs))
                del outputs
                break
            except ModelRunError as err:
                if not plan.spares:
                    if options.feeds is not None:
                        raise
                    raise ModelRunError(f"{err}; fix input values, dim values or lengths") from err
                first_error = first_error or err
                not_run.append((candidate.length, first_line(err.__cause__ or err)))
                candidate = _next_spare(spares, candidate, planner_fit, done)
    if not done:
        tried = ", ".join(str(n) for n, _ in not_run)
        sequence = [d for d in plan.roles.dims if d.role.value == "sequence"]
        free = ", ".join(f"{d.key} ({', '.join(d.places)})" for d in sequence)
        raise ModelRunError(
            f"the original model runs at none of the synthesised shapes tried (dims {free or 'none'}"
            f" at lengths {tried}, after the probes for the sizes it takes): {first_error}",
            hint=Hint.SYNTHESISED_SHAPES,
        ) from first_error
    return done, not_run


def _next_spare(
    spares: list[int], failed: Run, fit: Callable[..., Any], done: Sequence[tuple[Run, Any]]
) -> Run | None:
    """The next spare length, fitted to the failed run's share; None when none is left."""
    while spares:
        length = spares.pop(0)
        run = fit(length, failed.share, long=failed.long) if failed.share else None
        if run is not None and all(run.dims != d.dims for d, _ in done):
            return run  # type: ignore[no-any-return]
    return None


def candidate_runs(
    opened: Any,
    specs: list[InputSpec],
    done: list[tuple[Run, list[Any]]],
    options: VerifyOptions,
    roles: Roles,
) -> Iterator[tuple[Run, list[Any], list[Any]]]:
    """Each run's reference and candidate outputs, one run at a time: the reference's are
    dropped from ``done`` as they are handed out, so each run's outputs can be freed before
    the next run.

    Raises:
        ModelRunError: onnxruntime cannot run the candidate.
        OutOfMemory: memory ran out.
    """
    for index in range(len(done)):
        run, reference = done[index]
        done[index] = (run, [])
        if isinstance(reference, Spilled):
            reference = reference.load()  # kept on disk (see verify.stream)
        outputs = run_at(opened, specs, run, options, "candidate", roles)
        yield run, reference, outputs
        del reference, outputs
        release_freed_memory()


def budget_text(options: VerifyOptions) -> str:
    return format_size(options.memory)


# pragma: no mutate end
