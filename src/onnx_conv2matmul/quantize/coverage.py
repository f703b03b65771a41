"""Coverage: the share of a model's float weight bytes that the result stores quantized, by the
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
from collections.abc import Iterable, Mapping
from typing import Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs

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
