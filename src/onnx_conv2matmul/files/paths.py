"""Which files a model reads, and where its external data may lie.

Read from the protobuf alone (no tensor data, no onnx-ir), so a command can refuse a
path that would replace one of them before any work starts.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the console script's start stays light
    import onnx


def _normalize(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


@functools.lru_cache(maxsize=4096)
def contained_location(base_dir: str, location: str, home: str | None = None) -> str | None:
    """The normalized path of external data ``location`` if it lies inside ``base_dir``.

    ``home``: the directory the model file itself lies in once its links are followed (None
    when it is no link). A location that is a link there, landing in ``home`` too, gives the
    real path it lands on: the model and its data are links into one store, as a Hugging Face
    cache keeps them (``snapshots/REV/model.onnx`` -> ``../../blobs/HASH``).

    A location that is absolute or climbs out of the model's directory gives ``None``:
    copying it would put a file that is not the model's into the output. So does one
    that leaves it through a symbolic link, the rule onnx-ir applies when it reads, and
    one whose ``..`` leads out once the links before it are followed (``sub/../x`` where
    ``sub`` links elsewhere): such a location is resolved on the filesystem, as the
    system resolves it when the file is opened, and its real path is returned.
    """
    base = _normalize(base_dir)
    path = os.path.normpath(os.path.join(base, location))
    if os.path.isabs(location) or not _inside(base, path):
        return None
    if os.pardir in location.replace(os.sep, "/").split("/"):
        # "sub/../x" names base/x only if sub is a directory there: the system follows a
        # link named sub first, and ".." then leads out of where it points.
        real = os.path.realpath(os.path.join(base, location))
        return real if _inside(_realpath(base), real) else None
    if os.path.dirname(path) == base and not os.path.islink(path):
        return path  # a plain file in the model's directory (one lstat, not a realpath)
    real = os.path.realpath(path)
    if _inside(_realpath(base), real):
        return path
    if home is not None and os.path.dirname(real) == _normalize(home) and os.path.islink(path):
        # A link beside the model that lands beside the file the model's own link lands on: a
        # store of content-addressed files (a Hugging Face cache's snapshots and blobs).
        return real
    return None


@functools.lru_cache(maxsize=64)
def _realpath(path: str) -> str:
    return os.path.realpath(path)


def _inside(base: str, path: str) -> bool:
    return path != base and os.path.commonpath([base, path]) == base


def data_files(proto: onnx.ModelProto, base_dir: str) -> set[str]:
    """The normalized paths of the external data files ``proto``'s tensors name.

    Tensors of the main graph, of subgraphs at any depth, of node attributes (Constant
    values) and of local functions count; locations are taken relative to ``base_dir``.
    """
    import onnx

    files = set()
    for tensor in model_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value:
                files.add(os.path.normpath(os.path.join(base_dir, entry.value)))
    return files


def files_read_by(model_path: str) -> set[str]:
    """The real paths of ``model_path`` and of every external data file its tensors name.

    Tensors of the main graph, of subgraphs at any depth, of node attributes (Constant
    values) and of local functions count. A file that cannot be parsed gives only its own
    path: the loader reports it later. Costs one parse of the ``.onnx`` (tensor data that
    lives inside it is read too, so a large single-file model takes a while).
    """
    import onnx

    files = {os.path.realpath(model_path)}
    try:
        proto = onnx.load(model_path, load_external_data=False)
    except Exception:  # not an ONNX file: nothing more it could read
        return files
    base_dir = os.path.dirname(os.path.abspath(model_path))
    return files | {os.path.realpath(p) for p in data_files(proto, base_dir)}


def folder_bytes(folder: str) -> int:
    """The bytes of the files under ``folder`` (what a run wrote there); a file that went
    meanwhile counts 0."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def model_file_bytes(path: str) -> int:
    """The bytes of the model at ``path`` as it lies on disk: its ``.onnx`` and each external data
    file its tensors name, once (read from the graph without loading any tensor). A missing
    path is 0; a file that cannot be parsed counts alone (its loader reports it)."""
    import onnx

    if not os.path.exists(path):
        return 0
    total = os.path.getsize(path)
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception:
        return total
    for name in data_files(proto, os.path.dirname(os.path.abspath(path))):
        with contextlib.suppress(OSError):
            total += os.path.getsize(name)
    return total


def model_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``proto``: of the main graph, of subgraphs at any depth, of node
    attributes (Constant values), sparse tensors' values and indices, and of local functions."""
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
