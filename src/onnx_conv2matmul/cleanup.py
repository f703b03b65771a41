"""Clean up after a rewrite: cancel Transpose pairs, drop weights nothing reads."""

from __future__ import annotations

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs
from onnx_conv2matmul._layout import compose, is_identity, is_sinkable, is_transpose, perm, single_consumer


def sink_transposes(model: ir.Model, ours: set[int]) -> int:
    """Move each of our Transposes below an elementwise op when a Transpose follows it.

    ``Transpose(Relu(Transpose(x, p1)), p2)`` becomes ``Transpose(Relu(x), p1 then p2)``,
    which disappears when the permutations cancel. Returns the number of Transposes removed.
    """
    moved = 0
    for graph, _ in walk_graphs(model.graph):
        for node in list(graph):
            if id(node) not in ours or not is_transpose(node) or node.graph is not graph:
                continue
            op = single_consumer(node.outputs[0])
            if op is None or not is_sinkable(op) or op.graph is not graph:
                continue
            after = single_consumer(op.outputs[0])
            if after is None or not is_transpose(after) or after.graph is not graph:
                continue
            first, second = perm(node), perm(after)
            if first is None or second is None or len(first) != len(second):
                continue
            composed = compose(first, second)
            op.replace_input_with(0, node.inputs[0])
            op.outputs[0].shape = None  # its layout changed
            graph.remove(node, safe=True)
            moved += 1
            if is_identity(composed) and not after.outputs[0].is_graph_output():
                ir.convenience.replace_all_uses_with(after.outputs[0], op.outputs[0])
                graph.remove(after, safe=True)
                moved += 1
            else:
                after.attributes["perm"] = ir.AttrInt64s("perm", composed)
                ours.add(id(after))
    return moved


def cancel_transposes(model: ir.Model, ours: set[int] | None = None) -> int:
    """Merge ``Transpose(Transpose(x, p1), p2)`` pairs; bypass them when they cancel.

    With ``ours`` (ids of nodes the rewrite created), only pairs with at least
    one of those nodes are touched, so the rest of the model stays as it was.

    When the pair is the identity, the outer Transpose's users read ``x``
    directly. Otherwise, when the inner one has no other user, the outer one
    reads ``x`` with the composed permutation. A Transpose left without users is
    removed. A Transpose whose output is a graph output is kept, so graph output
    names never change. Returns the number of Transposes removed.
    """
    removed = 0
    for graph, _ in walk_graphs(model.graph):
        for node in list(graph):
            if node.graph is not graph or not is_transpose(node):
                continue
            inner_out = node.inputs[0]
            if inner_out is None:
                continue
            inner = inner_out.producer()
            if inner is None or not is_transpose(inner):
                continue
            outer_perm, inner_perm = perm(node), perm(inner)
            if ours is not None and id(node) not in ours and id(inner) not in ours:
                continue
            if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
                continue
            composed = compose(inner_perm, outer_perm)
            out = node.outputs[0]
            source = inner.inputs[0]
            if source is None:
                continue
            if is_identity(composed):
                if out.is_graph_output():
                    continue
                ir.convenience.replace_all_uses_with(out, source)
                graph.remove(node, safe=True)
                removed += 1
            elif single_consumer(inner_out) is node:
                node.replace_input_with(0, source)
                node.attributes["perm"] = ir.AttrInt64s("perm", composed)
            else:
                continue
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
