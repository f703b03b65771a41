"""Apply rewrite plans: replace each planned Conv by its MatMul form.

Each planned Conv becomes, in channels-last layout::

    Transpose(perm=[0, 2, ..., 1]) -> [Pad] -> [Slice(steps=strides)]
        -> MatMul(x, Wt) -> [Add(bias)] -> Transpose(perm=[0, r-1, 1, ...])
        -> [Add(Z)] -> [activation]

``Wt`` is a 2-D constant initializer ``[C, M]`` (the weight ``[M, C, 1...]``
reshaped and transposed), created lazily so that nothing is read until saving.
A weight shared by several convs gets one ``Wt``. A grouped conv (``group`` g) has
``Split(last axis, g) -> g x MatMul(·, Wt_i [C/g, M/g]) -> Concat(last axis)`` in place of
the MatMul. A FusedConv's input Z and activation come after the Transpose back, where
a Conv's activation would be in a model (``_fused.py``). Every node created for a conv is marked
(:func:`mark_created`): the cleanup touches only Transpose chains that hold one of them.
A Gemm's plan is applied by :func:`apply_gemm` (below), with the same store
of weights.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import NameAllocator, is_external, mark_created
from onnx_conv2matmul.rewrite import fused as _fused
from onnx_conv2matmul.rewrite.analysis import Plan
from onnx_conv2matmul.rewrite.gemm import GemmPlan
from onnx_conv2matmul.rewrite.layout import channels_last_perms
from onnx_conv2matmul.rewrite.weights import constant_tensor

_INT64_MAX = np.iinfo(np.int64).max
MIN_OPSET_SPLIT_NUM_OUTPUTS = 18


def transpose_2d(array: np.ndarray) -> np.ndarray:
    """``array.T`` as a new C-contiguous array, copied in row blocks.

    Copying blocks of rows keeps each write a full cache line, which is faster than
    ``np.ascontiguousarray(array.T)`` for large weights (see docs/performance.md).
    """
    rows, cols = array.shape
    out = np.empty((cols, rows), dtype=array.dtype)
    step = max(16, 64 // max(1, array.dtype.itemsize))
    for start in range(0, rows, step):
        out[:, start : start + step] = array[start : start + step].T
    return out


def _transposed_weight(
    tensor: ir.TensorProtocol, name: str, *, group: int = 1, index: int = 0
) -> ir.LazyTensor:
    """Group ``index`` of ``group`` of the weight ``[M, C/g, 1...]`` as a ``[C/g, M/g]`` matrix."""
    out_channels, in_channels = (int(d) for d in tensor.shape.numpy()[:2])
    rows = out_channels // group

    def materialize() -> ir.TensorProtocol:
        # One expression: no view of the source may outlive it, or it cannot be released.
        array = transpose_2d(
            tensor.numpy().reshape(out_channels, in_channels)[index * rows : (index + 1) * rows]
        )
        if is_external(tensor):
            # Unmap the source so its pages stop counting towards this process's memory:
            # weights are written one at a time and nothing is held after its write.
            tensor.release()
        return ir.tensor(array, name=name)

    return ir.LazyTensor(materialize, dtype=tensor.dtype, shape=ir.Shape([in_channels, rows]), name=name)


class Rewriter:
    """Applies plans to one model, sharing transposed weights between convs and Gemms."""

    def __init__(self, names: NameAllocator) -> None:
        self._names = names
        # Keyed by the weight, its form (transposed or not), its number of groups and the group.
        self._weights: dict[tuple[int, bool, int, int], ir.Value] = {}
        self.converted_weights: list[tuple[ir.Value, ir.Node | None]] = []

    @property
    def names(self) -> NameAllocator:
        return self._names

    def _weight_value(self, plan: Plan, index: int = 0) -> ir.Value:
        return self.matmul_weight(plan, transpose=True, index=index)

    def matmul_weight(self, plan: Plan | GemmPlan, *, transpose: bool, index: int = 0) -> ir.Value:
        """The 2-D initializer for a plan's MatMul, made once per weight, form and group.

        ``transpose``: the first two dims of the weight, transposed (lazily); else the
        weight's own tensor (a Gemm's ``B`` held in a Constant node). ``index``: the group
        of a grouped conv, whose rows of the weight it holds.
        """
        group = plan.group if isinstance(plan, Plan) else 1
        key = (id(plan.weight), transpose, group, index)
        if key in self._weights:
            return self._weights[key]
        base = plan.weight.name or f"{plan.entry.name or 'conv'}_weight"
        name = self._names.new(f"{base}_matmul" if group == 1 else f"{base}_matmul_group{index}")
        tensor: ir.TensorProtocol = plan.weight_tensor
        if transpose and group == 1:
            tensor = _transposed_weight(plan.weight_tensor, name)
        elif transpose:
            tensor = _transposed_weight(plan.weight_tensor, name, group=group, index=index)
        value = ir.Value(
            name=name,
            type=ir.TensorType(tensor.dtype),
            shape=ir.Shape([int(d) for d in tensor.shape.numpy()]),
            const_value=tensor,
        )
        plan.weight_owner.register_initializer(value)
        if not any(k[0] == key[0] for k in self._weights):
            self.converted_weights.append((plan.weight, plan.weight_constant_node))
        self._weights[key] = value
        return value

    def _const_value(self, base: str, what: str, array: np.ndarray) -> ir.Node:
        name = self._names.new(f"{base}/{what}")
        dtype = ir.DataType.from_numpy(array.dtype)
        out = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(array.shape))
        return ir.node(
            "Constant",
            [],
            {"value": ir.tensor(array, name=name)},
            outputs=[out],
            name=self._names.new(f"{base}/{what}_const"),
        )

    def _const_node(self, base: str, what: str, values: list[int]) -> ir.Node:
        return self._const_value(base, what, np.array(values, dtype=np.int64))

    def apply(self, plan: Plan | GemmPlan) -> None:
        if isinstance(plan, GemmPlan):
            apply_gemm(plan, self)
            return
        node = plan.node
        conv_out = node.outputs[0]
        base = node.name or (conv_out.name or "Conv")
        x = node.inputs[0]
        assert x is not None
        dtype = plan.weight_tensor.dtype
        rank = plan.spatial_rank + 2
        nodes: list[ir.Node] = []

        def value(what: str) -> ir.Value:
            return ir.Value(name=self._names.new(f"{base}/{what}"), type=ir.TensorType(dtype))

        def add(op: str, inputs: list[ir.Value | None], attrs: dict[str, object], what: str) -> ir.Value:
            out = value(what)
            nodes.append(
                ir.node(op, inputs, attrs, outputs=[out], name=self._names.new(f"{base}/{op}"))  # type: ignore[arg-type]
            )
            return out

        perm_in, perm_out = channels_last_perms(rank)
        h = add("Transpose", [x], {"perm": perm_in}, "channels_last")
        if any(plan.pads_begin) or any(plan.pads_end):
            pads = [0, *plan.pads_begin, 0, 0, *plan.pads_end, 0]
            if plan.opset >= 11:
                pads_node = self._const_node(base, "pads", pads)
                nodes.append(pads_node)
                h = add("Pad", [h, pads_node.outputs[0]], {"mode": "constant"}, "padded")
            else:
                h = add("Pad", [h], {"mode": "constant", "pads": pads, "value": 0.0}, "padded")
            plan.entry.extra_ops.append("Pad")
        if any(s != 1 for s in plan.strides):
            axes = [i + 1 for i, s in enumerate(plan.strides) if s != 1]
            steps = [s for s in plan.strides if s != 1]
            consts = [
                self._const_node(base, "slice_starts", [0] * len(axes)),
                self._const_node(base, "slice_ends", [int(_INT64_MAX)] * len(axes)),
                self._const_node(base, "slice_axes", axes),
                self._const_node(base, "slice_steps", steps),
            ]
            nodes.extend(consts)
            h = add("Slice", [h, *(c.outputs[0] for c in consts)], {}, "strided")
            plan.entry.extra_ops.append("Slice")
        if plan.group == 1:
            h = add("MatMul", [h, self._weight_value(plan)], {}, "matmul")
            plan.entry.matmul = nodes[-1].name
        else:
            h = self._grouped_matmul(plan, h, rank, nodes, add, value)
        if plan.bias is not None:
            h = add("Add", [h, plan.bias], {}, "biased")
        h = add("Transpose", [h], {"perm": perm_out}, "channels_first")
        if plan.sum_input is not None:
            # Read from the node: Z may be the output of a conv rewritten since the analysis.
            h = add("Add", [h, _fused.sum_input(node)], {}, "summed")
        if plan.activation is not None:
            act = plan.activation
            inputs: list[ir.Value | None] = [h]
            if act.op_type == "Clip" and plan.opset >= _fused.MIN_OPSET_CLIP_INPUTS:
                for what, bound in zip(("clip_min", "clip_max"), act.params, strict=True):
                    nodes.append(self._const_value(base, what, np.array(bound, dtype=dtype.numpy())))
                    inputs.append(nodes[-1].outputs[0])
            h = add(act.op_type, inputs, dict(_fused.activation_attributes(act, plan.opset)), "activated")
            plan.entry.extra_ops.append(act.op_type)

        # The last value takes over the conv output's name, type, shape and uses.
        h.shape = None  # the conv output's shape, when it has one, is taken over
        for created in nodes:
            mark_created(created)
        ir.convenience.replace_nodes_and_values(plan.graph, node, [node], nodes, [conv_out], [h])

    def _grouped_matmul(
        self,
        plan: Plan,
        h: ir.Value,
        rank: int,
        nodes: list[ir.Node],
        add: Callable[[str, list[ir.Value | None], dict[str, object], str], ir.Value],
        value: Callable[[str], ir.Value],
    ) -> ir.Value:
        """``Split(last axis) -> one MatMul per group -> Concat(last axis)`` on channels-last ``h``.

        Chosen by latency against the grouped Conv (``benchmarks/bench_grouped.py``): as fast
        as one Slice per group, in one node instead of g and their constants.
        """
        base = plan.node.name or (plan.node.outputs[0].name or "Conv")
        attrs: dict[str, object] = {"axis": rank - 1}
        if plan.opset >= MIN_OPSET_SPLIT_NUM_OUTPUTS:
            attrs["num_outputs"] = plan.group  # required from opset 18 when no sizes are given
        parts = [value(f"group{i}") for i in range(plan.group)]
        nodes.append(ir.node("Split", [h], attrs, outputs=parts, name=self._names.new(f"{base}/Split")))  # type: ignore[arg-type]
        products: list[ir.Value | None] = []
        for index, part in enumerate(parts):
            products.append(add("MatMul", [part, self._weight_value(plan, index)], {}, f"matmul{index}"))
            if index == 0:
                plan.entry.matmul = nodes[-1].name
        out = add("Concat", products, {"axis": rank - 1}, "matmul")
        plan.entry.extra_ops.extend(["Split", "Concat"])
        return out


def _scalar(rewriter: Rewriter, base: str, what: str, value: float, dtype: ir.DataType) -> ir.Node:
    name = rewriter.names.new(f"{base}/{what}")
    tensor = ir.tensor(np.array(value, dtype=dtype.numpy()), dtype=dtype, name=name)
    out = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([]))
    const_name = rewriter.names.new(f"{base}/{what}_const")
    return ir.node("Constant", [], {"value": tensor}, outputs=[out], name=const_name)


def apply_gemm(plan: GemmPlan, rewriter: Rewriter) -> None:
    """Replace ``plan.node`` by its MatMul form (see the module's docstring)."""
    node = plan.node
    gemm_out = node.outputs[0]
    base = node.name or (gemm_out.name or "Gemm")
    dtype = plan.weight_tensor.dtype
    nodes: list[ir.Node] = []

    def add(op: str, inputs: list[ir.Value | None], attrs: dict[str, object], what: str) -> ir.Value:
        out = ir.Value(name=rewriter.names.new(f"{base}/{what}"), type=ir.TensorType(dtype))
        nodes.append(
            ir.node(op, inputs, attrs, outputs=[out], name=rewriter.names.new(f"{base}/{op}"))  # type: ignore[arg-type]
        )
        return out

    h = node.inputs[0]
    if plan.trans_a:
        h = add("Transpose", [h], {"perm": [1, 0]}, "a_transposed")
        mark_created(nodes[-1])  # the cleanup may cancel it against a Transpose above
        plan.entry.extra_ops.append("Transpose")
    # An initializer read as it is feeds the MatMul itself: nothing is copied.
    stored = plan.stored_form is not None
    weight = rewriter.matmul_weight(plan, transpose=plan.trans_b) if stored else plan.weight
    h = add("MatMul", [h, weight], {}, "matmul")
    plan.entry.matmul = nodes[-1].name
    if plan.alpha != 1:
        alpha = _scalar(rewriter, base, "alpha", plan.alpha, dtype)
        nodes.append(alpha)
        h = add("Mul", [h, alpha.outputs[0]], {}, "scaled")
        plan.entry.extra_ops.append("Mul")
    if plan.c is not None:
        c: ir.Value = plan.c
        if plan.beta != 1:
            beta = _scalar(rewriter, base, "beta", plan.beta, dtype)
            nodes.append(beta)
            c = add("Mul", [c, beta.outputs[0]], {}, "c_scaled")
            plan.entry.extra_ops.append("Mul")
        h = add("Add", [h, c], {}, "biased")
    unread_c = node.inputs[2] if len(node.inputs) > 2 and plan.c is None else None
    if unread_c is not None:
        # beta 0: a constant C nothing else reads is removed with the converted weights.
        found = constant_tensor(unread_c)
        rewriter.converted_weights.append((unread_c, found[1] if found is not None else None))
    assert h is not None
    h.shape = None  # the Gemm output's shape, when it has one, is taken over
    ir.convenience.replace_nodes_and_values(plan.graph, node, [node], nodes, [gemm_out], [h])
