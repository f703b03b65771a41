"""Apply rewrite plans: replace each planned Conv by its MatMul form.

Each planned Conv becomes, in channels-last layout::

    Transpose(perm=[0, 2, ..., 1]) -> [Pad] -> [Slice(steps=strides)]
        -> MatMul(x, Wt) -> [Add(bias)] -> Transpose(perm=[0, r-1, 1, ...])

``Wt`` is a 2-D constant initializer ``[C, M]`` (the weight ``[M, C, 1...]``
reshaped and transposed), created lazily so that nothing is read until saving.
A weight shared by several convs gets one ``Wt``. Every node created for a conv is marked
(:func:`mark_created`): the cleanup touches only Transpose chains that hold one of them.
A Gemm's plan is applied by :func:`~onnx_conv2matmul.gemm.apply_gemm`, with the same store
of weights.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import NameAllocator, is_external, mark_created
from onnx_conv2matmul._layout import channels_last_perms
from onnx_conv2matmul.analysis import Plan
from onnx_conv2matmul.gemm import GemmPlan, apply_gemm

_INT64_MAX = np.iinfo(np.int64).max


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


def _transposed_weight(tensor: ir.TensorProtocol, name: str) -> ir.LazyTensor:
    out_channels, in_channels = (int(d) for d in tensor.shape.numpy()[:2])

    def materialize() -> ir.TensorProtocol:
        array = transpose_2d(tensor.numpy().reshape(out_channels, in_channels))
        if is_external(tensor):
            # Unmap the source so its pages stop counting towards this process's memory:
            # weights are written one at a time and nothing is held after its write.
            tensor.release()
        return ir.tensor(array, name=name)

    return ir.LazyTensor(
        materialize, dtype=tensor.dtype, shape=ir.Shape([in_channels, out_channels]), name=name
    )


class Rewriter:
    """Applies plans to one model, sharing transposed weights between convs and Gemms."""

    def __init__(self, names: NameAllocator) -> None:
        self._names = names
        self._weights: dict[tuple[int, bool], ir.Value] = {}
        self.converted_weights: list[tuple[ir.Value, ir.Node | None]] = []

    @property
    def names(self) -> NameAllocator:
        return self._names

    def _weight_value(self, plan: Plan) -> ir.Value:
        return self.matmul_weight(plan, transpose=True)

    def matmul_weight(self, plan: Plan | GemmPlan, *, transpose: bool) -> ir.Value:
        """The 2-D initializer for a plan's MatMul, made once per weight and form.

        ``transpose``: the first two dims of the weight, transposed (lazily); else the
        weight's own tensor (a Gemm's ``B`` held in a Constant node).
        """
        key = (id(plan.weight), transpose)
        if key in self._weights:
            return self._weights[key]
        base = plan.weight.name or f"{plan.entry.name or 'conv'}_weight"
        name = self._names.new(f"{base}_matmul")
        dims = [int(d) for d in plan.weight_tensor.shape.numpy()]
        value = ir.Value(
            name=name,
            type=ir.TensorType(plan.weight_tensor.dtype),
            shape=ir.Shape(dims[1::-1] if transpose else dims),
            const_value=_transposed_weight(plan.weight_tensor, name) if transpose else plan.weight_tensor,
        )
        plan.weight_owner.register_initializer(value)
        self._weights[key] = value
        self.converted_weights.append((plan.weight, plan.weight_constant_node))
        return value

    def _const_node(self, base: str, what: str, values: list[int]) -> ir.Node:
        name = self._names.new(f"{base}/{what}")
        tensor = ir.tensor(np.array(values, dtype=np.int64), name=name)
        out = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([len(values)]))
        return ir.node(
            "Constant",
            [],
            {"value": tensor},
            outputs=[out],
            name=self._names.new(f"{base}/{what}_const"),
        )

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
        weight = self._weight_value(plan)
        h = add("MatMul", [h, weight], {}, "matmul")
        plan.entry.matmul = nodes[-1].name
        if plan.bias is not None:
            h = add("Add", [h, plan.bias], {}, "biased")
        h = add("Transpose", [h], {"perm": perm_out}, "channels_first")

        # The last value takes over the conv output's name, type, shape and uses.
        h.shape = None  # the conv output's shape, when it has one, is taken over
        for created in nodes:
            mark_created(created)
        ir.convenience.replace_nodes_and_values(plan.graph, node, [node], nodes, [conv_out], [h])
