"""The quantize workflow's int8 dynamic step (``--int8-dynamic``): refuse a model onnxruntime's
``quantize_dynamic`` cannot take, then quantize the rewritten model with it as is into a staged
output, keeping the input's model fields."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import count_op, walk_graphs
from onnx_conv2matmul.errors import Hint, InputError
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files.paths import folder_bytes

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.plan import Run
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
    criterion to meet, the first candidate of :class:`~onnx_conv2matmul.quantize.int8_choice.Int8Pass`
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
            from onnx_conv2matmul.quantize.int8_choice import Int8Pass

            scratch = os.path.join(directory, "candidates")
            chooser = Int8Pass(run, model, scratch, make, dynamic_op_types())
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
