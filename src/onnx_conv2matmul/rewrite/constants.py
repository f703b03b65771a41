"""Weights held in ``Constant`` nodes, lifted into initializers before the rewrite's analysis.

Some exporters (Paddle2ONNX among them) store every weight in a ``Constant`` node instead of
an initializer. onnxruntime's quantizers take only initializers: ``MatMulNBitsQuantizer`` leaves
such a MatMul in float, and ``quantize_dynamic`` stops with "Expected ... to be an
initializer". A ``Constant`` node and an initializer compute the same tensor, so moving the
tensor is exact; this module does it for the float tensors of two or more dimensions that a
weight input reads, in every graph, subgraphs included, and leaves every other ``Constant``
(shapes, axes, scalars, a graph output) as it is.

Which inputs count: the rewrite alone lifts what a MatMul's input B reads
(:data:`MATMUL_WEIGHTS`: the MatMuls it leaves for the quantizer), so a conv or Gemm it skips
keeps its model byte for byte; every quantization lifts every weight input
(:data:`WEIGHT_INPUTS`: ``quantize_dynamic`` and ``--other-weights`` read convs' weights too).
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs
from onnx_conv2matmul.rewrite.weights import constant_tensor

WEIGHT_INPUTS: dict[str, tuple[int, ...]] = {
    "MatMul": (1,),
    "Gemm": (1,),
    "Conv": (1,),
    "ConvTranspose": (1,),
}
"""The inputs, by default-domain op type, that hold a weight: what every quantization lifts."""

MATMUL_WEIGHTS: dict[str, tuple[int, ...]] = {"MatMul": (1,)}
"""MatMul's input B: what the rewrite alone lifts."""

_DEFAULT_DOMAINS = ("", "ai.onnx")


def _weight_tensor(node: ir.Node, readers: Mapping[str, tuple[int, ...]]) -> ir.TensorProtocol | None:
    """The tensor of a default-domain ``Constant`` node whose output feeds an input of
    ``readers`` and is not a graph output, when it is a float tensor of rank 2 or more."""
    if set(node.attributes) != {"value"} or len(node.outputs) != 1:
        return None
    output = node.outputs[0]
    found = constant_tensor(output)  # a default-domain Constant holding a tensor: its own
    if found is None or found[1] is not node:
        return None
    tensor = found[0]
    if not tensor.dtype.is_floating_point() or len(tensor.shape) < 2:
        return None
    if output.is_graph_output() or output.name is None:
        return None
    reads_weight = any(
        use.node.domain in _DEFAULT_DOMAINS and use.idx in readers.get(use.node.op_type, ())
        for use in output.uses()
    )
    return tensor if reads_weight else None


def lift_weight_constants(model: ir.Model, readers: Mapping[str, tuple[int, ...]] = WEIGHT_INPUTS) -> int:
    """Move each weight held in a ``Constant`` node and read by an input of ``readers`` (op type:
    input indices) into an initializer of the node's graph, in place; return how many moved.

    The initializer takes the node's output name and its readers; the node is removed. A model
    whose IR version is below 4 (initializers had to be graph inputs then) is left as it is.
    """
    if model.ir_version is not None and model.ir_version < 4:
        return 0
    lifted = 0
    for graph, _ in list(walk_graphs(model.graph)):
        for node in list(graph):
            tensor = _weight_tensor(node, readers)
            if tensor is None:
                continue
            output = node.outputs[0]
            if output.name in graph.initializers:
                continue
            initializer = ir.Value(
                name=output.name,
                shape=ir.Shape(tensor.shape.numpy()),
                type=ir.TensorType(tensor.dtype),
                const_value=tensor,
                metadata_props=output.metadata_props.copy(),
            )
            output.replace_all_uses_with(initializer)
            graph.remove(node, safe=True)
            graph.register_initializer(initializer)
            lifted += 1
    return lifted
