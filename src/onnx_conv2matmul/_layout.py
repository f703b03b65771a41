"""Transpose rules shared by the cleanup and the decision of what a conversion costs.

A converted conv runs channels-last between two Transposes of its own. The cleanup
(``cleanup.py``) then removes those that meet a Transpose already in the graph, or
the Transpose of a neighbouring converted conv, directly or across one elementwise
op. :func:`added_transposes` predicts, from the graph before the rewrite and by the
same rules, how many Transposes one conversion leaves behind, so the analysis can
leave alone a conv whose conversion would add layout changes to the model.
"""

from __future__ import annotations

import onnx_ir as ir

# Ops that act on each element alone: ``op(Transpose(x)) == Transpose(op(x))``.
ELEMENTWISE_UNARY = frozenset(
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


def perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return list(attr.as_ints()) if attr is not None else None


def compose(first: list[int], second: list[int]) -> list[int]:
    """The permutation of ``Transpose(Transpose(x, first), second)``."""
    return [first[i] for i in second]


def is_identity(permutation: list[int]) -> bool:
    return permutation == list(range(len(permutation)))


def is_transpose(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")


def is_sinkable(node: ir.Node | None) -> bool:
    """An op a Transpose can move across: one input, one output, elementwise."""
    return (
        node is not None
        and node.op_type in ELEMENTWISE_UNARY
        and node.domain in ("", "ai.onnx")
        and len(node.inputs) == 1
        and len(node.outputs) == 1
    )


def single_consumer(value: ir.Value) -> ir.Node | None:
    """The one node that reads ``value``; None when several do, or it is a graph output."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def channels_last_perms(rank: int) -> tuple[list[int], list[int]]:
    """The permutations into and out of channels-last for a tensor of ``rank``."""
    return [0, *range(2, rank), 1], [0, rank - 1, *range(1, rank - 1)]


def added_transposes(node: ir.Node, rank: int, converted: set[int]) -> int:
    """How many Transposes converting ``node`` adds to the model after the cleanup.

    ``converted`` holds the ids of the conv nodes that will be converted too: the
    Transposes between two of them cancel. The result is -2 to 2: each side of the
    conv adds one Transpose (+1), merges with one already there (0), or cancels one
    already there (-1).
    """
    return _input_side(node, rank, converted) + _output_side(node, rank, converted)


def _input_side(node: ir.Node, rank: int, converted: set[int]) -> int:
    x = node.inputs[0]
    if x is None:
        return 1
    producer = x.producer()
    if producer is None or producer.graph is not node.graph:
        return 1
    alone = single_consumer(x) is node
    if id(producer) in converted:
        return 0  # our Transpose in cancels theirs out (which stays if others read it)
    if is_transpose(producer):
        before = perm(producer)
        if before is None or len(before) != rank:
            return 1
        if is_identity(compose(before, channels_last_perms(rank)[0])):
            return -1 if alone else 0
        return 0 if alone else 1
    source = producer.inputs[0] if is_sinkable(producer) else None
    if alone and source is not None and single_consumer(source) is producer:
        conv = source.producer()
        if conv is not None and id(conv) in converted:
            return 0  # their Transpose out moves across the op and cancels ours
    return 1


def _output_side(node: ir.Node, rank: int, converted: set[int]) -> int:
    consumer = single_consumer(node.outputs[0])
    if consumer is None or consumer.graph is not node.graph:
        return 1
    if id(consumer) in converted:
        return 0
    out_perm = channels_last_perms(rank)[1]
    if is_transpose(consumer):
        after = perm(consumer)
        if after is None or len(after) != rank:
            return 1
        if is_identity(compose(out_perm, after)):
            return 1 if consumer.outputs[0].is_graph_output() else -1
        return 0
    if is_sinkable(consumer):
        following = single_consumer(consumer.outputs[0])
        if following is None or following.graph is not node.graph:
            return 1
        if id(following) in converted:
            return 0
        if is_transpose(following):
            after = perm(following)
            if after is None or len(after) != rank:
                return 1
            if is_identity(compose(out_perm, after)) and not following.outputs[0].is_graph_output():
                return -1
            return 0
    return 1
