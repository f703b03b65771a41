"""The quantize workflow's int8 dynamic step (``--int8-dynamic``): refuse a model onnxruntime's
``quantize_dynamic`` cannot take, then quantize the rewritten model with it as is into a staged
output, keeping the input's model fields."""

from __future__ import annotations

import fnmatch
import os
import shutil
from typing import TYPE_CHECKING

import onnx_ir as ir

from onnx_conv2matmul._graphs import count_op, walk_graphs
from onnx_conv2matmul.errors import Hint, InputError
from onnx_conv2matmul.files import output as _output

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


def int8_dynamic(
    model: ir.Model, input_path: str, output_path: str, options: QuantizeOptions, *, external_data: bool
) -> None:
    """onnxruntime's ``quantize_dynamic`` with int8 weights (for a decoder/joint).

    ``options.exclude`` / ``options.include`` select nodes by name, as for MatMulNBits.

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
    from onnx_conv2matmul.quantize.logs import onnxruntime_logs_captured

    # onnxruntime warns on the root logger that pre-processing may help: into this package's logger.
    with onnxruntime_logs_captured():
        quantize_dynamic(
            input_path,
            output_path,
            weight_type=QuantType.QInt8,
            reduce_range=True,
            op_types_to_quantize=dynamic_op_types(),
            nodes_to_exclude=excluded,
            nodes_to_quantize=included or None,
            use_external_data_format=external_data,
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
    """Save the rewritten fp32 model aside, run ``quantize_dynamic`` into a staged output.

    onnxruntime names the data file after the ``.onnx`` it writes, so the staged
    ``.onnx`` is named for the data file to get the destination's data-file name.
    """

    progress, output, report = run.plan.progress, run.output, run.report

    def write(directory: str) -> str:
        progress.phase("Saving the rewritten model")
        fp32_dir = os.path.join(directory, "fp32")
        os.mkdir(fp32_dir)
        fp32_path = os.path.join(fp32_dir, "model.onnx")
        _output.save(model, fp32_path, "model.onnx.data" if external else None)
        progress.phase("Quantizing (int8 dynamic)")
        name = output.data_name.removesuffix(".data") if external else os.path.basename(output.path)
        out = os.path.join(directory, name)
        int8_dynamic(model, fp32_path, out, run.quantize, external_data=external)
        shutil.rmtree(fp32_dir)
        restore_model_fields(out, model)
        quantized = ir.load(out)
        report.matmuls = count_op(model, "MatMul")
        report.quantized_nodes = sum(
            count_op(quantized, op) for op in ("MatMulInteger", "DynamicQuantizeLSTM", "ConvInteger")
        )
        return out

    return output.stage_with(write)


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
