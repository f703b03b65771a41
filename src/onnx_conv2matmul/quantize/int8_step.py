"""The quantize workflow's int8 dynamic step (``--int8-dynamic``): refuse a model onnxruntime's
``quantize_dynamic`` cannot take, then quantize the rewritten model with it as is into a staged
output, keeping the input's model fields.

``--int8-dynamic`` is one pass: the original measured once, int8 candidates made with
onnxruntime's ``quantize_dynamic`` and checked against it, and the first that meets the criterion
kept.

1. Every node onnxruntime takes, weights per channel (one scale per output channel). On three
   trained models where per-tensor scales missed the 0.99 floor, per channel met it: ddddocr's
   OCR (an LSTM and a MatMul) 0.975 -> 0.9998, FSMN VAD 0.988 -> 0.994, openWakeWord's "hey
   jarvis"; for 1-2% more bytes (the scales).
2. Should that miss, every node with per-tensor scales (g2p-id's bidirectional LSTM measured
   0.978 per tensor and 0.874 per channel).
3. Should both miss, a step back by measured error: the nodes quantized (at most
   :data:`MAX_UNITS` groups of them, consecutive in the graph) are each made int8 alone and
   checked, and those whose losses add up to at most :data:`KEEP_SHARE` of the criterion's limit
   are made int8 together, the least costly first; a miss leaves the costliest of them in float
   too, at most :data:`MAX_TRIES` times.

When no node can be int8 within the criterion, the run refuses (exit 2) and says why: int8
dynamic quantization does not take that model, MatMulNBits may.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import count_op, walk_graphs
from onnx_conv2matmul.errors import Hint, InputError, ModeRefused, first_line
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files.paths import folder_bytes

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.check import Checked
    from onnx_conv2matmul.quantize.plan import Run
    from onnx_conv2matmul.quantize.reference import Reference
    from onnx_conv2matmul.quantize.settings import QuantizeOptions


# Float types onnxruntime's quantize_dynamic cannot take: it inserts DynamicQuantizeLinear,
# which reads float32 only, and writes a model that does not load.
_NOT_INT8_DYNAMIC = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def int8_dynamic_obstacle(model: ir.Model) -> str | None:
    """Why ``quantize_dynamic`` cannot take ``model``, or ``None``.

    Names the first graph input, output or tensor (initializer or node attribute, in any
    scope) of a 16-bit float type.
    """
    from onnx_conv2matmul._graphs import tensor_holders

    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.dtype in _NOT_INT8_DYNAMIC:
            return f"graph input or output {value.name!r} is {value.dtype.name.lower()}"
    for holder in tensor_holders(model):
        tensor = holder.get()
        if tensor.dtype in _NOT_INT8_DYNAMIC:
            return f"tensor {tensor.name!r} is {tensor.dtype.name.lower()}"
    return None


@dataclasses.dataclass(frozen=True)
class Int8Way:
    """How :func:`int8_dynamic` writes: external data or not, one scale per output channel of each
    weight (else one per tensor), and the only nodes quantized (None: every node the options select)."""

    external_data: bool
    per_channel: bool = True
    nodes: Sequence[str] | None = None


def int8_dynamic(
    model: ir.Model, input_path: str, output_path: str, options: QuantizeOptions, way: Int8Way
) -> None:
    """onnxruntime's ``quantize_dynamic`` with int8 weights (for a decoder/joint).

    ``options.exclude`` / ``options.include`` select nodes by name, as for MatMulNBits;
    ``way`` says which of them (see :class:`Int8Way`).

    Every op type ``quantize_dynamic`` takes but ``Conv`` (:func:`dynamic_op_types`): the convs
    left after the rewrite are not pointwise (depthwise, 3x3), and onnxruntime's ConvInteger ran
    them 4x slower than fp32 on a 2-core AVX2 EPYC and cost PP-OCRv4 rec its floor (cosine 0.9895
    with them, 0.9998 without; the pointwise convs, MatMuls now, are quantized either way).

    The weights use 7 of their 8 bits (``reduce_range``). onnxruntime runs such a model with
    uint8 activations times int8 weights; on x86 CPUs without VNNI (AVX2, AVX-512 without VNNI)
    that kernel adds pairs of products in 16 bits, which saturate with full-range weights: a
    Parakeet-shaped decoder/joint then falls from cosine 0.9999 to 0.98 and transcribes garbage.
    The model is run on CPUs other than the one that made it, so it is made safe for all of them.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    names = [n.name for g, _ in walk_graphs(model.graph) for n in g if n.name]
    excluded = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in options.exclude)]
    included = [n for n in names if options.include and options.selects(n)]
    if way.nodes is not None:
        included = list(way.nodes)
    from onnx_conv2matmul.quantize.weight_only import onnxruntime_logs_captured

    # onnxruntime warns on the root logger that pre-processing may help: into this package's logger.
    with onnxruntime_logs_captured():
        quantize_dynamic(
            input_path,
            output_path,
            weight_type=QuantType.QInt8,
            reduce_range=True,
            per_channel=way.per_channel,
            op_types_to_quantize=dynamic_op_types(),
            nodes_to_exclude=excluded,
            nodes_to_quantize=included or None,
            use_external_data_format=way.external_data,
        )


def dynamic_op_types() -> list[str]:
    """The op types ``--int8-dynamic`` quantizes: onnxruntime's dynamic ones but ``Conv``."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    return sorted(op for op in IntegerOpsRegistry if op != "Conv")


def check_int8_dynamic(model: ir.Model) -> None:
    """Refuse, before the rewrite, a model ``quantize_dynamic`` would turn into one that does not load."""
    obstacle = int8_dynamic_obstacle(model)
    if obstacle is not None:
        raise InputError(
            f"int8 dynamic quantization needs a float32 model: {obstacle}"
            " (onnxruntime's quantize_dynamic takes float32 only)",
            hint=Hint.NOT_INT8_DYNAMIC,
        )


def int8_staged(run: Run, model: ir.Model, external: bool) -> _output.Staged:
    """Save the rewritten fp32 model aside, run ``quantize_dynamic`` into a staged output: with a
    criterion to meet, the first candidate of :class:`Int8Pass`
    that meets it (its check's rows are the result's, ``run.checked``), else every node per channel.

    onnxruntime names the data file after the ``.onnx`` it writes, so the staged
    ``.onnx`` is named for the data file to get the destination's data-file name.
    """

    plan, output, report = run.plan, run.output, run.report
    progress = plan.progress
    name = output.data_name.removesuffix(".data") if external else os.path.basename(output.path)

    def write(directory: str) -> str:
        progress.phase("Saving the rewritten model")
        fp32_dir = os.path.join(directory, "fp32")
        os.mkdir(fp32_dir)
        fp32_path = os.path.join(fp32_dir, "model.onnx")
        _output.save(model, fp32_path, "model.onnx.data" if external else None)

        def make(folder: str, per_channel: bool, nodes: Sequence[str] | None) -> str:
            path = os.path.join(folder, name)
            int8_dynamic(model, fp32_path, path, run.quantize, Int8Way(external, per_channel, nodes))
            restore_model_fields(path, model)
            return path

        out = os.path.join(directory, name)
        if plan.verify.min_cosine is not None and not plan.verify.report_only:
            scratch = os.path.join(directory, "candidates")
            chooser = Int8Pass(run, model, scratch, make)
            try:
                chosen = chooser.choose()
            finally:
                report.one_pass = {
                    "candidates": chooser.candidates,
                    "decision": chooser.decision,
                    "classes": None,
                }
                report.bytes_written = folder_bytes(fp32_dir) + chooser.written
            os.replace(chosen.path, out)
            if os.path.exists(chosen.path + ".data"):
                os.replace(chosen.path + ".data", out + ".data")
            run.checked = (chosen.reference, chosen.checked.flat_rows())
            shutil.rmtree(scratch)
        else:
            progress.phase("Quantizing (int8 dynamic)")
            make(directory, True, None)
            report.bytes_written = folder_bytes(directory)
        shutil.rmtree(fp32_dir)
        quantized = ir.load(out)
        report.matmuls = count_op(model, "MatMul")
        report.quantized_nodes = sum(
            count_op(quantized, op) for op in ("MatMulInteger", "DynamicQuantizeLSTM", "ConvInteger")
        )
        if not report.quantized_nodes:
            report.warnings.append(nothing_int8_text(report.weight_kinds))
        return out

    return output.stage_with(write)


def nothing_int8_text(kinds: Any) -> str:
    """Why an ``--int8-dynamic`` result holds no int8 node, from the original's weights by kind."""
    total = sum(kinds.total.values()) if kinds is not None else 0
    where = ""
    if total:
        kind, size = max(kinds.total.items(), key=lambda item: item[1])
        where = f"; {size / total:.0%} of its float weights are in {kind} nodes"
    takes = ", ".join(op for op in dynamic_op_types() if op != "Transpose")
    return (
        f"no node was quantized: int8 dynamic quantization takes the weights of {takes} nodes (a Gemm"
        f" as the MatMul the rewrite makes of it; not Conv), and found none it could take{where}; the"
        " output is the input with the rewrite's exact changes only"
    )


def restore_model_fields(path: str, model: ir.Model) -> None:
    """Give the model at ``path`` the producer, doc string and metadata of ``model``, and its
    nodes an order in which each comes after what it reads.

    ``quantize_dynamic`` names itself the producer and adds its own metadata entry;
    loaders such as sherpa-onnx read their settings from the input's metadata. It can also
    leave an ``If`` before the node whose output one of its branches reads (silero VAD 6.2.3's
    ``silero_vad_16k_op15.onnx``), which the checker and onnxruntime refuse: the graph and its
    subgraphs are sorted again. Only the ``.onnx`` file is rewritten: its external data stays
    where it is.
    """
    import onnx

    sorted_model = ir.serde.deserialize_model(onnx.load(path, load_external_data=False))
    sorted_model.graph.sort()
    proto = ir.serde.serialize_model(sorted_model)
    del sorted_model
    proto.producer_name = model.producer_name or ""
    proto.producer_version = model.producer_version or ""
    proto.doc_string = model.doc_string or ""
    del proto.metadata_props[:]
    for key, value in model.metadata_props.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save_model(proto, path)


MAX_UNITS = 8
"""The step back measures at most this many groups of nodes, each made int8 alone."""
KEEP_SHARE = 0.8
"""The step back keeps the nodes whose measured losses add up to at most this share of the limit."""
MAX_TRIES = 3
"""Candidates the step back makes before it gives up."""

CHECKED_BEFORE = (
    "the result's outputs are those of its check when it was made (the same file): it was not run again"
)
"""The accuracy check's warning: the rows of the candidate's check stand for the result's."""

Make = Callable[[str, bool, Sequence[str] | None], str]
"""Quantize the rewritten model into a folder: ``(folder, per_channel, nodes or None: all)``, the
path of the ``.onnx`` written."""


@dataclasses.dataclass
class Chosen:
    """A candidate made: its path, its check, and the reference it was checked against."""

    path: str
    checked: Checked
    reference: Reference


def quantized_nodes(fp32: ir.Model, quantized_path: str, op_types: Sequence[str]) -> list[str]:
    """The names of the nodes of ``fp32`` that ``quantize_dynamic`` replaced in the model at
    ``quantized_path``, in graph order (every scope)."""
    import onnx

    proto = onnx.load(quantized_path, load_external_data=False)
    left = {n.name for g, _ in walk_graphs(ir.serde.deserialize_model(proto).graph) for n in g}
    wanted = set(op_types)
    return [
        n.name
        for g, _ in walk_graphs(fp32.graph)
        for n in g
        if n.op_type in wanted and n.name and n.name not in left
    ]


def groups_of(names: Sequence[str], count: int = MAX_UNITS) -> list[list[str]]:
    """``names`` in at most ``count`` groups of consecutive names, as even as can be."""
    size, extra = divmod(len(names), count)
    groups, start = [], 0
    for index in range(min(count, len(names))):
        end = start + size + (1 if index < extra else 0)
        groups.append(list(names[start:end]))
        start = end
    return groups


class Int8Pass:
    """One ``--int8-dynamic`` run's candidates against the original measured once."""

    def __init__(self, run: Run, fp32: ir.Model, folder: str, make: Make) -> None:
        self.run, self.fp32, self.folder, self.make = run, fp32, folder, make
        self.op_types = dynamic_op_types()
        self.floor = run.plan.verify.min_cosine
        self.candidates: list[dict[str, Any]] = []
        self.decision: dict[str, Any] | None = None
        self.reference: Reference | None = None
        self.names: list[str] = []
        """The nodes the first candidate quantized (every node ``quantize_dynamic`` takes)."""
        self.written = 0
        """Bytes written: the reference's files and every candidate made (those removed too)."""

    def choose(self) -> Chosen:
        """The first candidate that meets the criterion (see the module's documentation).

        Raises:
            ModeRefused: no node can be int8 within the criterion.
        """
        from onnx_conv2matmul.quantize import measure as _measure

        plan = self.run.plan
        plan.progress.phase("Measuring the original")
        folder = self._folder("reference")
        self.reference = _measure.measure(plan, folder, None, plan.progress.phase).reference
        self.written += folder_bytes(folder)
        plan.progress.phase("Quantizing (int8 dynamic, per channel)")
        first = self._candidate("int8 per channel", True, None)
        if first.checked.passed:
            return first
        plan.progress.phase("Quantizing (int8 dynamic, per tensor)")
        second = self._candidate("int8 per tensor", False, None)
        if second.checked.passed:
            return second
        per_channel = first.checked.loss(self._floor()) <= second.checked.loss(self._floor())
        return self._step_back(self.names, per_channel, (first.checked, second.checked))

    def _floor(self) -> float:
        assert self.floor is not None
        return self.floor

    def _folder(self, name: str) -> str:
        path = os.path.join(self.folder, name)
        os.makedirs(path, exist_ok=True)
        return path

    def _candidate(self, label: str, per_channel: bool, nodes: Sequence[str] | None) -> Chosen:
        from onnx_conv2matmul.quantize.check import check
        from onnx_conv2matmul.quantize.measure import session_options

        assert self.reference is not None
        folder = self._folder(f"candidate-{len(self.candidates)}")
        path = self.make(folder, per_channel, nodes)
        self.written += folder_bytes(folder)
        if nodes is None and not self.names:
            self.names = quantized_nodes(self.fp32, path, self.op_types)
        import onnxruntime as ort

        try:
            session = ort.InferenceSession(
                path, session_options(self.run.plan.verify), providers=["CPUExecutionProvider"]
            )
        except Exception as err:  # a candidate that does not load fails, and says why
            from onnx_conv2matmul.quantize.check import Checked

            text = first_line(err)
            checked = Checked(
                [],
                passed=False,
                worst_cosine=None,
                failure=f"onnxruntime cannot load it: {text}",
                seconds=0.0,
            )
        else:
            try:
                checked = check(session, self.reference, self.run.plan.verify)
            finally:
                del session
        count = len(nodes) if nodes is not None else len(self.names)
        self.candidates.append(
            {
                "candidate": label,
                "settings": {"int8 per channel" if per_channel else "int8 per tensor": count},
                "worst_cosine": checked.worst_cosine,
                "labels": [t.to_dict() for t in checked.labels],
                "passed": checked.passed,
                "seconds": round(checked.seconds, 3),
            }
        )
        if not checked.passed:
            shutil.rmtree(folder, ignore_errors=True)
        return Chosen(path, checked, self.reference)

    def _step_back(self, names: list[str], per_channel: bool, whole: tuple[Checked, Checked]) -> Chosen:
        floor = self._floor()
        mode = "per channel" if per_channel else "per tensor"
        if len(names) < 2:
            self._refuse(names, whole, "")
        groups = groups_of(names)
        progress = self.run.plan.progress
        losses = []
        for index, group in enumerate(groups):
            progress.phase(f"Measuring each node's loss ({index + 1} of {len(groups)})")
            alone = self._candidate(f"int8 {mode}: {_group_text(group)} alone", per_channel, group)
            losses.append(alone.checked.loss(floor))
        kept: list[int] = []
        total = 0.0
        for index in sorted(range(len(groups)), key=lambda i: losses[i]):
            if total + losses[index] <= KEEP_SHARE:
                kept.append(index)
                total += losses[index]
        self.decision = {
            "mode": mode,
            "measured": [
                {"nodes": group, "loss": _rounded(loss)} for group, loss in zip(groups, losses, strict=True)
            ],
            "keep_share": KEEP_SHARE,
            "kept": [],
        }
        for _ in range(MAX_TRIES):
            if not kept:
                break
            nodes = [name for index in sorted(kept) for name in groups[index]]
            progress.phase(f"Quantizing (int8 dynamic, {len(nodes)} of {len(names)} nodes)")
            chosen = self._candidate(f"int8 {mode}, {len(nodes)} of {len(names)} nodes", per_channel, nodes)
            if chosen.checked.passed:
                self.decision["kept"] = nodes
                return chosen
            kept.remove(max(kept, key=lambda i: losses[i]))
        self._refuse(
            names,
            whole,
            f"; no set of them met it: each group alone cost {_losses_text(losses)} of the limit",
        )
        raise AssertionError("unreachable")

    def _refuse(self, names: Sequence[str], whole: tuple[Checked, Checked], more: str) -> None:
        def text(checked: Checked) -> str:
            if checked.worst_cosine is not None and not checked.labels:
                return f"worst cosine {checked.worst_cosine:.4f}"
            return checked.failure or "below it"

        if not names:
            which = "no node quantized (the rewrite alone)"
        elif len(names) == 1:
            which = f"its one quantizable node ({names[0]})"
        else:
            which = f"its {len(names)} quantizable nodes"
        raise ModeRefused(
            f"int8 dynamic quantization misses the accuracy criterion on this model with {which}:"
            f" {text(whole[0])} per channel, {text(whole[1])} per tensor{more}",
            hint=Hint.NOT_INT8_DYNAMIC,
        )


def _group_text(group: Sequence[str]) -> str:
    return group[0] if len(group) == 1 else f"{group[0]} and {len(group) - 1} after it"


def _rounded(loss: float) -> float | None:
    return None if loss == float("inf") else round(loss, 4)


def _losses_text(losses: Sequence[float]) -> str:
    return ", ".join("unmeasured" if loss == float("inf") else f"{loss:.2f}" for loss in sorted(losses))
