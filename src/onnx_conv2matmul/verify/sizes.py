"""The bytes of a run's inputs and outputs, for any values of the dims.

Inputs from their shapes; outputs from the shapes the model declares, with the run's dim values
put in (a name, or an expression of names as exporters write them, ``((time - 1)//8) + 1``). An
output whose size the declaration does not give is measured: the original runs once with small
values and once more with each dim doubled, and each axis is extrapolated from those runs (see
:class:`Growth`: ``T // 8 + 1``, ``T * U``, ``T + U`` are exact). The plan
(:mod:`~onnx_conv2matmul.verify.plan`) fits the runs to the memory budget with these sizes.
"""

# pragma: no mutate start
from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.verify.roles import InputSpec, Roles

STRING_BYTES = 64
"""What one element of a string output is taken to cost (a Python object per element)."""

_ITEMSIZE = {
    "float": 4,
    "float16": 2,
    "double": 8,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "string": STRING_BYTES,
}


@dataclasses.dataclass(frozen=True)
class OutputDecl:
    """What a model declares of one output: its name, element size and shape.

    ``itemsize`` is None for a type whose size is not known; ``shape`` is None for an output
    that is not a tensor (a sequence, a map).
    """

    name: str
    itemsize: int | None
    shape: tuple[int | str | None, ...] | None


def output_decl(name: str, type_name: str, shape: Sequence[Any] | None) -> OutputDecl:
    """The declaration of an output from onnxruntime's ``NodeArg`` fields."""
    if type_name.startswith("tensor(") and shape is not None:
        element = type_name[len("tensor(") : -1]
        dims = tuple(d if isinstance(d, int | str) else None for d in shape)
        return OutputDecl(name, _ITEMSIZE.get(element), dims)
    return OutputDecl(name, None, None)


_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def eval_dim(text: str, values: Mapping[str, int]) -> int | None:
    """The value of a dim written as an integer expression of dim names, or None.

    Takes names, integers, ``+ - * // %``, unary minus and ``max``/``min`` (also spelt
    ``Max``/``Min``), as exporters write output dims; anything else is None.
    """
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            return int(values[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = value(node.right)
            if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](value(node.left), right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id.lower() in ("max", "min")
            and node.args
            and not node.keywords
        ):
            pick = max if node.func.id.lower() == "max" else min
            return pick(value(arg) for arg in node.args)
        raise ValueError("not an integer expression of dim names")

    try:
        return value(tree.body)
    except (ValueError, RecursionError):
        return None


def declared_bytes(decl: OutputDecl, values: Mapping[str, int]) -> int | None:
    """The output's bytes from its declaration with ``values`` put in, or None when unknown."""
    if decl.shape is None or decl.itemsize is None:
        return None
    size = decl.itemsize
    for dim in decl.shape:
        if isinstance(dim, int) and dim >= 0:
            size *= dim
        elif isinstance(dim, str):
            found = values[dim] if dim in values else eval_dim(dim, values)
            if found is None:
                return None
            size *= max(found, 0)
        else:
            return None
    return size


@dataclasses.dataclass(frozen=True)
class Growth:
    """How a size grows with the dims, from a base run and one run per dim with that dim doubled.

    Per dim, what doubling it did to the size says how the size depends on it: doubled
    exactly, in proportion (``T * U``, ``T // 8`` from a base divisible by 8); more than
    doubled, a power (``T**2``); less, an affine term (``T // 8 + 1``, ``T + U``, ``T - 8``).
    The size is ``(base + sum of the affine terms) * product of the proportions and powers``,
    which is exact for all of these and for their products, never below 0.
    """

    base: float
    base_values: Mapping[str, int]
    varied: Mapping[str, tuple[int, float]]
    """Per dim: its value in the varied run and the size there."""

    def at(self, values: Mapping[str, int]) -> int:
        offset = self.base
        factor = 1.0
        for key, (moved, size) in self.varied.items():
            start = self.base_values[key]
            target = values.get(key, start)
            ratio = size / self.base if self.base > 0 else 0.0
            steps = math.log(target / start) / math.log(moved / start) if target > 0 else -math.inf
            if self.base > 0 and ratio >= moved / start:
                factor *= ratio**steps if target > 0 else 0.0
            else:
                offset += (size - self.base) * (target - start) / (moved - start)
        return max(0, math.ceil(round(offset * factor, 6)))


@dataclasses.dataclass(frozen=True)
class MeasuredOutput:
    """An output whose size was measured: per axis (tensors) or its bytes (anything else)."""

    itemsize: int
    axes: tuple[Growth, ...] | None
    total: Growth | None

    def bytes(self, values: Mapping[str, int]) -> int:
        if self.axes is not None:
            return self.itemsize * math.prod(axis.at(values) for axis in self.axes)
        assert self.total is not None
        return self.total.at(values)


def value_bytes(value: Any) -> int:
    """The bytes of an output as onnxruntime returns it (strings at :data:`STRING_BYTES` each)."""
    if isinstance(value, np.ndarray):
        return int(value.size * STRING_BYTES) if value.dtype == object else int(value.nbytes)
    if isinstance(value, list | tuple):
        return sum(value_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(value_bytes(v) for v in value.values()) + STRING_BYTES * len(value)
    return STRING_BYTES


def measure(
    base_values: Mapping[str, int],
    base: Sequence[Any],
    varied: Mapping[str, tuple[Mapping[str, int], Sequence[Any]]],
) -> list[MeasuredOutput]:
    """Each output's growth from the outputs of a base run and of one run per dim doubled."""
    measured = []
    for index, ref in enumerate(base):
        same_rank = isinstance(ref, np.ndarray) and all(
            isinstance(outs[index], np.ndarray) and outs[index].ndim == ref.ndim
            for _, outs in varied.values()
        )
        if same_rank and ref.dtype != object:
            axes = tuple(
                Growth(
                    float(ref.shape[axis]),
                    dict(base_values),
                    {k: (vals[k], float(outs[index].shape[axis])) for k, (vals, outs) in varied.items()},
                )
                for axis in range(ref.ndim)
            )
            measured.append(MeasuredOutput(ref.itemsize, axes, None))
        else:
            total = Growth(
                float(value_bytes(ref)),
                dict(base_values),
                {k: (vals[k], float(value_bytes(outs[index]))) for k, (vals, outs) in varied.items()},
            )
            measured.append(MeasuredOutput(1, None, total))
    return measured


@dataclasses.dataclass
class OutputSizes:
    """The outputs' bytes of a model for any dim values: declared, or measured where not."""

    decls: list[OutputDecl]
    measured: list[MeasuredOutput] | None = None
    how: str = "declared shapes"
    per_input_byte: float = 0.0
    """With real inputs: the bytes of the outputs the declarations leave unknown, per input byte."""

    def unknown(self, values: Mapping[str, int]) -> list[str]:
        """The outputs whose size the declarations do not give for ``values``."""
        return [d.name for d in self.decls if declared_bytes(d, values) is None]

    def bytes(self, values: Mapping[str, int]) -> int:
        total = 0
        for index, decl in enumerate(self.decls):
            found = declared_bytes(decl, values)
            if found is None and self.measured is not None:
                found = self.measured[index].bytes(values)
            total += found or 0
        return total


def input_bytes(specs: Sequence[InputSpec], roles: Roles, values: Mapping[str, int]) -> int:
    return sum(np.dtype(spec.dtype).itemsize * math.prod(roles.shape(spec.name, values)) for spec in specs)


# pragma: no mutate end
