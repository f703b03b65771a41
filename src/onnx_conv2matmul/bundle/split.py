"""Split NeMo's ``decoder_joint`` model into the decoder and joiner that sherpa-onnx runs.

NeMo exports a TDT or RNN-T model's prediction network and joint network as one model:

``(encoder_outputs [B, D, T], targets [B, U], target_length [B], states...)``
``-> (outputs [B, T, U, V], prednet_lengths [B], states...)``

sherpa-onnx runs them as two models, fed by position:

* decoder: ``(targets int32 [B, U], target_length int32 [B], states...)``
  ``-> (decoder_outputs [B, H, U], prednet_lengths, states...)``;
* joiner: ``(encoder_outputs [B, D, T], decoder_outputs [B, H, U]) -> outputs [B, T, U, V]``
  (it calls it with T = U = 1, one encoder frame and one decoder step).

The split works on the graph: the decoder keeps the nodes the decoder-side outputs (lengths
and states) are computed from; the joiner keeps the nodes the joint's output needs beyond
those. The two meet at one tensor, the output ``Y`` of the prediction network's last
recurrent node (LSTM, GRU or RNN: ``[U, 1, B, H]``),
which the decoder returns as ``[B, H, U]`` (as NeMo's separate decoder export does) and the
joiner turns back. Nothing is recomputed or approximated: the two models compute exactly
what the joint model does, which :func:`verify_split` checks in onnxruntime. Weights are
shared with the source model (onnx-ir tensors, external data left on disk until saved).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul.errors import InputError

if TYPE_CHECKING:
    import onnxruntime as ort

logger = logging.getLogger(__name__)

RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})
DECODER_OUTPUT = "decoder_outputs"
JOINER_DECODER_INPUT = "decoder_outputs"
SHERPA_INDEX_TYPE = ir.DataType.INT32  # sherpa-onnx feeds targets and target_length as int32


@dataclasses.dataclass
class SplitModels:
    """The two models made from a ``decoder_joint`` model.

    Attributes:
        decoder: The prediction network: targets, target length, states in; its output
            ``[B, H, U]``, the length and the new states out.
        joiner: The joint network: encoder output and decoder output in, logits out.
        cut: The name of the tensor where the joint model was cut (the recurrent node's ``Y``).
        hidden_size: H, the size of the decoder output's axis 1.
        int32_inputs: The decoder inputs that were int64 in the joint model and are int32
            now (cast inside the decoder), so that sherpa-onnx can feed them.
    """

    decoder: ir.Model
    joiner: ir.Model
    cut: str
    hidden_size: int
    int32_inputs: list[str]


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.as_graph()
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.as_graphs()


def _nested(graph: ir.Graph) -> Iterator[ir.Graph]:
    """``graph`` and every graph inside it."""
    yield graph
    for node in graph:
        for sub in _subgraphs(node):
            yield from _nested(sub)


def _captured(graph: ir.Graph) -> Iterator[ir.Value]:
    """Values that nodes of ``graph`` (and of its subgraphs) read from enclosing graphs."""
    inside = {id(g) for g in _nested(graph)}
    for sub in _nested(graph):
        for node in sub:
            for value in node.inputs:
                if value is not None and id(value.graph) not in inside:
                    yield value


def node_inputs(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` reads: its inputs and what its subgraphs read from outside."""
    values = [v for v in node.inputs if v is not None]
    for sub in _subgraphs(node):
        values.extend(v for v in _captured(sub) if v.graph is node.graph)
    return values


def ancestors(values: Iterable[ir.Value]) -> set[ir.Node]:
    """Every node the given values are computed from (in their graph)."""
    seen: set[ir.Node] = set()
    stack = [v.producer() for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(v.producer() for v in node_inputs(node))
    return seen


def _reads_inputs(value: ir.Value, memo: dict[ir.Value, frozenset[str]]) -> frozenset[str]:
    """Names of the graph inputs ``value`` is computed from (empty: a constant)."""
    pending = [value]
    while pending:
        current = pending[-1]
        if current in memo:
            pending.pop()
            continue
        if current.is_graph_input():
            memo[current] = frozenset({current.name or ""})
            pending.pop()
            continue
        producer = current.producer()
        if producer is None:  # an initializer
            memo[current] = frozenset()
            pending.pop()
            continue
        sources = node_inputs(producer)
        missing = [v for v in sources if v not in memo]
        if missing:
            pending.extend(missing)
            continue
        names: frozenset[str] = frozenset().union(*(memo[v] for v in sources))
        for out in producer.outputs:
            memo[out] = names
        pending.pop()
    return memo[value]


def _check_interface(graph: ir.Graph) -> None:
    inputs, outputs = graph.inputs, graph.outputs
    if len(inputs) < 3 or len(outputs) < 2 or len(inputs) - 3 != len(outputs) - 2:
        raise InputError(
            "not a decoder_joint model: expected inputs (encoder_outputs, targets, target_length,"
            " states...) and outputs (outputs, prednet_lengths, states...), got inputs"
            f" {[v.name for v in inputs]} and outputs {[v.name for v in outputs]}"
        )
    encoder, targets = inputs[0], inputs[1]
    if encoder.shape is not None and len(encoder.shape) != 3:
        raise InputError(f"decoder_joint input {encoder.name!r} is not [batch, dim, time]")
    if targets.dtype not in (ir.DataType.INT32, ir.DataType.INT64):
        raise InputError(f"decoder_joint input {targets.name!r} is not of an integer type")


def _cut_value(graph: ir.Graph, decoder_nodes: set[ir.Node], joiner_nodes: set[ir.Node]) -> ir.Value:
    """The one non-constant tensor the decoder side hands to the joint network."""
    memo: dict[ir.Value, frozenset[str]] = {}
    encoder_name = graph.inputs[0].name or ""
    decoder_inputs = {v.name for v in graph.inputs[1:]}
    for node in decoder_nodes:
        for value in node_inputs(node):
            if encoder_name in _reads_inputs(value, memo):
                raise InputError(
                    "cannot split decoder_joint: the prediction network reads the encoder output"
                    f" (node {node.name!r})"
                )
    crossing: dict[str, ir.Value] = {}
    for node in joiner_nodes:
        for value in node_inputs(node):
            if value.producer() in joiner_nodes or value.name == encoder_name:
                continue
            if _reads_inputs(value, memo) & decoder_inputs:
                crossing[value.name or ""] = value
    if len(crossing) != 1:
        raise InputError(
            "cannot split decoder_joint: the joint network reads"
            f" {len(crossing)} tensors of the prediction network ({sorted(crossing)}), not one"
        )
    (cut,) = crossing.values()
    producer = cut.producer()
    if producer is None or producer.op_type not in RECURRENT_OPS or cut.index() != 0:
        raise InputError(
            f"cannot split decoder_joint: the joint network reads {cut.name!r}, which is not the"
            " output Y of the prediction network's LSTM, GRU or RNN node"
        )
    return cut


def _recurrent_layout(node: ir.Node) -> tuple[int, list[int]]:
    """(hidden size, permutation taking Y without its direction axis to [B, H, U]).

    Y is ``[U, 1, B, H]``: onnxruntime runs only ``layout=0`` recurrent nodes.
    """
    if node.attributes.get_string("direction", "forward") == "bidirectional":
        raise InputError(f"cannot split decoder_joint: {node.op_type} {node.name!r} is bidirectional")
    if node.attributes.get_int("layout", 0) != 0:
        raise InputError(f"cannot split decoder_joint: {node.op_type} {node.name!r} is batch-first")
    hidden = node.attributes.get_int("hidden_size", 0)
    if not hidden:
        raise InputError(f"cannot split decoder_joint: {node.op_type} {node.name!r} has no hidden_size")
    return hidden, [1, 2, 0]


def _int64_const(name: str, values: Sequence[int]) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(np.array(values, dtype=np.int64), name=name))


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def _squeeze(
    graph: ir.Graph, model: ir.Model, value: ir.Value, axis: int, name: str, unsqueeze: bool
) -> ir.Node:
    op = "Unsqueeze" if unsqueeze else "Squeeze"
    if _opset(model) >= 13:
        axes = _int64_const(f"{name}/axes", [axis])
        graph.register_initializer(axes)
        return ir.node(op, [value, axes], name=name)
    return ir.node(op, [value], attributes={"axes": [axis]}, name=name)


def _remove_unused(graph: ir.Graph) -> None:
    """Remove the nodes and initializers that no graph output needs (any order of nodes)."""
    needed = ancestors(graph.outputs)
    unused = [node for node in graph if node not in needed]
    graph.remove(unused, safe=True)
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_output():
            del graph.initializers[name]


def _new_model(model: ir.Model, graph: ir.Graph) -> ir.Model:
    copy = ir.Model(
        graph,
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        producer_version=model.producer_version,
        domain=model.domain,
        model_version=model.model_version,
        doc_string=model.doc_string,
        functions=list(model.functions.values()),
    )
    return copy


def split_decoder_joint(model: ir.Model) -> SplitModels:
    """Split a ``decoder_joint`` model (see the module docstring); ``model`` is consumed.

    Raises:
        InputError: the model does not have the decoder_joint interface, or its joint network
            does not read the prediction network through one recurrent node's output.
    """
    graph = model.graph
    _check_interface(graph)
    joiner_graph = graph.clone()
    order = {node: i for i, node in enumerate(graph)}
    decoder_nodes = ancestors(graph.outputs[1:])
    joiner_nodes = ancestors(graph.outputs[:1]) - decoder_nodes
    cut = _cut_value(graph, decoder_nodes, joiner_nodes)
    recurrent = cut.producer()
    assert recurrent is not None
    hidden, perm = _recurrent_layout(recurrent)
    axis = 1  # Y's direction axis
    cut_index = order[recurrent]

    # Decoder: the nodes of the decoder-side outputs, and Y as [B, H, U] in front.
    squeezed = _squeeze(graph, model, cut, axis, f"{DECODER_OUTPUT}/Squeeze", unsqueeze=False)
    transposed = ir.node("Transpose", [squeezed.outputs[0]], attributes={"perm": perm})
    transposed.name = f"{DECODER_OUTPUT}/Transpose"
    transposed.outputs[0].name = DECODER_OUTPUT
    element = ir.TensorType(cut.dtype or ir.DataType.FLOAT)
    squeezed.outputs[0].type = element
    transposed.outputs[0].type = element
    transposed.outputs[0].shape = ir.Shape(["batch", hidden, "tokens"])
    graph.insert_after(recurrent, [squeezed, transposed])
    old_outputs = list(graph.outputs)
    graph.outputs.clear()
    graph.outputs.extend([transposed.outputs[0], *old_outputs[1:]])
    _remove_unused(graph)
    encoder_input = graph.inputs[0]
    if encoder_input.uses():
        raise InputError("cannot split decoder_joint: the prediction network reads the encoder output")
    graph.inputs.pop(0)
    int32_inputs = _inputs_as_int32(graph, graph.inputs[:2])

    # Joiner: the joint network, reading Y back from a [B, H, U] input.
    joiner_nodes_list = list(joiner_graph)
    joiner_cut = joiner_nodes_list[cut_index].outputs[0]
    decoder_input = ir.Value(
        name=JOINER_DECODER_INPUT,
        type=element,
        shape=ir.Shape(["batch", hidden, "tokens"]),
    )
    inverse = [perm.index(i) for i in range(3)]
    back = ir.node("Transpose", [decoder_input], attributes={"perm": inverse})
    back.name = f"{JOINER_DECODER_INPUT}/Transpose"
    restored = _squeeze(joiner_graph, model, back.outputs[0], axis, f"{JOINER_DECODER_INPUT}/Unsqueeze", True)
    back.outputs[0].type = element
    restored.outputs[0].type = element
    first = joiner_nodes_list[0]
    joiner_graph.insert_before(first, [back, restored])
    for use in list(joiner_cut.uses()):
        if use.node is not restored:
            use.node.replace_input_with(use.idx, restored.outputs[0])
    logits = joiner_graph.outputs[0]
    joiner_graph.outputs.clear()
    joiner_graph.outputs.append(logits)
    encoder_for_joiner = joiner_graph.inputs[0]
    _remove_unused(joiner_graph)
    left = [v.name for v in joiner_graph.inputs[1:] if v.uses()]
    if left:
        raise InputError(f"cannot split decoder_joint: the joint network also reads {left}")
    joiner_graph.inputs.clear()
    joiner_graph.inputs.extend([encoder_for_joiner, decoder_input])
    joiner_graph.sort()
    graph.sort()
    logger.debug("split decoder_joint at %s (hidden %d)", cut.name, hidden)
    return SplitModels(
        decoder=_new_model(model, graph),
        joiner=_new_model(model, joiner_graph),
        cut=cut.name or "",
        hidden_size=hidden,
        int32_inputs=int32_inputs,
    )


def _inputs_as_int32(graph: ir.Graph, inputs: Sequence[ir.Value]) -> list[str]:
    """Make int64 index inputs int32, cast back to int64 inside (sherpa-onnx feeds int32)."""
    changed = []
    for value in inputs:
        if value.dtype != ir.DataType.INT64:
            continue
        name = value.name or ""
        new_input = ir.Value(name=name, type=ir.TensorType(SHERPA_INDEX_TYPE), shape=value.shape)
        value.name = f"{name}/int64"
        cast = ir.node("Cast", [new_input], attributes={"to": ir.DataType.INT64}, name=f"{name}/Cast")
        graph.insert_before(next(iter(graph)), cast)
        value.replace_all_uses_with(cast.outputs[0], replace_graph_outputs=True)
        index = list(graph.inputs).index(value)
        graph.inputs[index] = new_input
        changed.append(name)
    return changed


@dataclasses.dataclass
class SplitCheck:
    """The joint model against decoder + joiner in onnxruntime, on random inputs.

    Attributes:
        shapes: ``(batch, frames, tokens)`` of each run.
        max_abs_diff: The largest difference of the logits over the runs.
        max_abs: The largest absolute logit, for scale.
        states_equal: Whether every state output (and length) was equal.
    """

    shapes: list[tuple[int, int, int]]
    max_abs_diff: float
    max_abs: float
    states_equal: bool

    @property
    def passed(self) -> bool:
        return self.states_equal and self.max_abs_diff <= 1e-5 * max(1.0, self.max_abs)

    def to_dict(self) -> dict[str, object]:
        return {
            "shapes": [list(s) for s in self.shapes],
            "max_abs_diff": self.max_abs_diff,
            "max_abs": self.max_abs,
            "states_equal": self.states_equal,
            "passed": self.passed,
        }


DEFAULT_CHECK_SHAPES = ((1, 1, 1), (1, 7, 1), (2, 5, 3), (3, 1, 4))


def _session(path: str) -> ort.InferenceSession:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # fatal only: the error is in the exception
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def verify_split(
    joint_path: str,
    decoder_path: str,
    joiner_path: str,
    *,
    vocab_size: int = 2,
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_CHECK_SHAPES,
    seed: int = 0,
) -> SplitCheck:
    """Run the joint model and decoder -> joiner on the same random inputs; compare.

    Targets are drawn from ``[0, vocab_size)``; states and encoder frames are standard normal.
    """
    joint, decoder, joiner = _session(joint_path), _session(decoder_path), _session(joiner_path)
    joint_inputs = joint.get_inputs()
    encoder_dim = joint_inputs[0].shape[1]
    rng = np.random.default_rng(seed)
    worst = scale = 0.0
    states_equal = True
    for batch, frames, tokens in shapes:
        encoder = rng.standard_normal((batch, int(encoder_dim), frames)).astype(np.float32)
        targets = rng.integers(0, vocab_size, (batch, tokens))
        lengths = np.full((batch,), tokens)
        states = [
            rng.standard_normal(_state_shape(arg.shape, batch)).astype(np.float32) for arg in joint_inputs[3:]
        ]
        joint_feeds = {
            joint_inputs[0].name: encoder,
            joint_inputs[1].name: targets.astype(_np_type(joint_inputs[1].type)),
            joint_inputs[2].name: lengths.astype(_np_type(joint_inputs[2].type)),
            **{arg.name: s for arg, s in zip(joint_inputs[3:], states, strict=True)},
        }
        expected = joint.run(None, joint_feeds)
        dec_inputs = decoder.get_inputs()
        dec_feeds = {
            dec_inputs[0].name: targets.astype(np.int32),
            dec_inputs[1].name: lengths.astype(np.int32),
            **{arg.name: s for arg, s in zip(dec_inputs[2:], states, strict=True)},
        }
        dec_out = decoder.run(None, dec_feeds)
        join_inputs = joiner.get_inputs()
        (logits,) = joiner.run(None, {join_inputs[0].name: encoder, join_inputs[1].name: dec_out[0]})
        if logits.shape != expected[0].shape:
            raise InputError(f"the joiner's output has shape {logits.shape}, the joint's {expected[0].shape}")
        worst = max(worst, float(np.max(np.abs(logits.astype(np.float64) - expected[0]))))
        scale = max(scale, float(np.max(np.abs(expected[0]))))
        for got, want in zip(dec_out[1:], expected[1:], strict=True):
            states_equal &= got.shape == want.shape and bool(np.array_equal(got.astype(want.dtype), want))
    return SplitCheck(list(shapes), worst, scale, states_equal)


def _state_shape(shape: Sequence[object], batch: int) -> tuple[int, ...]:
    dims = []
    for i, dim in enumerate(shape):
        if isinstance(dim, int):
            dims.append(dim)
        elif i == 1:
            dims.append(batch)
        else:
            raise InputError(f"decoder_joint state has a dynamic size on axis {i}: {list(shape)}")
    return tuple(dims)


def _np_type(onnx_type: str) -> type[np.generic]:
    return np.int32 if onnx_type == "tensor(int32)" else np.int64
