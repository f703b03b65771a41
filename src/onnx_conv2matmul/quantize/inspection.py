"""What ``convert`` would do to a model, and what MatMulNBits would then take: nothing is written.

The model is loaded as ``convert`` loads it (the ``.onnx`` parsed, external data checked but left
on disk), and the rewrite pass ``convert`` runs
(:class:`~onnx_conv2matmul.rewrite.passes.ConvToMatMulPass`) is applied to it in memory. The
report is that pass's own, so ``inspect`` and ``convert`` agree by construction, whatever node
types the pass handles. The model is never saved: the transposed weights, which are lazy, are
never made, and no weight byte is read.

A second graph built from the same parsed protobuf (its tensors shared, not copied) stays as the
input was. It gives what the rewritten graph no longer has: each node's attributes, the Transpose
cost of each converted convolution, and the weights MatMulNBits could take without the rewrite.

Coverage: the share of a model's float weight bytes that the result stores quantized, by the
kind of node that used the weight in the original model.

The kinds (:data:`KINDS`): ``MatMul`` (input B), ``Gemm`` (input B), ``pointwise Conv`` (a
kernel of 1 in every spatial dim), ``other Conv``, ``Gather`` (its data: an embedding table) and
``other``. A weight shared by several nodes counts once, by its first user. Weights in
``Constant`` nodes count like initializers. :func:`weight_kinds` reads the original model before
the rewrite; :func:`coverage` adds up, per kind, the weights of the MatMuls that became
MatMulNBits (a pointwise conv's or Gemm's through the MatMul the rewrite made of it, its
:class:`~onnx_conv2matmul.rewrite.report.ConvEntry` ``matmul``) and those the other-weights step
stored as int8.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs
from onnx_conv2matmul.errors import CheckerError, Hint, InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.quantize.projection import nbits_projection
from onnx_conv2matmul.quantize.report import InspectNode, InspectReport
from onnx_conv2matmul.quantize.settings import QuantizeOptions
from onnx_conv2matmul.rewrite.layout import added_transposes
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.passes import ConvToMatMulPass
from onnx_conv2matmul.rewrite.report import ConvEntry, ConvertReport, Status
from onnx_conv2matmul.rewrite.weights import constant_tensor

_Key = tuple[str, str, str]
_INTS = ir.AttributeType.INTS
_SHOWN = {
    "kernel_shape": _INTS,
    "strides": _INTS,
    "pads": _INTS,
    "dilations": _INTS,
    "group": ir.AttributeType.INT,
    "auto_pad": ir.AttributeType.STRING,
}


def inspect_file(
    path: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    quantize_options: QuantizeOptions | None = None,
    *,
    run_checker: bool = True,
) -> InspectReport:
    """What :func:`~onnx_conv2matmul.api.convert_file` with ``options`` would do to the model
    at ``path``, and what MatMulNBits with ``quantize_options`` would make of the result.

    Reads the ``.onnx`` file only (external data is checked for presence and size, as
    ``convert`` does, and never read); writes nothing.

    Raises:
        InputError: a missing, empty, truncated or non-ONNX file; missing or short external
            data; the ONNX checker rejected the input (with ``run_checker``).
    """
    options = options or ConvertOptions()
    quantize_options = quantize_options or QuantizeOptions()
    src = os.fspath(path)
    proto = _io.parse_model(src)
    loaded = _io.build_model(proto, src)
    before = ir.serde.deserialize_model(proto)  # shares the tensors of ``proto``: no copy
    del proto
    checker = "skipped"
    if run_checker and loaded.checker_applies:
        try:
            _io.run_checker(src, "the input")
        except CheckerError as err:
            raise InputError(str(err), hint=Hint.SKIP_INPUT_CHECKER) from err
        checker = "passed"
    report = inspect_model(loaded.model, before, options, quantize_options)
    report.input_path = src
    report.rewrite.input_path = src
    report.rewrite.input_bytes = loaded.total_bytes
    report.projection.model_bytes = loaded.total_bytes
    report.external_data = loaded.has_external_data
    report.checker = checker
    return report


def inspect_model(
    model: ir.Model,
    before: ir.Model,
    options: ConvertOptions,
    quantize_options: QuantizeOptions,
) -> InspectReport:
    """Run the rewrite pass on ``model`` in place and report it against ``before``, an
    unchanged copy of ``model``; nothing is saved.

    ``projection.model_bytes`` is left to the caller (the files' size); until it is set,
    it is the tensors' bytes.
    """
    from onnx_conv2matmul.quantize.projection import quantizable_matmuls

    kinds = weight_kinds(before)
    index = _nodes_by_key(before)
    rewrite = ConvToMatMulPass(options)
    rewrite(model)
    report: ConvertReport | None = rewrite.report
    assert report is not None
    found = [(entry, _take(index, entry)) for entry in report.entries]
    nodes = [_inspect_node(entry, node) for entry, node in found]
    _fill_transposes(nodes, [node for _, node in found])
    projection = nbits_projection(before, model, quantize_options)
    projection.model_bytes = projection.tensor_bytes
    takes = [node.name for _, node, _ in quantizable_matmuls(model) if node.name]
    could = coverage(kinds, report.entries, takes)
    return InspectReport(input_path="", rewrite=report, nodes=nodes, projection=projection, coverage=could)


def _nodes_by_key(model: ir.Model) -> dict[_Key, list[ir.Node]]:
    """Every node of every graph and local function, by (scope, name, op type), in the
    order the analysis visits them."""
    index: dict[_Key, list[ir.Node]] = defaultdict(list)
    for graph, scope in walk_graphs(model.graph):
        for node in graph:
            index[(scope, node.name or "", node.op_type)].append(node)
    for function in model.functions.values():
        scope = f"function {function.domain}::{function.name}"
        for node in function:
            index[(scope, node.name or "", node.op_type)].append(node)
    return index


def _take(index: dict[_Key, list[ir.Node]], entry: ConvEntry) -> ir.Node | None:
    """The node of ``before`` that ``entry`` reports (nodes sharing a key are taken in order)."""
    found = index.get((entry.scope, entry.name, entry.op_type))
    return found.pop(0) if found else None


def _inspect_node(entry: ConvEntry, node: ir.Node | None) -> InspectNode:
    if node is None:
        return InspectNode(entry)
    if entry.weight_shape is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        found = constant_tensor(node.inputs[1])
        if found is not None:
            tensor = found[0]
            entry.weight_shape = [int(d) for d in tensor.shape.numpy()]
            entry.weight_dtype = tensor.dtype.name
            entry.params = tensor.size
            entry.weight_bytes = int(tensor.nbytes)
    if "Conv" not in node.op_type:
        return InspectNode(entry)
    # An attribute of another type than Conv's (the node is skipped for it) is shown as absent.
    attributes = {k: a for k, a in node.attributes.items() if a.type == _SHOWN.get(k, a.type)}
    kernel = entry.weight_shape[2:] if entry.weight_shape and len(entry.weight_shape) > 2 else None
    if kernel is None and "kernel_shape" in attributes:
        kernel = list(attributes["kernel_shape"].as_ints())
    spatial = len(kernel) if kernel is not None else None

    def ints(name: str, default: int, count: int) -> list[int] | None:
        if name in attributes:
            return list(attributes[name].as_ints())
        return None if spatial is None else [default] * count

    return InspectNode(
        entry,
        kernel=kernel,
        group=attributes["group"].as_int() if "group" in attributes else 1,
        strides=ints("strides", 1, spatial or 0),
        pads=ints("pads", 0, 2 * (spatial or 0)),
        dilations=ints("dilations", 1, spatial or 0),
        auto_pad=attributes["auto_pad"].as_string() if "auto_pad" in attributes else "NOTSET",
    )


def _fill_transposes(items: list[InspectNode], nodes: list[ir.Node | None]) -> None:
    """Each converted convolution's Transpose cost, worked out on the unchanged graph by the
    rules the pass decided with (``_layout.added_transposes``)."""
    convs = [
        (item, node)
        for item, node in zip(items, nodes, strict=True)
        if node is not None and item.entry.status is Status.CONVERTED and item.kernel is not None
    ]
    converted = {id(node) for _, node in convs}
    for item, node in convs:
        assert item.kernel is not None
        item.transposes_added = added_transposes(node, len(item.kernel) + 2, converted)


KINDS = ("MatMul", "Gemm", "pointwise Conv", "other Conv", "Gather", "other")


@dataclasses.dataclass
class WeightKinds:
    """The original model's float weights by kind, and where each came from.

    Attributes:
        total: Float weight bytes per kind (every kind present, 0 where none).
        matmul_bytes: Per MatMul node name, the bytes of its constant input B.
        tensor_kind: Per weight name, its kind and bytes.
    """

    total: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    matmul_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    matmul_weight: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per MatMul node name, which weight it reads (an id shared by the MatMuls that share it)."""
    tensor_kind: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)


def _kind(node: ir.Node, index: int, tensor: ir.TensorProtocol) -> str:
    """The kind of weight input ``index`` of ``node``, ``tensor``."""
    op = node.op_type
    if op == "MatMul" and index == 1:
        return "MatMul"
    if op == "Gemm" and index == 1:
        return "Gemm"
    if op in ("Conv", "ConvInteger", "FusedConv") and index == 1:
        spatial = list(tensor.shape)[2:]
        pointwise = bool(spatial) and all(d == 1 for d in spatial)
        return "pointwise Conv" if pointwise else "other Conv"
    if op == "Gather" and index == 0:
        return "Gather"
    return "other"


def _constant(value: ir.Value) -> ir.TensorProtocol | None:
    """The float tensor behind ``value``: an initializer's, or a ``Constant`` node's."""
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
            attr = producer.attributes["value"]
            if attr.type == ir.AttributeType.TENSOR:
                tensor = attr.value
    if tensor is None or not tensor.dtype.is_floating_point():
        return None
    return tensor


def weight_kinds(model: ir.Model) -> WeightKinds:
    """The float weights of ``model`` (as loaded, before the rewrite) by kind."""
    kinds = WeightKinds()
    seen: set[int] = set()
    for graph, _ in walk_graphs(model.graph):
        for node in graph:
            for index, value in enumerate(node.inputs):
                if value is None or (value.is_graph_input() and not value.is_initializer()):
                    continue  # an input the caller feeds (an initializer listed as an input, as
                    # exports of IR version 3 do, is a weight)
                tensor = _constant(value)
                if tensor is None:
                    continue
                nbytes = int(tensor.nbytes)
                kind = _kind(node, index, tensor)
                if kind == "MatMul" and node.name:
                    kinds.matmul_bytes[node.name] = nbytes
                    kinds.matmul_weight[node.name] = id(tensor)
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                kinds.total[kind] += nbytes
                if value.name:
                    kinds.tensor_kind[value.name] = (kind, nbytes)
    return kinds


def coverage(
    kinds: WeightKinds,
    entries: Iterable[Any],
    quantized: Iterable[str],
    int8_tensors: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The report's ``coverage``: per kind the original float bytes, those stored quantized, and
    the share; ``total`` over every kind.

    Args:
        kinds: :func:`weight_kinds` of the original.
        entries: The rewrite's record (``ConvEntry``): which MatMul each converted node became.
        quantized: The names of the MatMuls that became MatMulNBits.
        int8_tensors: Weights the other-weights step stored as int8, by name (their bytes).
    """
    made: dict[str, tuple[str, int]] = {}
    for entry in entries:
        if getattr(entry, "matmul", None):
            kind = "Gemm" if entry.op_type == "Gemm" else "pointwise Conv"
            made[entry.matmul] = (kind, int(entry.weight_bytes))
    done = dict.fromkeys(KINDS, 0)
    counted: set[int] = set()  # a weight two quantized MatMuls share counts once
    for name in quantized:
        if name in made:
            kind, nbytes = made[name]
        elif name in kinds.matmul_bytes:
            weight = kinds.matmul_weight.get(name, id(name))
            if weight in counted:
                continue
            counted.add(weight)
            kind, nbytes = "MatMul", kinds.matmul_bytes[name]
        else:
            continue  # a MatMul of the tool's own making, or one without a name in the original
        done[kind] += nbytes
    for name in int8_tensors or {}:
        if name in kinds.tensor_kind:
            kind, nbytes = kinds.tensor_kind[name]
            done[kind] += nbytes
    rows: dict[str, Any] = {}
    for kind in KINDS:
        total = kinds.total[kind]
        if total:
            quantized_bytes = min(done[kind], total)
            rows[kind] = {
                "float_bytes": total,
                "quantized_bytes": quantized_bytes,
                "share": round(quantized_bytes / total, 4),
            }
    total = sum(kinds.total.values())
    quantized_total = sum(row["quantized_bytes"] for row in rows.values())
    return {
        "by_kind": rows,
        "total": {
            "float_bytes": total,
            "quantized_bytes": quantized_total,
            "share": round(quantized_total / total, 4) if total else 0.0,
        },
    }


def coverage_text(section: Mapping[str, Any]) -> str:
    """``87% of 10.4 MiB: MatMul 100% of 4.0 MiB, pointwise Conv 80% of 6.4 MiB``."""

    def size(count: int) -> str:
        return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.0f} KiB"

    total = section["total"]
    parts = [
        f"{kind} {row['share']:.0%} of {size(row['float_bytes'])}" for kind, row in section["by_kind"].items()
    ]
    head = f"{total['share']:.0%} of {size(total['float_bytes'])}"
    return f"{head}: {', '.join(parts)}" if parts else head
