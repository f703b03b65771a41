"""Clean up after a rewrite: cancel Transpose pairs, drop weights nothing reads."""

from __future__ import annotations

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return list(attr.as_ints()) if attr is not None else None


def _is_transpose(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")


def cancel_transposes(model: ir.Model, ours: set[int] | None = None) -> int:
    """Bypass every ``Transpose(Transpose(x, p1), p2)`` that is the identity.

    With ``ours`` (ids of nodes the rewrite created), only pairs with at least
    one of those nodes are touched, so the rest of the model stays as it was.

    The outer Transpose's users read ``x`` directly; a Transpose left without
    users is removed. A Transpose whose output is a graph output is kept, so
    graph output names never change. Returns the number of Transposes removed.
    """
    removed = 0
    for graph, _ in walk_graphs(model.graph):
        for node in list(graph):
            if node.graph is not graph or not _is_transpose(node):
                continue
            inner_out = node.inputs[0]
            if inner_out is None:
                continue
            inner = inner_out.producer()
            if inner is None or not _is_transpose(inner):
                continue
            outer_perm, inner_perm = _perm(node), _perm(inner)
            if ours is not None and id(node) not in ours and id(inner) not in ours:
                continue
            if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
                continue
            if [inner_perm[i] for i in outer_perm] != list(range(len(outer_perm))):
                continue
            out = node.outputs[0]
            source = inner.inputs[0]
            if out.is_graph_output() or source is None:
                continue
            ir.convenience.replace_all_uses_with(out, source)
            graph.remove(node, safe=True)
            removed += 1
            if not inner_out.uses() and not inner_out.is_graph_output():
                inner.graph.remove(inner, safe=True)  # type: ignore[union-attr]
                removed += 1
    return removed


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
