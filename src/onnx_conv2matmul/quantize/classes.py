"""Classes of layers, measured: the decide stage's correction of predicted sensitivity by where a
layer sits in the graph.

The predicted error of a MatMul (:mod:`onnx_conv2matmul.quantize.sensitivity`) is its own output's
relative error. What that error does to the model's output depends on what follows it, and that
the prediction cannot see: on the Parakeet-shaped encoder every layer predicts about the same
relative error (0.0044 at int4), while quantized alone, the attention's value and output
projections cost the output about 0.02 of the limit each and its query, key and positional ones
nothing measurable (the attention's softmax absorbs them). Ranked by prediction, the mix put
queries and keys in float and missed; ranked by measurement, five layers in float met the floor.

Layers that play the same part in a repeated block share a class: the same weight shape, the
same op producing their input and the same ops after their output, a few steps deep
(:func:`classes`). When the uniform candidate misses, each class is quantized alone at the uniform
setting (every other layer in float) and checked on the smallest inputs, and :func:`calibrate`
scales each class's predicted errors to its measured loss, keeping their total. Only a model of
repeated blocks is measured (:data:`MIN_LAYERS_PER_CLASS`), of at most :data:`MAX_CLASSES`
classes (what they cost is bounded by the model's structure, not by a clock, so the mix does not
change with the machine's load); otherwise the prediction is used as it is.

The classes are measured as one model (:func:`switched_model`): each layer of every class is an
``If`` on a flag of its class, MatMulNBits in one branch and the float MatMul in the other, so that
one build and one onnxruntime session serve every class, a run per class with its flag alone set.
Built apart, each class cost a load and rewrite of the input, a session and a run: on the
Parakeet-shaped encoder, 13 classes took 19 s, of which the runs were 7 s. Each flag is a bool
scalar input of its own; a run feeds all of them, the class's true and the others false, so every
layer not of the class computes in float from the same weights as the original's. Only the main
graph's MatMuls are switched: a class with a layer in a subgraph, or one the quantizer declined,
leaves the classes to be built apart (:func:`switched_model` gives None).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul.quantize.projection import constant_2d_weight, quantizable_matmuls

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.blockwise import BlockCache
    from onnx_conv2matmul.quantize.decide import Sensitivity
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.quantize.reference import Reference
    from onnx_conv2matmul.quantize.settings import QuantizeOptions

DEPTH = 5
"""How many steps after a MatMul's output its class's signature looks (at 3, the encoder's key and
value projections fell into one class; at 5, each role of its blocks has its own)."""

MAX_CLASSES = 16
"""At most this many classes are measured (a run of each on the smallest inputs): the bound of
what they cost, which depends on no clock (the same model gets the same mix on a loaded machine
as on a quiet one). The Parakeet-shaped encoder has 13: 7.7 s on a 2-core EPYC in one switched
session (:func:`switched_model`; 19.3 s built apart), against 10.1 s for the
uniform candidate's build and check, for a result of 0.144x fp32 instead of 0.202x."""

CACHE_VERSION = 1
"""Of the cache files of the classes' losses (``class-losses/`` in the cache folder)."""
MAX_FEEDS = 8
"""A class is checked on at most this many of the smallest inputs (``--inputs`` of one size)."""

GAIN_FLOOR = 0.05
"""A class's errors are scaled by at least this: one that measured no loss on the smallest inputs
still ranks its layers among themselves, and a second mix can still move them."""

MIN_LAYERS_PER_CLASS = 4.0
"""The classes are measured only when they hold this many layers each on average: a model of
repeated blocks. Where most classes are one layer (a small CNN, PP-OCRv4's recognizer), a class's
loss is one layer's, and the losses did not add up: on that recognizer's real lines the classes'
losses summed to the uniform candidate's (4.06 against 3.99), yet the mix they chose, predicted at
0.9 of the limit, measured 1.32, and the second mix kept one layer of ten in int4 (0.99x), where
the prediction alone met the floor at 0.73x."""


@dataclasses.dataclass
class ClassLoss:
    """One class: its layers, their predicted error at the uniform setting, and the loss measured
    with only them quantized (None: not measured)."""

    names: list[str]
    predicted: float
    measured: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "first": self.names[0],
            "layers": len(self.names),
            "predicted_error": self.predicted,
            "measured_loss": self.measured
            if self.measured is not None and math.isfinite(self.measured)
            else None,
        }


def classes(model: ir.Model, names: Sequence[str], depth: int = DEPTH) -> list[list[str]]:
    """``names`` (quantizable MatMuls) grouped by signature: the weight's shape, the op that
    produces the input A and the ops (with the input slot they take it at) ``depth`` steps after
    the output. In graph order of each class's first layer."""
    wanted = set(names)
    groups: dict[tuple[Any, ...], list[str]] = {}
    seen: set[str] = set()
    for _, node, b in quantizable_matmuls(model):
        name = node.name or ""
        if name not in wanted or name in seen:
            continue
        seen.add(name)
        shape = tuple(int(d) for d in b.const_value.shape.numpy())  # type: ignore[union-attr]
        a = node.inputs[0]
        producer = None if a is None else a.producer()
        key = (shape, "input" if producer is None else producer.op_type, _after(node.outputs[0], depth))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _after(value: ir.Value, depth: int) -> tuple[tuple[str, ...], ...]:
    """The ops that consume ``value`` and what follows them, level by level (``op:slot``)."""
    levels: list[tuple[str, ...]] = []
    front = [value]
    visited: set[int] = set()
    for _ in range(depth):
        level: set[str] = set()
        following: list[ir.Value] = []
        for current in front:
            for use in current.uses():
                level.add(f"{use.node.op_type}:{use.idx}")
                if id(use.node) not in visited:
                    visited.add(id(use.node))
                    following.extend(out for out in use.node.outputs if out is not None)
        if not level:
            break
        levels.append(tuple(sorted(level)))
        front = following
    return tuple(levels)


def not_worth_measuring(groups: Sequence[ClassLoss]) -> str:
    """Why the classes are not measured, in words; empty when they are worth it: more than one,
    at most :data:`MAX_CLASSES`, of :data:`MIN_LAYERS_PER_CLASS` layers each on average."""
    layers = sum(len(group.names) for group in groups)
    if len(groups) < 2:
        return f"{len(groups)} class of {layers} layers: nothing to tell apart"
    if len(groups) > MAX_CLASSES:
        return f"{len(groups)} classes of {layers} layers: not measured (more than {MAX_CLASSES})"
    if layers < MIN_LAYERS_PER_CLASS * len(groups):
        return (
            f"{len(groups)} classes of {layers} layers: not measured (fewer than"
            f" {MIN_LAYERS_PER_CLASS:g} layers a class on average)"
        )
    return ""


def losses_of(sens: Sensitivity, groups: Sequence[Sequence[str]]) -> list[ClassLoss]:
    """The classes with their predicted error at the uniform setting, the largest first."""
    by_name = {node.name: node for node in sens.nodes}
    found = [
        ClassLoss(list(names), sum(by_name[n].options[sens.uniform[n]][0] for n in names))
        for names in groups
        if names and all(n in by_name and n in sens.uniform for n in names)
    ]
    return sorted((c for c in found if math.isfinite(c.predicted)), key=lambda c: -c.predicted)


def calibrate(sens: Sensitivity, measured: Sequence[ClassLoss]) -> bool:
    """Scale each measured class's predicted errors (every option of each of its layers) so that
    the classes' errors are in proportion to their measured losses, their total kept (so the line
    through the uniform candidate, and the other weights' predicted error, keep their meaning).
    A class's gain is at least :data:`GAIN_FLOOR` (the total then grows by that much). Whether
    anything was scaled (not when a loss is missing or not finite, or none is above zero)."""
    if not measured or any(c.measured is None or not math.isfinite(c.measured) for c in measured):
        return False
    total_loss = sum(max(0.0, c.measured or 0.0) for c in measured)
    total_predicted = sum(c.predicted for c in measured)
    if total_loss <= 0 or total_predicted <= 0:
        return False
    by_name = {node.name: node for node in sens.nodes}
    for group in measured:
        if group.predicted <= 0:
            continue
        share = max(0.0, group.measured or 0.0) / total_loss
        gain = max(GAIN_FLOOR, share * total_predicted / group.predicted)
        for name in group.names:
            node = by_name[name]
            node.options = {s: (error * gain, size) for s, (error, size) in node.options.items()}
    return True


def measure(
    plan: QuantizePlan,
    quantize: QuantizeOptions,
    groups: Sequence[ClassLoss],
    reference: Reference,
    cache: BlockCache | None,
) -> str:
    """Each class's loss (into ``groups``) with only its layers quantized at their setting of
    ``quantize``, checked against ``reference`` on its smallest inputs (:func:`smallest_feeds`)
    in sessions that do not prepack (they open at once on the float weights where they lie).
    None is measured when the classes are not worth it (:func:`not_worth_measuring`); all are
    let go when one cannot be measured (onnxruntime cannot run it, or its loss is not finite) or
    memory runs out. What was done, in words."""
    from onnx_conv2matmul.errors import OutOfMemory
    from onnx_conv2matmul.quantize import build, check

    why_not = not_worth_measuring(groups)
    if why_not:
        return why_not
    floor = plan.verify.min_cosine
    assert floor is not None
    feeds = smallest_feeds(reference)[:MAX_FEEDS]
    layers = sum(len(group.names) for group in groups)
    kept = _kept_path(plan, quantize, groups, reference, feeds)
    when = _read_kept(kept, groups) if kept is not None else None
    if when is not None:
        return f"{len(groups)} classes of {layers} layers measured (their losses kept in the cache, {when})"
    session = _switched_session(plan, quantize, groups, cache)
    short = check.Runs(tuple(feeds), only=True)
    for done, group in enumerate(groups):
        plan.progress.phase(f"Deciding: measuring the classes of layers ({done + 1} of {len(groups)})")
        failure = ""
        try:
            if session is not None:
                flagged = Flagged(session, len(groups), done)
                checked = check.check(flagged, reference, plan.verify, runs=short)
                build.release_borrowed(session)  # the class's int4 blocks: the next class reads its own
            else:
                alone = quantize.only({name: quantize.setting_for(name) for name in group.names})
                candidate = build.build(plan, alone, cache)
                checked = check.check_model(plan, candidate.model, reference, runs=short)
                del candidate
            group.measured = checked.loss(floor)
            failure = checked.failure if checked.worst_cosine is None else ""
        except OutOfMemory:
            failure = "memory ran out"
        if failure or group.measured is None or not math.isfinite(group.measured):
            for other in groups:
                other.measured = None
            return (
                f"{len(groups)} classes of {layers} layers: not measured (the class of {group.names[0]}:"
                f" {failure or 'no loss could be measured'})"
            )
    if kept is not None:
        _keep(kept, groups)
    return f"{len(groups)} classes of {layers} layers measured"


def _kept_path(
    plan: QuantizePlan,
    quantize: QuantizeOptions,
    groups: Sequence[ClassLoss],
    reference: Reference,
    feeds: Sequence[int],
) -> str | None:
    """The cache file of these classes' losses: keyed on the model's files, the rewrite, each
    class's layers and setting, the criterion, the inputs run, this CPU and onnxruntime's version;
    None when the cache is not to be read (``--no-bench-cache``) or the model is small
    (:data:`~onnx_conv2matmul.quantize.measure.CACHE_MIN_BYTES`). A loss kept can only change
    which layers the mix leaves in float: the mix is checked as always."""
    from onnx_conv2matmul.quantize.measure import keeps_figures, model_cache_file

    if not keeps_figures(plan):
        return None
    verify = plan.verify
    what = [
        CACHE_VERSION,
        repr(plan.convert),
        [[(name, quantize.setting_for(name).to_dict()) for name in group.names] for group in groups],
        [quantize.accuracy_level, quantize.algorithm, verify.min_cosine, repr(verify.labels)],
        [repr(verify.output_indices), verify.deterministic],
    ]
    arrays = [item for index in feeds for item in sorted(reference.feeds.feeds[index].items())]
    return model_cache_file("class-losses", plan.src, what, arrays)


def _read_kept(path: str, groups: Sequence[ClassLoss]) -> str | None:
    """Fill ``groups``' losses from the cache file at ``path``; when they were measured (None:
    nothing usable kept, and ``groups`` untouched)."""
    import json

    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        losses = [float(loss) for loss in data["losses"]]
        when = str(data["measured"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if len(losses) != len(groups) or not all(math.isfinite(loss) for loss in losses):
        return None
    for group, loss in zip(groups, losses, strict=True):
        group.measured = loss
    return when


def _keep(path: str, groups: Sequence[ClassLoss]) -> None:
    from onnx_conv2matmul.speed.costs import keep_cached, now_text

    keep_cached(path, {"measured": now_text(), "losses": [group.measured for group in groups]})


def _switched_session(
    plan: QuantizePlan, quantize: QuantizeOptions, groups: Sequence[ClassLoss], cache: BlockCache | None
) -> Any:
    """One session of every class behind its flag (:func:`switched_model`),
    opened without prepacking; None when the classes are to be built apart (a layer the switch
    does not take, or a model onnxruntime does not open)."""
    from onnx_conv2matmul.errors import OutOfMemory
    from onnx_conv2matmul.quantize.build import open_beside_input

    plan.progress.phase("Deciding: building the classes of layers")
    model = switched_model(plan, quantize, [group.names for group in groups], cache)
    if model is None:
        return None
    try:
        return open_beside_input(plan, model, prepack=False)
    except OutOfMemory:
        raise
    except Exception:  # built apart instead, as before the switch
        return None


def smallest_feeds(reference: Reference) -> list[int]:
    """The indices of the feeds of the fewest input bytes: the shortest length of synthesised
    inputs, or every sample of a set of inputs of one size (a class's loss is then the worst over
    them, as the criterion's is)."""
    from onnx_conv2matmul.verify.feeds import feed_bytes

    feeds = reference.feeds.feeds
    sizes = [feed_bytes(feed) for feed in feeds]
    least = min(sizes, default=0)
    return [i for i, size in enumerate(sizes) if size == least]


FLAG = "onnx_conv2matmul_class_{}"
"""The name of each class's flag input."""


def switched_model(
    plan: QuantizePlan, quantize: QuantizeOptions, groups: Sequence[Sequence[str]], cache: BlockCache | None
) -> ir.Model | None:
    """The input loaded (memory-mapped) and rewritten as the plan says, each layer of
    ``groups[i]`` quantized at its setting of ``quantize`` behind the flag input ``FLAG.format(i)``;
    None when a layer is not a main-graph MatMul the quantizer takes."""
    from onnx_conv2matmul.quantize.build import load_rewritten
    from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits

    model = load_rewritten(plan)
    names = [name for names in groups for name in names]

    def quantized(model: ir.Model) -> int:
        only = quantize.only({n: quantize.setting_for(n) for n in names})
        return quantize_matmul_nbits(model, only, cache=cache).quantized

    return model if switch_layers(model, groups, quantized) else None


def switch_layers(
    model: ir.Model, groups: Sequence[Sequence[str]], quantize: Callable[[ir.Model], int]
) -> bool:
    """Put each layer of ``groups[i]`` (main-graph MatMuls, by node name) behind the flag input
    ``FLAG.format(i)`` of ``model``: ``quantize(model)`` quantizes every one of them to
    MatMulNBits and says how many it did, and each becomes an ``If`` between that and its float
    MatMul. False (the model half-changed: let it go) when a layer is not a main-graph MatMul
    with a constant 2-D weight, or the quantizer did not take every one."""
    graph = model.graph
    index = {name: i for i, names in enumerate(groups) for name in names}
    originals: dict[str, tuple[ir.Value, str]] = {}
    for node in graph:
        if node.name in index and constant_2d_weight(node) is not None:
            weight = node.inputs[1]
            assert weight is not None and node.outputs[0].name is not None
            originals[node.name] = (weight, node.outputs[0].name)
    if len(originals) != len(index):
        return False  # a layer in a subgraph, or not a MatMul the quantizer takes
    if quantize(model) != len(index):
        return False
    flags = []
    for i in range(len(groups)):
        flag = ir.Value(name=FLAG.format(i), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        graph.inputs.append(flag)
        flags.append(flag)
    produced = {node.outputs[0].name: node for node in graph if node.op_type == "MatMulNBits"}
    for name, (weight, out_name) in originals.items():
        quantized = produced[out_name]
        _switch(graph, quantized, weight, flags[index[name]])
    return True


def _switch(graph: ir.Graph, quantized: ir.Node, weight: ir.Value, flag: ir.Value) -> None:
    """Replace ``quantized`` (a MatMulNBits node) by an ``If`` on ``flag``: the node itself in
    its then-branch, ``MatMul(A, weight)`` in its else-branch; the output keeps its name."""
    out = quantized.outputs[0]
    name = out.name
    a = quantized.inputs[0]
    assert name is not None and a is not None and weight.name is not None
    if weight.name not in graph.initializers:
        graph.register_initializer(weight)  # the quantizer let go of it: the float branch reads it
    as_int = ir.Value(name=f"{name}__int", type=out.type, shape=out.shape)
    inner = ir.Node(
        quantized.domain,
        quantized.op_type,
        list(quantized.inputs),
        [ir.AttrInt64(key, attr.as_int()) for key, attr in quantized.attributes.items()],
        outputs=[as_int],
        name=f"{quantized.name}__int",
    )
    as_float = ir.Value(name=f"{name}__float", type=out.type, shape=out.shape)
    plain = ir.Node("", "MatMul", [a, weight], outputs=[as_float], name=f"{name}__float")
    chosen = ir.Value(name=f"{name}__switched", type=out.type, shape=out.shape)
    switch = ir.Node(
        "",
        "If",
        [flag],
        [
            ir.AttrGraph("then_branch", ir.Graph([], [as_int], nodes=[inner], name=f"{name}__int")),
            ir.AttrGraph("else_branch", ir.Graph([], [as_float], nodes=[plain], name=f"{name}__float")),
        ],
        outputs=[chosen],
        name=f"{quantized.name}__switch",
    )
    graph.insert_after(quantized, [switch])
    ir.convenience.replace_all_uses_with(out, chosen, replace_graph_outputs=True)
    graph.remove(quantized, safe=True)
    out.name, chosen.name = f"{name}__replaced", name


class Flagged:
    """A session of a :func:`switched_model` that runs as the model of one class: each run is fed
    the class's flag true and the others false (a session as :func:`~onnx_conv2matmul.quantize.
    check.check` runs it)."""

    def __init__(self, session: Any, count: int, chosen: int) -> None:
        self.session = session
        self.flags = {FLAG.format(i): np.array(i == chosen) for i in range(count)}

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any], options: Any = None) -> Any:
        return self.session.run(names, {**feed, **self.flags}, options)
