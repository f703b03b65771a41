"""Which files a model reads: its ``.onnx`` and every external data file it names.

Read from the protobuf alone (no tensor data, no onnx-ir), so a command can refuse a
path that would replace one of them before any work starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import onnx


def files_read_by(model_path: str) -> set[str]:
    """The real paths of ``model_path`` and of every external data file its tensors name.

    Tensors of the main graph, of subgraphs at any depth, of node attributes (Constant
    values) and of local functions count. A file that cannot be parsed gives only its own
    path: the loader reports it later. Costs one parse of the ``.onnx`` (tensor data that
    lives inside it is read too: about a second per 2 GB).
    """
    files = {os.path.realpath(model_path)}
    try:
        proto = onnx.load(model_path, load_external_data=False)
    except Exception:  # not an ONNX file: nothing more it could read
        return files
    base_dir = os.path.dirname(os.path.abspath(model_path))
    for tensor in _tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value:
                files.add(os.path.realpath(os.path.join(base_dir, entry.value)))
    return files


def _tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    yield from _graph_tensors(proto.graph)
    for function in proto.functions:
        yield from _node_tensors(function.node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    for node in nodes:
        for attr in node.attribute:
            yield from _attribute_tensors(attr)


def _attribute_tensors(attr: onnx.AttributeProto) -> Iterator[onnx.TensorProto]:
    if attr.HasField("t"):
        yield attr.t
    yield from attr.tensors
    if attr.HasField("sparse_tensor"):
        yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
    for sparse in attr.sparse_tensors:
        yield from (sparse.values, sparse.indices)
    if attr.HasField("g"):
        yield from _graph_tensors(attr.g)
    for graph in attr.graphs:
        yield from _graph_tensors(graph)
