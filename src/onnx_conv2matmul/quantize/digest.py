"""A digest of what a model computes with: its nodes (op, domain, name, inputs, outputs,
attributes, subgraphs included) and its constant tensors' types, shapes and bytes, not where the
tensors are stored. Two models with the same digest give the same outputs in the same session:
the search's evaluation of a configuration stands for the accuracy check of the same model
written elsewhere (see :class:`onnx_conv2matmul.quantize.reference.Reference.check`)."""

from __future__ import annotations

import hashlib
from typing import Any

import onnx_ir as ir


def model_digest(model: ir.Model) -> str:
    """The hex digest of ``model``'s computation (see the module's description)."""
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
    h.update(tensor.tobytes())
