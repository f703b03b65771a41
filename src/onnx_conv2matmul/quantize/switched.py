"""The classes' candidates as one model (see :mod:`onnx_conv2matmul.quantize.classes`): each layer of
every class is an ``If`` on a flag of its class, MatMulNBits in one branch and the float MatMul in
the other, so that one build and one onnxruntime session serve every class, a run per class with
its flag alone set.

Built apart, each class cost a load and rewrite of the input, a session and a run: on the
Parakeet-shaped encoder, 13 classes took 19 s, of which the runs were 7 s. Each flag is a bool
scalar input of its own; a run feeds all of them, the class's true and the others false, so every
layer not of the class computes in float from the same weights as the original's.

Only the main graph's MatMuls are switched: a class with a layer in a subgraph, or one the
quantizer declined, leaves the classes to be built apart (:func:`switched_model` gives None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul.quantize.projection import constant_2d_weight

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.blockwise import BlockCache
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.quantize.settings import QuantizeOptions

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
    graph = model.graph
    index = {name: i for i, names in enumerate(groups) for name in names}
    originals: dict[str, tuple[ir.Value, str]] = {}
    for node in graph:
        if node.name in index and constant_2d_weight(node) is not None:
            weight = node.inputs[1]
            assert weight is not None and node.outputs[0].name is not None
            originals[node.name] = (weight, node.outputs[0].name)
    if len(originals) != len(index):
        return None  # a layer in a subgraph, or not a MatMul the quantizer takes
    result = quantize_matmul_nbits(
        model, quantize.only({n: quantize.setting_for(n) for n in index}), cache=cache
    )
    if result.quantized != len(index):
        return None
    flags = []
    for i in range(len(groups)):
        flag = ir.Value(name=FLAG.format(i), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        graph.inputs.append(flag)
        flags.append(flag)
    produced = {node.outputs[0].name: node for node in graph if node.op_type == "MatMulNBits"}
    for name, (weight, out_name) in originals.items():
        quantized = produced[out_name]
        _switch(graph, quantized, weight, flags[index[name]])
    return model


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
