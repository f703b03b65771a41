"""Transpose rules shared by the cleanup and the decision of what a conversion costs.

A converted conv runs channels-last between two Transposes of its own: one into
channels-last before its MatMul, one back after it. What happens to them is decided
chain by chain. A *chain* is a run of Transposes and elementwise unary ops (Relu,
Sigmoid, ...) in one graph, each read by the next one alone, at its first input, and
not a graph output. An elementwise op commutes with a Transpose, so a chain computes
the same with all its Transposes composed into one, placed where its last Transpose
is; the cleanup (``cleanup.py``) does that to every chain holding one of our
Transposes. The composed Transpose then goes too:

- when the composition is the identity: whatever read the chain's end reads what the
  last Transpose now reads (a graph output keeps its name: that value takes it over);
- when it undoes a Transpose ``U`` that produces the chain's start (read by others too,
  or a graph output, else ``U`` would be in the chain), nothing but Transposes comes
  before it in the chain, and no other chain's cleanup changes ``U``: the chain's
  readers read ``U``'s input, and ``U`` goes when nothing reads it any more.

:func:`added_transposes` predicts, from the graph before the rewrite and with the same
functions, how many Transposes one conversion adds to the model (negative when it
removes some), so the analysis can leave alone a conv whose conversion would add
layout changes. A chain between two converted convs is counted once, by the later one.

A converted ``FusedConv`` has its activation (and the Add of its input Z) after its
Transpose out, as a Conv's activation is in a model (``_fused.after_transpose_out``). The
prediction takes that into account: an activation that is a chain link is part of the
chain below the conv's Transpose out; a Clip or an Add ends that chain there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import onnx_ir as ir

from onnx_conv2matmul.rewrite.fused import after_transpose_out

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


def channels_last_perms(rank: int) -> tuple[list[int], list[int]]:
    """The permutations into and out of channels-last for a tensor of ``rank``."""
    return [0, *range(2, rank), 1], [0, rank - 1, *range(1, rank - 1)]


@dataclasses.dataclass(frozen=True)
class Link:
    """One node of a chain.

    ``perm`` is None for an elementwise op. ``ours`` marks a Transpose of the rewrite:
    after it, one the rewrite created; before it, a converted conv standing for the
    Transpose it will get (``node`` is then the conv).
    """

    node: ir.Node
    perm: list[int] | None
    ours: bool


def as_link(node: ir.Node, rank: int, ours: Collection[int]) -> Link | None:
    """``node`` as a chain link for a tensor of ``rank``, or None when it cannot be one."""
    if not node.inputs or node.inputs[0] is None:
        return None
    if is_sinkable(node):
        return Link(node, None, False)
    if not is_transpose(node) or len(node.inputs) != 1:
        return None
    permutation = perm(node)
    if permutation is None or sorted(permutation) != list(range(rank)):
        return None  # a Transpose without perm reverses the axes: left alone
    return Link(node, permutation, id(node) in ours)


def _read_alone(value: ir.Value, reader: ir.Node) -> bool:
    """``reader`` reads ``value`` at its first input and nothing else uses it."""
    if value.is_graph_output():
        return False
    uses = list(value.uses())
    return len(uses) == 1 and uses[0].node is reader and uses[0].idx == 0


def walk_up(
    value: ir.Value, reader: ir.Node, rank: int, converted: Collection[int], ours: Collection[int]
) -> tuple[list[Link], ir.Value | None]:
    """The links above ``value`` (which ``reader`` reads), first to last, and the value the
    first of them reads. That value is None when the chain starts at a conv in
    ``converted``: the output of its MatMul, which nothing else reads."""
    graph = reader.graph
    links: list[Link] = []
    while _read_alone(value, reader):
        producer = value.producer()
        if producer is None or producer.graph is not graph:
            break
        if id(producer) in converted:
            if _ends_chain(producer):
                break
            links.append(Link(producer, channels_last_perms(rank)[1], True))
            return links[::-1], None
        link = as_link(producer, rank, ours)
        if link is None:
            break
        links.append(link)
        reader = producer
        value = producer.inputs[0]  # type: ignore[assignment]  # as_link checked it
    return links[::-1], value


def walk_down(
    value: ir.Value, graph: ir.Graph | None, rank: int, converted: Collection[int], ours: Collection[int]
) -> list[Link]:
    """The links below ``value``, first to last. When they reach a conv in ``converted``,
    the last one stands for the Transpose into channels-last it will get."""
    links: list[Link] = []
    while not value.is_graph_output():
        uses = list(value.uses())
        if len(uses) != 1 or uses[0].idx != 0 or uses[0].node.graph is not graph:
            break
        consumer = uses[0].node
        if id(consumer) in converted:
            links.append(Link(consumer, channels_last_perms(rank)[0], True))
            break
        link = as_link(consumer, rank, ours)
        if link is None:
            break
        links.append(link)
        value = consumer.outputs[0]
    return links


def _ends_chain(node: ir.Node) -> bool:
    """A converted ``node`` whose rewrite puts an op that is no chain link (a Clip, an Add)
    after its Transpose out: no chain goes past it."""
    return any(op not in ELEMENTWISE_UNARY for op in after_transpose_out(node))


def chain_perm(links: list[Link]) -> list[int]:
    return functools.reduce(compose, [link.perm for link in links if link.perm is not None])


def outcome(links: list[Link], above: list[int] | None) -> tuple[int, bool]:
    """How many Transposes a chain keeps (0 or 1), and whether it reads through the
    Transpose above it (whose ``perm`` is ``above``; None when it may not)."""
    composed = chain_perm(links)
    if is_identity(composed):
        return 0, False
    last = max(i for i, link in enumerate(links) if link.perm is not None)
    only_transposes_before = all(link.perm is not None for link in links[:last])
    if above is not None and only_transposes_before and is_identity(compose(above, composed)):
        return 0, True
    return 1, False


def above(
    start: ir.Value | None,
    graph: ir.Graph | None,
    rank: int,
    converted: Collection[int],
    ours: Collection[int],
) -> tuple[ir.Node, list[int]] | None:
    """The Transpose a chain starting at ``start`` may read through, and its perm.

    It produces ``start`` and no chain's cleanup changes or removes it: either it is not
    ours and no Transpose of ours is in its chain, or it is one of ours alone in its
    chain with a non-Transpose above (a converted conv's Transpose out; ``start`` has
    other readers or is a graph output). What it reads may still be replaced by an
    equal value.
    """
    if start is None:
        return None
    producer = start.producer()
    if producer is None or producer.graph is not graph:
        return None
    if id(producer) in converted:
        # Not when ops come after its Transpose out: they produce ``start``.
        return None if after_transpose_out(producer) else (producer, channels_last_perms(rank)[1])
    link = as_link(producer, rank, ours)
    if link is None or link.perm is None:
        return None
    source = producer.inputs[0]
    assert source is not None  # as_link checked it
    links, _ = walk_up(source, producer, rank, converted, ours)
    if not link.ours:
        return None if any(up.ours for up in links) else (producer, link.perm)
    if links or is_identity(link.perm) or is_transpose(source.producer()):
        return None
    return producer, link.perm


def existing(links: list[Link]) -> int:
    """The Transposes of a chain that are in the model before the rewrite."""
    return sum(1 for link in links if link.perm is not None and not link.ours)


def added_transposes(node: ir.Node, rank: int, converted: set[int]) -> int:
    """How many Transposes converting ``node`` adds to the model after the cleanup.

    ``converted`` holds the ids of the conv nodes that will be converted, ``node``
    among them. Each side of the conv adds its Transpose (+1), merges it with those of
    its chain (0 when one was there), or cancels out its chain's Transposes (minus
    their number). The sum over the converted convs is what the cleanup leaves minus
    what was there.
    """
    return _input_side(node, rank, converted) + _output_side(node, rank, converted)


def _input_side(node: ir.Node, rank: int, converted: set[int]) -> int:
    x = node.inputs[0]
    if x is None:
        return 1
    ups, start = walk_up(x, node, rank, converted, ())
    links = [*ups, Link(node, channels_last_perms(rank)[0], True)]
    top = above(start, node.graph, rank, converted, ())
    left, through = outcome(links, top[1] if top is not None else None)
    cost = left - existing(links)
    if through and start is not None and top is not None:
        readers = _readers_leaving(start, top[1], node.graph, rank, converted)
        if readers and readers[0] is node:
            cost -= 1  # the Transpose above goes: counted once, by its first reader
    return cost


def _output_side(node: ir.Node, rank: int, converted: set[int]) -> int:
    if _ends_chain(node):
        return 1  # its Transpose out stays, alone in its chain
    downs = walk_down(node.outputs[0], node.graph, rank, converted, ())
    if downs and downs[-1].ours:
        return 0  # a chain to another converted conv: counted by that conv's input side
    links = [Link(node, channels_last_perms(rank)[1], True), *downs]
    left, _ = outcome(links, None)
    return left - existing(links)


def _readers_leaving(
    start: ir.Value, top: list[int], graph: ir.Graph | None, rank: int, converted: set[int]
) -> list[ir.Node] | None:
    """The converted convs whose chains read through the Transpose producing ``start``,
    in use order, when every reader of ``start`` does (so that Transpose goes); else None."""
    if start.is_graph_output():
        return None
    convs: list[ir.Node] = []
    for use in start.uses():
        reader = use.node
        if use.idx != 0 or reader.graph is not graph:
            return None
        if id(reader) in converted:
            links = [Link(reader, channels_last_perms(rank)[0], True)]
        else:
            head = as_link(reader, rank, ())
            if head is None:
                return None
            links = [head, *walk_down(reader.outputs[0], graph, rank, converted, ())]
            if not links[-1].ours:
                return None  # no converted conv at its end: the cleanup leaves it
        if outcome(links, top) != (0, True):
            return None
        convs.append(links[-1].node)
    return convs
