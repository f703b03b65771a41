"""Clean up after a rewrite: cancel Transpose pairs, drop weights nothing reads."""

from __future__ import annotations

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return list(attr.as_ints()) if attr is not None else None


def _is_transpose(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")


# Ops that act on each element alone: ``op(Transpose(x)) == Transpose(op(x))``.
_ELEMENTWISE_UNARY = frozenset(
    {
        "Relu",
        "Sigmoid",
        "Tanh",
        "LeakyRelu",
        "Elu",
        "Selu",
        "Softplus",
        "Softsign",
        "HardSigmoid",
        "HardSwish",
        "Abs",
        "Neg",
        "Exp",
        "Log",
        "Sqrt",
        "Erf",
        "Gelu",
        "Mish",
        "ThresholdedRelu",
    }
)


def _single_consumer(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def sink_transposes(model: ir.Model, ours: set[int]) -> int:
    """Move each of our Transposes below an elementwise op when a Transpose follows it.

    ``Transpose(Relu(Transpose(x, p1)), p2)`` becomes ``Transpose(Relu(x), p1 then p2)``,
    which disappears when the permutations cancel. Returns the number of Transposes removed.
    """
    moved = 0
    for graph, _ in walk_graphs(model.graph):
        for node in list(graph):
            if id(node) not in ours or not _is_transpose(node) or node.graph is not graph:
                continue
            op = _single_consumer(node.outputs[0])
            if (
                op is None
                or op.op_type not in _ELEMENTWISE_UNARY
                or op.domain not in ("", "ai.onnx")
                or len(op.inputs) != 1
                or len(op.outputs) != 1
                or op.graph is not graph
            ):
                continue
            after = _single_consumer(op.outputs[0])
            if after is None or not _is_transpose(after) or after.graph is not graph:
                continue
            first, second = _perm(node), _perm(after)
            if first is None or second is None or len(first) != len(second):
                continue
            composed = [first[i] for i in second]
            op.replace_input_with(0, node.inputs[0])
            op.outputs[0].shape = None  # its layout changed
            graph.remove(node, safe=True)
            moved += 1
            if composed == list(range(len(composed))) and not after.outputs[0].is_graph_output():
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
            composed = [inner_perm[i] for i in outer_perm]
            out = node.outputs[0]
            source = inner.inputs[0]
            if source is None:
                continue
            if composed == list(range(len(composed))):
                if out.is_graph_output():
                    continue
                ir.convenience.replace_all_uses_with(out, source)
                graph.remove(node, safe=True)
                removed += 1
            elif _single_consumer(inner_out) is node:
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
