"""Clean up after a rewrite: collapse Transpose chains, drop weights nothing reads.

The rules, and the prediction of what they leave, are in ``_layout.py``.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_conv2matmul._graphs import is_created, walk_graphs
from onnx_conv2matmul.rewrite.layout import (
    Link,
    above,
    as_link,
    chain_perm,
    is_transpose,
    outcome,
    perm,
    walk_down,
    walk_up,
)


@dataclasses.dataclass
class _Chain:
    links: list[Link]
    start: ir.Value
    rank: int

    @property
    def transposes(self) -> list[ir.Node]:
        return [link.node for link in self.links if link.perm is not None]

    def between(self) -> list[ir.Node]:
        """The elementwise ops between the first and the last Transpose."""
        where = [i for i, link in enumerate(self.links) if link.perm is not None]
        return [link.node for link in self.links[where[0] : where[-1]] if link.perm is None]


def _chains(graph: ir.Graph, ours: set[int]) -> list[_Chain]:
    """Every chain of ``graph`` that holds one of ``ours``, each once."""
    chains = []
    seen: set[int] = set()
    for node in graph:
        if id(node) not in ours or id(node) in seen or not is_transpose(node):
            continue
        permutation = perm(node)
        if permutation is None:
            continue
        rank = len(permutation)
        link = as_link(node, rank, ours)
        if link is None:
            continue
        ups, start = walk_up(node.inputs[0], node, rank, (), ours)  # type: ignore[arg-type]
        links = [*ups, link, *walk_down(node.outputs[0], graph, rank, (), ours)]
        seen.update(id(link.node) for link in links)
        assert start is not None  # only a conv still to convert starts a chain with None
        chains.append(_Chain(links, start, rank))
    return chains


def _ours(model: ir.Model, every: bool) -> set[int]:
    """The Transposes the cleanup may touch: those the rewrite made, or with ``every`` all."""
    return {
        id(node)
        for graph, _ in walk_graphs(model.graph)
        for node in graph
        if is_transpose(node) and (every or is_created(node))
    }


def sink_transposes(model: ir.Model) -> int:
    """Move the Transposes of each chain holding one the rewrite made (see
    :func:`~onnx_conv2matmul._graphs.mark_created`) down, across its elementwise ops, to
    just above the chain's last Transpose.

    Only moves: :func:`cancel_transposes` then composes the Transposes, now next to
    each other (it gives the same result without this step). Returns 0, the number of
    Transposes removed.
    """
    ours = _ours(model, every=False)
    for graph, _ in list(walk_graphs(model.graph)):
        for chain in _chains(graph, ours):
            *others, last = chain.transposes
            for op in chain.between():
                op.outputs[0].shape = None  # its layout changes
            for node in others:
                ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])  # type: ignore[arg-type]
                node.replace_input_with(0, last.inputs[0])
                last.replace_input_with(0, node.outputs[0])
                graph.remove(node)
                graph.insert_before(last, node)
    return 0


def cancel_transposes(model: ir.Model, *, every: bool = False) -> int:
    """Compose the Transposes of each chain holding one the rewrite made into one, and
    remove it when it is the identity or undoes the Transpose above the chain.

    With ``every``, every Transpose counts as made by the rewrite. A graph output keeps its name,
    type and shape: when the Transpose producing it goes, the value it transposed takes
    them over. Returns the number of Transposes removed.
    """
    ours = _ours(model, every)
    removed = 0
    for graph, _ in list(walk_graphs(model.graph)):
        # Decide every chain on the graph as it is, then change it: no decision depends
        # on the order the chains are visited in.
        plans: list[tuple[_Chain, int, ir.Node | None]] = []
        for chain in _chains(graph, ours):
            found = above(chain.start, graph, chain.rank, (), ours)
            left, through = outcome(chain.links, found[1] if found is not None else None)
            plans.append((chain, left, found[0] if through and found is not None else None))
        for chain, left, top in plans:
            removed += _collapse(graph, chain, left, top, ours)
        for _, _, top in plans:
            if top is None or top.graph is not graph:
                continue
            out = top.outputs[0]
            if not out.uses() and not out.is_graph_output():
                graph.remove(top, safe=True)  # every chain that read it reads its input now
                removed += 1
    return removed


def _collapse(graph: ir.Graph, chain: _Chain, left: int, top: ir.Node | None, ours: set[int]) -> int:
    """Apply :func:`_layout.outcome` to one chain; return the Transposes removed.

    ``top`` is the Transpose above the chain when the chain reads through it. It stays
    (see :func:`_layout.above`), but what it reads may have been replaced by an equal
    value since the decision: its input is taken now."""
    *others, last = chain.transposes
    for op in chain.between():
        op.outputs[0].shape = None  # its layout changes
    for node in others:
        ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])  # type: ignore[arg-type]
        graph.remove(node, safe=True)
    last.attributes["perm"] = ir.AttrInt64s("perm", chain_perm(chain.links))
    ours.add(id(last))  # pragma: no mutate (equivalent: every plan is made before a collapse)
    if left:
        return len(others)
    target = top.inputs[0] if top is not None else last.inputs[0]
    assert target is not None
    out = last.outputs[0]
    if out.is_graph_output():
        if not _can_take_over(target, graph):
            # Only when no Transpose of the rewrite starts the chain: ours=None.
            return len(others)
        _take_over(out, target)
    else:
        ir.convenience.replace_all_uses_with(out, target)
    graph.remove(last, safe=True)
    return len(others) + 1


def _can_take_over(value: ir.Value, graph: ir.Graph) -> bool:
    """``value`` can become a graph output of ``graph`` under another name."""
    producer = value.producer()
    return producer is not None and producer.graph is graph and not value.is_graph_output()


def _take_over(output: ir.Value, value: ir.Value) -> None:
    """Make ``value`` the graph output ``output`` is, with its name, type and shape."""
    name = output.name
    output.replace_all_uses_with(value, replace_graph_outputs=True)
    output.name = None  # pragma: no mutate (equivalent: "" too; the caller removes its node next)
    value.name = name
    if output.type is not None:
        value.type = output.type
    value.shape = output.shape
    value.doc_string = output.doc_string
    value.metadata_props.update(output.metadata_props)


def remove_dead_weights(weights: list[tuple[ir.Value, ir.Node | None]]) -> int:
    """Remove converted weights (initializers or Constant nodes) nothing reads any more."""
    removed = 0
    for value, constant_node in weights:
        if value.uses() or value.is_graph_output() or value.is_graph_input():
            continue
        if constant_node is not None:
            owner = constant_node.graph
            if owner is not None:
                owner.remove(constant_node, safe=True)
                removed += 1
        elif value.is_initializer() and value.graph is not None and value.name is not None:
            value.graph.initializers.pop(value.name)
            removed += 1
    return removed
