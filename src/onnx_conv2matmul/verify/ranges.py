"""The values a model's float inputs take, where its own first op on them says so (a ``Clip``
with constant bounds, a division by 255): synthesised inputs are drawn from that range."""

# pragma: no mutate start
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_RANGE_READ_LIMIT = 64 * 2**20
"""Value ranges are read from ``.onnx`` files up to this size (weights inside are parsed too)."""


def input_value_ranges(path: str) -> dict[str, tuple[float, float, str]]:
    """The values float graph inputs take, where the model's first op on them says so.

    An input read only by a ``Clip`` with constant bounds takes values between them; one read
    only by a division by 255 (or a multiplication by 1/255) holds pixel values, 0 to 255.
    Synthesising such inputs as standard normal values would check the model on inputs it
    never sees (clipped to a constant, or pixels around 0). Models whose ``.onnx`` file is
    above :data:`_RANGE_READ_LIMIT` are not read (weights inside would be parsed); nothing is
    found there, as for any other first op.
    """
    import onnx
    from onnx import numpy_helper

    try:
        if os.path.getsize(path) > _RANGE_READ_LIMIT:
            return {}
        model = onnx.load(path, load_external_data=False)
    except Exception:  # unreadable here: onnxruntime reports it
        return {}
    graph = model.graph
    constants: dict[str, float] = {}
    for tensor in graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL and _is_scalar(tensor.dims):
            constants[tensor.name] = float(numpy_helper.to_array(tensor).reshape(()))
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            tensor = node.attribute[0].t
            if _is_scalar(tensor.dims) and tensor.data_location != onnx.TensorProto.EXTERNAL:
                constants[node.output[0]] = float(numpy_helper.to_array(tensor).reshape(()))
    initializers = {t.name for t in graph.initializer}
    ranges: dict[str, tuple[float, float, str]] = {}
    for graph_input in graph.input:
        name = graph_input.name
        if name in initializers or graph_input.type.tensor_type.elem_type not in _FLOAT_ELEM_TYPES:
            continue
        readers = [n for n in graph.node if name in n.input]
        found = {_first_op_range(n, name, constants) for n in readers} if readers else {None}
        if len(found) == 1 and (only := found.pop()) is not None:
            ranges[name] = only
    return ranges


_FLOAT_ELEM_TYPES = frozenset({1, 10, 11, 16})  # float, float16, double, bfloat16


def _is_scalar(dims: Sequence[int]) -> bool:
    return all(d == 1 for d in dims)


def _first_op_range(node: Any, name: str, constants: Mapping[str, float]) -> tuple[float, float, str] | None:
    """What ``node``, reading the graph input ``name``, says of its values (None: nothing)."""
    inputs = list(node.input)
    if node.domain not in ("", "ai.onnx") or not inputs or inputs[0] != name:
        return None
    if node.op_type == "Clip":
        bounds = {a.name: a.f for a in node.attribute if a.name in ("min", "max")}
        low = constants.get(inputs[1]) if len(inputs) > 1 and inputs[1] else bounds.get("min")
        high = constants.get(inputs[2]) if len(inputs) > 2 and inputs[2] else bounds.get("max")
        if low is not None and high is not None and np.isfinite(low) and np.isfinite(high) and low < high:
            return float(low), float(high), "the model clips it to that"
        return None
    operand = constants.get(inputs[1]) if len(inputs) > 1 else None
    if operand is None or operand == 0:
        return None
    divisor = operand if node.op_type == "Div" else 1 / operand if node.op_type == "Mul" else None
    if divisor is not None and 250 <= divisor <= 256:
        return 0.0, 255.0, "pixel values: the model divides it by 255"
    return None


# pragma: no mutate end
