"""Running the search's models (see :mod:`onnx_conv2matmul.quantize.search`): the search's target
(what one evaluation measured, whether it meets the options' minimum cosine and the user's score,
the loss the search steers by, the words for a target missed), the digest of a model's
computation, the fp32 model's first pass (its outputs as the reference, its MatMuls' inputs as
the activations), and each candidate built, saved and run against the reference."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import read_then_released
from onnx_conv2matmul.errors import ModelRunError, OutOfMemory, first_line
from onnx_conv2matmul.quantize.blockwise import BlockCache
from onnx_conv2matmul.quantize.metric import MetricTarget
from onnx_conv2matmul.quantize.reference import InputStats, Reference
from onnx_conv2matmul.quantize.search_options import AutoOptions
from onnx_conv2matmul.quantize.search_result import AutoConfig, apply
from onnx_conv2matmul.quantize.sensitivity import MatMulNode
from onnx_conv2matmul.verify.feeds import feed_bytes
from onnx_conv2matmul.verify.labels import TaskResult, agreement_floor, failed
from onnx_conv2matmul.verify.run import release_freed_memory, run_options, session_options


# --------------------------------------------------------------------------- #
# The target: what an evaluation measured and whether it meets the options
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class _Measured:
    """What one evaluation measured: see :class:`Evaluation`; ``cosines`` by feed index."""

    cosine: float | None = None
    score: float | None = None
    drop: float | None = None
    note: str = ""
    feeds_run: int = 0
    cosines: dict[int, float] = dataclasses.field(default_factory=dict)
    rows: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    """With the check's options (``_Target.check``): each feed's rows as the check compares them."""
    digest: str = ""
    """With the check's options: the candidate's :func:`model_digest`."""
    labels: dict[str, TaskResult] = dataclasses.field(default_factory=dict)
    """The labels of the outputs that hold class scores over the feeds run, by output."""


class _Target:
    """The options' target: whether a measurement meets it, and its loss (1 is the limit)."""

    def __init__(self, options: AutoOptions, original_score: float | None, check: Any = None) -> None:
        self.check = check  # the accuracy check's VerifyOptions: rows kept for it (None: not)
        self.min_cosine = options.min_cosine
        self.metric = options.metric
        self.original_score = original_score

    def labels(self, measured: _Measured) -> list[TaskResult]:
        """The labels of the outputs that hold class scores, judged as the check judges them."""
        floor = agreement_floor(self.min_cosine)
        if floor is None:
            return []
        return [dataclasses.replace(result, floor=floor) for result in measured.labels.values()]

    def cosine_passed(self, measured: _Measured) -> bool:
        return self.min_cosine is None or (measured.cosine is not None and measured.cosine >= self.min_cosine)

    def passed(self, measured: _Measured) -> bool:
        if not self.cosine_passed(measured) or failed(self.labels(measured)) is not None:
            return False
        if self.metric is not None:
            assert self.original_score is not None
            return measured.score is not None and self.metric.meets(self.original_score, measured.score)
        return True

    def loss(self, measured: _Measured) -> float:
        """The largest of the measured losses, each over its limit: 1 - cosine over 1 - the
        minimum, the drop over the largest drop (an infinite loss where the limit is 0)."""
        losses = [0.0, *(result.loss for result in self.labels(measured))]
        if self.min_cosine is not None and measured.cosine is not None:
            losses.append(_over(1.0 - measured.cosine, 1.0 - self.min_cosine))
        if self.metric is not None and measured.drop is not None:
            losses.append(_over(max(0.0, measured.drop), self.metric.max_drop))
        return max(losses)

    def describe(self) -> str:
        parts = []
        if self.min_cosine is not None:
            parts.append(f"a minimum cosine similarity of {self.min_cosine:g}")
        if self.metric is not None:
            parts.append(f"a drop of the score of {self.metric.label} of at most {self.metric.max_drop_text}")
        return " and ".join(parts)


def _over(loss: float, limit: float) -> float:
    if limit > 0:
        return loss / limit
    return 0.0 if loss <= 0 else math.inf


def _unreachable(target: _Target, measured: _Measured, feeds: int) -> str:
    """Why even the all-float model fails the target."""
    found = []
    if target.min_cosine is not None and measured.cosine is not None and measured.cosine < target.min_cosine:
        found.append(f"worst cosine {below(measured.cosine, target.min_cosine)} over {feeds} input(s)")
    if target.metric is not None and measured.score is not None:
        found.append(f"score {measured.score:.6g} against the original's {target.original_score:.6g}")
    moved = failed(target.labels(measured))
    if moved is not None:
        found.append(moved.text())
    if measured.note:
        found.append(measured.note)
    return f"{target.describe()} is not met even with every weight in float ({'; '.join(found)})"


def below(value: float, target: float) -> str:
    """``value`` with enough digits to show that it is below ``target`` (0.9999999, not 1)."""
    for digits in range(6, 18):
        text = f"{value:.{digits}g}"
        if float(text) < target:
            return text
    return repr(value)


# --------------------------------------------------------------------------- #
# A model's digest: what it computes with, not where its tensors are stored. Two models with the
# same digest give the same outputs in the same session: the search's evaluation of a
# configuration stands for the accuracy check of the same model written elsewhere (see
# :meth:`onnx_conv2matmul.quantize.reference.Reference.check`).
# --------------------------------------------------------------------------- #
def model_digest(model: ir.Model) -> str:
    """The hex digest of ``model``'s computation (see the comment above)."""
    h = hashlib.blake2b(digest_size=20)
    _graph(h, model.graph)
    return h.hexdigest()


def _graph(h: Any, graph: ir.Graph) -> None:
    h.update(repr([(v.name, str(v.dtype), str(v.shape)) for v in graph.inputs]).encode())
    h.update(repr([v.name for v in graph.outputs]).encode())
    for name in sorted(graph.initializers):
        _tensor(h, name, graph.initializers[name].const_value)
    for node in graph:
        h.update(
            repr(
                (
                    node.op_type,
                    node.domain,
                    node.name,
                    [None if v is None else v.name for v in node.inputs],
                    [v.name for v in node.outputs],
                )
            ).encode()
        )
        for key in sorted(node.attributes):
            attribute = node.attributes[key]
            value = attribute.value
            if isinstance(value, ir.Graph):
                h.update(key.encode())
                _graph(h, value)
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], ir.Graph):
                for sub in value:
                    h.update(key.encode())
                    _graph(h, sub)
            elif hasattr(value, "tobytes"):
                _tensor(h, key, value)
            else:
                h.update(repr((key, value)).encode())


def _tensor(h: Any, name: str, tensor: Any) -> None:
    if tensor is None:
        h.update(f"{name}: no value".encode())
        return
    h.update(repr((name, str(tensor.dtype), str(tensor.shape))).encode())
    with read_then_released(tensor):
        h.update(tensor.tobytes())


@dataclasses.dataclass
class Prepared:
    """The rewritten fp32 model saved in the search's folder (``path``), and the same model
    with the input of every quantizable MatMul (``nodes``) added as an output (``added``, after
    ``output_names``) in ``activations_path``, beside it, reading the same data file.

    Everything the search and the output read of the fp32 model comes from these files,
    memory-mapped: the caller can let its own model go once it is saved.
    """

    path: str
    activations_path: str
    nodes: list[MatMulNode]
    output_names: list[str]
    added: list[str]

    def load(self) -> ir.Model:
        """The fp32 model as it was given, its weights memory-mapped."""
        return ir.load(self.path)


# --------------------------------------------------------------------------- #


def _session(path: str, deterministic: bool) -> Any:
    import onnxruntime as ort

    release_freed_memory()  # the previous candidate's weights, before this one's load
    return ort.InferenceSession(path, session_options(deterministic), providers=["CPUExecutionProvider"])


def _run(session: Any, feed: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> list[Any]:
    """One run; memory exhaustion is :class:`OutOfMemory`, whatever onnxruntime called it."""
    from onnx_conv2matmul.errors import Hint, OutOfMemory, is_out_of_memory

    try:
        outputs: list[Any] = session.run(None if names is None else list(names), dict(feed), run_options())
    except Exception as err:
        if is_out_of_memory(err):
            first = first_line(err)
            raise OutOfMemory(
                f"out of memory running a model of the search: {first}", hint=Hint.VERIFY_OUT_OF_MEMORY
            ) from err
        raise
    return outputs


def _add_outputs(model: ir.Model, names: Sequence[str]) -> list[str]:
    """Add the named main-graph values as graph outputs (those not outputs yet); their names."""
    by_name: dict[str, ir.Value] = {v.name: v for v in model.graph.inputs if v.name}
    for node in model.graph:
        for value in node.outputs:
            if value.name:
                by_name[value.name] = value
    present = {v.name for v in model.graph.outputs}
    added = []
    for name in names:
        found = by_name.get(name)
        if found is not None and name not in present:
            model.graph.outputs.append(found)
            added.append(name)
    return added


class ChannelEnergy:
    """Per value, the mean square of each channel (the last axis) of its arrays, summed as they
    arrive: the activation statistic the error model weighs a MatMul's weight error by."""

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}
        self._rows: dict[str, int] = {}

    def add(self, name: str, array: Any) -> None:
        a = np.asarray(array)
        matrix = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
        self._sums[name] = self._sums.get(name, 0.0) + np.einsum("ij,ij->j", matrix, matrix, dtype=np.float64)
        self._rows[name] = self._rows.get(name, 0) + matrix.shape[0]

    def means(self) -> dict[str, np.ndarray]:
        return {name: total / max(self._rows[name], 1) for name, total in self._sums.items()}


ACTIVATION_BYTES = 128 * 2**20
"""The most bytes of MatMul inputs the first pass of the search takes from one feed after the
first (see :func:`_reference`)."""


def _reference(
    prepared: Prepared, reference: Reference, deterministic: bool, memory: int | None = None
) -> None:
    """Run the fp32 model on every feed: its outputs into ``reference``, and per quantizable
    MatMul the mean square of each channel of its input (summed as the feeds arrive).

    The first feed gives every MatMul's input; a later one gives them too unless they would
    take more than :data:`ACTIVATION_BYTES` or half of ``memory`` (in proportion to its input
    bytes). The feeds that give them run first, with the model whose outputs include them;
    the others then run with the plain model, for their outputs only (onnxruntime would keep
    every graph output of a long run alive). The statistics are means over many rows, which
    short runs give as well as long ones.
    """
    feeds = reference.feeds.feeds
    names = reference.names
    limit = ACTIVATION_BYTES if memory is None else min(ACTIVATION_BYTES, memory / 2)
    energy = ChannelEnergy()

    def run(session: Any, index: int) -> list[Any]:
        feed = feeds[index]
        try:
            return _run(session, feed)
        except OutOfMemory:
            raise
        except Exception as err:  # onnxruntime's own errors: this run cannot be made
            shapes = ", ".join(f"{k}{list(np.asarray(v).shape)}" for k, v in feed.items())
            first = first_line(err)
            raise ModelRunError(
                f"onnxruntime cannot run the original model at length {reference.feeds.lengths[index]}"
                f" ({shapes}): {first}"
            ) from err

    def input_bytes(index: int) -> int:
        return feed_bytes(feeds[index])

    measured = [0]
    session = _session(prepared.activations_path, deterministic)
    outputs = run(session, 0)
    per_input_byte = sum(int(np.asarray(a).nbytes) for a in outputs[len(names) :]) / max(1, input_bytes(0))
    measured += [i for i in range(1, len(feeds)) if per_input_byte * input_bytes(i) <= limit]
    for index in measured:
        if index:
            outputs = run(session, index)
        reference.put(index, outputs[: len(names)])
        for name, array in zip(prepared.added, outputs[len(names) :], strict=True):
            energy.add(name, array)
            reference.statistics.setdefault(name, InputStats()).add(np.asarray(array))
        del outputs
    del session
    rest = [i for i in range(len(feeds)) if i not in measured]
    if rest:
        session = _session(prepared.path, deterministic)
        for index in rest:
            reference.put(index, run(session, index))
        del session
    release_freed_memory()
    reference.activations = energy.means()


def _candidate(
    fp32_path: str, config: AutoConfig | None, workdir: str, cache: BlockCache | None = None
) -> str:
    """Build ``config`` (None: the fp32 model as it is) from the fp32 copy and save it; its path."""
    return _built(fp32_path, config, workdir, cache)[0]


def _built(
    fp32_path: str, config: AutoConfig | None, workdir: str, cache: BlockCache | None, digest: bool = False
) -> tuple[str, str]:
    """:func:`_candidate`, and with ``digest`` the built model's digest (else empty)."""
    from onnx_conv2matmul.files import output as _output

    model = ir.load(fp32_path)
    if config is not None:
        apply(model, config, cache)
    found = model_digest(model) if digest else ""
    path = os.path.join(workdir, "candidate.onnx")
    _output.save(model, path, "candidate.onnx.data")
    return path, found


def _remove_candidate(path: str) -> None:
    for leftover in (path, path + ".data"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)


def _score_float(fp32_path: str, workdir: str, metric: MetricTarget) -> float:
    """The user's score of the fp32 model as the search saved it."""
    path = _candidate(fp32_path, None, workdir)
    try:
        return metric.score(path, "the fp32 model")
    finally:
        _remove_candidate(path)


def _evaluate(
    fp32_path: str,
    config: AutoConfig,
    reference: Reference,
    order: Sequence[int],
    workdir: str,
    deterministic: bool,
    target: _Target,
    cache: BlockCache | None = None,
) -> _Measured:
    """Build ``config`` (with the weights ``cache`` holds), save it, run the feeds in ``order``
    against the reference until one falls below the minimum cosine, then take the user's score
    if the cosine held."""
    measured = _Measured()
    path, measured.digest = _built(fp32_path, config, workdir, cache, digest=target.check is not None)
    indices = list(target.check.output_indices or ()) or None if target.check is not None else None
    try:
        if target.min_cosine is not None:
            try:
                session = _session(path, deterministic)
                worst = 1.0
                for index in order:
                    outputs = _run(session, reference.feeds.feeds[index])  # compared as it arrives
                    cosine, note = reference.worst_cosine(index, outputs, measured.labels)
                    if target.check is not None:  # the rows the accuracy check would give
                        measured.rows[index] = reference.compare(index, outputs, target.check, indices)
                    del outputs
                    measured.feeds_run += 1
                    measured.cosines[index] = cosine
                    worst = min(worst, cosine)
                    if note or cosine < target.min_cosine:
                        measured.note = note
                        break
                measured.cosine = worst
                del session
            except OutOfMemory:
                raise
            except Exception as err:  # a candidate that does not run fails; the search goes on
                first = first_line(err)
                measured.cosine, measured.note = -1.0, f"onnxruntime cannot run it: {first}"
            release_freed_memory()
        if target.metric is not None and target.cosine_passed(measured):
            assert target.original_score is not None
            measured.score = target.metric.score(path, "a candidate model")
            measured.drop = target.metric.drop(target.original_score, measured.score)
    finally:
        _remove_candidate(path)
    return measured
