"""Walking a model: every graph of an onnx-ir model with its scope path, names in use; every graph
of an ONNX protobuf model (:func:`proto_graphs`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, TypeGuard

import onnx_ir as ir

_IS_EXTERNAL: dict[type, bool] = {}
_CREATED = "onnx_conv2matmul.created"


def mark_created(node: ir.Node) -> None:
    """Mark ``node`` as made by the rewrite (kept in ``node.meta``, never saved)."""
    node.meta[_CREATED] = True


def is_created(node: ir.Node) -> bool:
    """Whether the rewrite made ``node`` (see :func:`mark_created`)."""
    return bool(node.meta.get(_CREATED, False))


def is_external(tensor: object) -> TypeGuard[ir.ExternalTensor]:
    """``isinstance(tensor, ir.ExternalTensor)``, fast.

    ``ExternalTensor`` derives from a typing Protocol, which makes every ``isinstance``
    against it walk the protocol's members; the answer depends only on the
    type, so it is worked out once per type.
    """
    kind = type(tensor)
    known = _IS_EXTERNAL.get(kind)
    if known is None:
        known = _IS_EXTERNAL[kind] = isinstance(tensor, ir.ExternalTensor)
    return known


def release_if_external(tensor: object) -> None:
    """Let go of ``tensor``'s data when it lives in an external file, once it has been read.

    onnx-ir maps a weight's whole data file to read it: every weight left mapped holds the file's
    size of address space (the 2.31 GiB encoder went over a 7 GB limit of ``prlimit --as`` that
    way). Read again later, the tensor maps its file again."""
    if is_external(tensor):
        tensor.release()


@contextlib.contextmanager
def read_then_released(tensor: object) -> Iterator[None]:
    """Read ``tensor`` inside: on leaving, what the read mapped is let go
    (:func:`release_if_external`); an external tensor mapped before stays so, for whoever mapped
    it."""
    mapped_before = is_external(tensor) and tensor.raw is not None
    try:
        yield
    finally:
        if not mapped_before:
            release_if_external(tensor)


def walk_graphs(graph: ir.Graph, scope: str = "") -> Iterator[tuple[ir.Graph, str]]:
    """Yield ``graph`` and every subgraph below it (any depth) with its scope path.

    The main graph's scope is ``""``; a subgraph's is the path of the nodes and
    attributes that own it, e.g. ``"If_0/then_branch"`` or ``"Loop_3/body/If_1/else_branch"``.
    """
    yield graph, scope
    for node in graph:
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            owner = node.name or node.op_type
            prefix = f"{scope}/{owner}" if scope else owner
            if attr.type == ir.AttributeType.GRAPH:
                yield from walk_graphs(attr.as_graph(), f"{prefix}/{attr.name}")
            elif attr.type == ir.AttributeType.GRAPHS:
                for i, sub in enumerate(attr.as_graphs()):
                    yield from walk_graphs(sub, f"{prefix}/{attr.name}[{i}]")


@dataclasses.dataclass
class TensorHolder:
    """Where a tensor lives: an initializer, a node's tensor attribute, or one item of a
    node's tensor-list attribute (``index``)."""

    value: ir.Value | None = None
    node: ir.Node | None = None
    attribute: str = ""
    index: int | None = None

    def get(self) -> ir.TensorProtocol:
        if self.value is not None:
            assert self.value.const_value is not None
            return self.value.const_value
        assert self.node is not None
        # attr.value, not as_tensor(): that checks against a typing Protocol on every call,
        # which adds up on exports with thousands of Constant nodes.
        value = self.node.attributes[self.attribute].value
        tensor: ir.TensorProtocol = value if self.index is None else value[self.index]
        return tensor

    def set(self, tensor: ir.TensorProtocol) -> None:
        if self.value is not None:
            self.value.const_value = tensor
            return
        assert self.node is not None
        if self.index is None:
            self.node.attributes[self.attribute] = ir.AttrTensor(self.attribute, tensor)
        else:
            tensors = list(self.node.attributes[self.attribute].value)
            tensors[self.index] = tensor
            self.node.attributes[self.attribute] = ir.AttrTensors(self.attribute, tensors)


def tensor_holders(model: ir.Model) -> Iterator[TensorHolder]:
    """Every tensor of the model's graphs and local functions (initializers and node
    attributes, any depth)."""
    roots = [model.graph, *(function.graph for function in model.functions.values())]
    for graph in (graph for root in roots for graph, _ in walk_graphs(root)):
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield TensorHolder(value=value)
        for node in graph:
            for name, attr in node.attributes.items():
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.TENSOR:
                    yield TensorHolder(node=node, attribute=name)
                elif attr.type == ir.AttributeType.TENSORS:
                    for index in range(len(attr.value)):
                        yield TensorHolder(node=node, attribute=name, index=index)


def used_names(model: ir.Model) -> set[str]:
    """Every node and value name in every scope of the model (functions included)."""
    names: set[str] = set()
    graphs: list[ir.Graph | ir.Function] = [g for g, _ in walk_graphs(model.graph)]
    graphs.extend(model.functions.values())
    for graph in graphs:
        for value in graph.inputs:
            if value.name:
                names.add(value.name)
        if isinstance(graph, ir.Graph):
            names.update(graph.initializers.keys())
        for node in graph:
            if node.name:
                names.add(node.name)
            for value in node.outputs:
                if value.name:
                    names.add(value.name)
    return names


class NameAllocator:
    """Hands out names that are unique across every scope of a model."""

    def __init__(self, taken: set[str]) -> None:
        self._taken = set(taken)

    def new(self, wanted: str) -> str:
        name = wanted
        i = 1
        while name in self._taken:
            name = f"{wanted}_{i}"
            i += 1
        self._taken.add(name)
        return name


def default_opset(model: ir.Model) -> int | None:
    """The version of the default ONNX domain the model imports."""
    for domain in ("", "ai.onnx"):
        if domain in model.opset_imports:
            return model.opset_imports[domain]
    return None


def count_op(model: ir.Model, op_type: str) -> int:
    return sum(1 for graph, _ in walk_graphs(model.graph) for node in graph if node.op_type == op_type)


def count_nodes(model: ir.Model) -> int:
    return sum(len(graph) for graph, _ in walk_graphs(model.graph))


def proto_graphs(graph: Any) -> Iterator[Any]:
    """An ``onnx.GraphProto`` and every subgraph in it (``If``/``Loop``/``Scan`` bodies, at any
    depth), each before the graphs inside it."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from proto_graphs(attribute.g)
            for sub in attribute.graphs:
                yield from proto_graphs(sub)
