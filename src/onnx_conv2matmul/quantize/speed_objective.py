"""The speed side of the quantization choices: what each layer's precision costs on this CPU.

The costs come from :mod:`onnx_conv2matmul.speed.costs` (each kernel timed at the model's own
weight shapes and activation rows, cached per machine). This module turns them into decisions:

- :func:`model_layers`: the model's quantizable MatMuls, their weight shapes and their activation
  rows at the bench lengths, from shape inference on the rewritten graph (without its weights) at
  each length: a MatMul that replaced a convolution runs on the rows of its channels-last input
  (batch times every spatial dim), not on those of the original's NCHW value.
- :func:`rank_kernels`: the block size and accuracy level that make the model's MatMuls fastest
  (one setting for every layer), chosen before any quantization, so the model is quantized once.
- :class:`SpeedFilter`: the search's hook (:func:`onnx_conv2matmul.quantize.search.search`). It
  keeps the search from precisions that would slow the model: each layer counts at the slowest
  setting it is offered, and the model's MatMuls so counted (a layer's saving where that setting
  is faster than float taken off) cost at most the margin more than in float. Where they would
  not, the largest extras over float are refused first, one (layer, setting) at a time, and the
  refusals are weighed again on a second timing of the kernels refused and of float
  (:meth:`~onnx_conv2matmul.speed.costs.KernelCosts.confirm`, the faster of the two kept). A layer
  refused every setting stays float (more accuracy from float costs no speed there). A small
  layer's extra, microseconds that a timing's noise can flip, is never decisive alone: it counts
  against the model's time, not against its own (a rule on each layer's own ratio kept or refused
  such layers from one cold run to the next). A setting is not refused for being slower than
  another quantized one: that would trade size for speed layer by layer; the uniform setting's
  block size and level are chosen for speed (:func:`rank_kernels`), and the whole result is timed
  against the original.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.speed.choose import DEFAULT_MARGIN
from onnx_conv2matmul.speed.costs import FLOAT_KERNEL, Kernel, KernelCosts, Layer, model_cost, relative

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir


Shapes = Sequence[Mapping[str, Sequence[int]]]
"""The input shapes of each timed run: per input name, its dims."""


def rows_by_value(
    source: onnx.ModelProto, lengths: Sequence[int], shapes: Shapes | None = None
) -> dict[str, tuple[int, ...]]:
    """Per value of the model (a ModelProto such as :func:`weightless` gives): its rows
    (all dims but the last multiplied) in each run, by shape inference. A run's inputs have the
    ``shapes`` given (those the timing feeds); without them, batch 1 and every other symbolic
    input dim at the length. Values whose shape stays unknown are left out."""
    if shapes is not None:
        return rows_where(source, [_pinned(shape) for shape in shapes])

    def at(length: int) -> Callable[[Any], None]:
        def pin(graph: Any) -> None:
            initializers = {t.name for t in graph.initializer}
            for value in graph.input:
                if value.name in initializers:
                    continue
                for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                    if not dim.HasField("dim_value"):
                        dim.dim_value = 1 if axis == 0 else length

        return pin

    return rows_where(source, [at(length) for length in lengths])


def _pinned(shapes: Mapping[str, Sequence[int]]) -> Callable[[Any], None]:
    """A pin (see :func:`rows_where`) that gives the named graph inputs these dims."""

    def pin(graph: Any) -> None:
        for value in graph.input:
            if value.name not in shapes:
                continue
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(shapes[value.name]):
                continue
            for dim, size in zip(dims, shapes[value.name], strict=True):
                dim.Clear()
                dim.dim_value = int(size)

    return pin


def rows_where(base: onnx.ModelProto, pins: Sequence[Callable[[Any], None]]) -> dict[str, tuple[int, ...]]:
    """Per value of the model ``base`` (a :func:`weightless` proto): its rows (all dims but the
    last multiplied), by shape inference once per ``pin``, a function that fixes the input dims of
    a copy of the graph. Values whose shape stays unknown under any pin are left out."""
    import onnx

    found: dict[str, list[int | None]] = {}
    for index, pin in enumerate(pins):
        model = onnx.ModelProto()
        model.CopyFrom(base)
        pin(model.graph)
        inferred = _infer(model)
        if inferred is None:
            continue
        for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            dims = value.type.tensor_type.shape.dim
            rows: int | None = 1
            if not dims:
                rows = None
            for dim in list(dims)[:-1]:
                if not dim.HasField("dim_value") or rows is None:
                    rows = None
                    break
                rows *= dim.dim_value
            found.setdefault(value.name, [None] * len(pins))[index] = rows
    return {name: tuple(r for r in rows if r is not None) for name, rows in found.items() if None not in rows}


def _infer(model: Any) -> Any:
    """``model`` with its shapes inferred: by onnxruntime's symbolic shape inference, which follows
    the arithmetic of lengths (strided convolutions, reshapes), else by onnx's; None when both fail."""
    import onnx

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    except Exception:  # a tool of onnxruntime's that gives up on some graphs
        pass
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # the fallback rows then
        return None


WEIGHTLESS_BYTES = 1024
"""Initializers above this size are left out of :func:`weightless`'s proto (small ones stay: shapes
are computed from them)."""


def weightless(model: ir.Model) -> onnx.ModelProto:
    """``model`` (main graph and subgraphs as they are) as a ModelProto without its large weights:
    each main-graph initializer above :data:`WEIGHTLESS_BYTES` becomes a graph input of its type
    and shape, which is all shape inference needs of it, so a model of gigabytes serializes in a
    moment. ``model`` is left as it was, its initializers in their order (a weight whose value
    lacked its type or shape keeps them, as its tensor has them)."""
    import onnx_ir as ir

    graph = model.graph
    order = list(graph.initializers.values())
    large = [v for v in order if v.const_value is not None and v.const_value.nbytes > WEIGHTLESS_BYTES]
    kept = [(v, v.const_value) for v in large]
    inputs, listed = len(graph.inputs), {id(v) for v in graph.inputs}
    try:
        for value, tensor in kept:
            assert tensor is not None and value.name is not None
            value.shape = value.shape or ir.Shape(tensor.shape.numpy())
            value.dtype = value.dtype or tensor.dtype
            graph.initializers.pop(value.name)
            value.const_value = None
            if id(value) not in listed:  # an initializer that is also an input stays one input
                graph.inputs.append(value)
        return ir.serde.serialize_model(model)
    finally:
        while len(graph.inputs) > inputs:  # one by one: onnx-ir's list then marks each no longer an input
            graph.inputs.pop()
        for value, tensor in kept:
            value.const_value = tensor
        graph.initializers.clear()
        for value in order:
            assert value.name is not None
            graph.initializers[value.name] = value


def cached_rows(
    proto: onnx.ModelProto, lengths: Sequence[int], folder: str | None, shapes: Shapes | None = None
) -> dict[str, tuple[int, ...]]:
    """:func:`rows_by_value` of ``proto`` (a :func:`weightless` one), kept in ``folder`` (None: not
    kept) under the hash of the proto and the runs' lengths and shapes: shape inference of a large
    graph takes seconds, a second run nothing."""
    import hashlib
    import json
    import os

    if folder is None:
        return rows_by_value(proto, lengths, shapes)
    runs = json.dumps([list(lengths), None if shapes is None else [dict(s) for s in shapes]], sort_keys=True)
    digest = hashlib.sha256(proto.SerializeToString() + runs.encode()).hexdigest()[:32]
    path = os.path.join(folder, f"{digest}.json")
    try:
        with open(path, encoding="utf-8") as file:
            return {name: tuple(rows) for name, rows in json.load(file).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    found = rows_by_value(proto, lengths, shapes)
    from onnx_conv2matmul.speed.costs import keep_cached

    keep_cached(path, found)
    return found


def model_layers(
    model: ir.Model,
    lengths: Sequence[int],
    selects: Any = None,
    *,
    shapes: Shapes | None = None,
    cache: str | None = None,
) -> list[Layer]:
    """The quantizable MatMuls of ``model`` (an ``ir.Model``, rewritten) with their rows in a run
    at each of ``lengths``, whose inputs have ``shapes`` (see :func:`rows_by_value` and the
    module's description); ``selects(name)`` filters by name; ``cache``: a folder where the rows
    are kept (see :func:`cached_rows`)."""
    known = cached_rows(weightless(model), lengths, cache, shapes)
    return layers_at(model, known, tuple(lengths), selects)


def layers_at(
    model: Any, known: Mapping[str, tuple[int, ...]], default: tuple[int, ...], selects: Any = None
) -> list[Layer]:
    """The quantizable MatMuls of ``model`` with the rows ``known`` gives their input (a tensor
    name to one row count per timed input); a MatMul whose rows are not known takes the most
    common known rows, or ``default`` when none is known."""
    from onnx_conv2matmul.quantize.projection import quantizable_matmuls

    pending: list[tuple[str, int, int, tuple[int, ...] | None]] = []
    for _, node, b in quantizable_matmuls(model):
        name = node.name or ""
        if selects is not None and not selects(name):
            continue
        k, n = (int(d) for d in b.const_value.shape.numpy())  # type: ignore[union-attr]
        a = node.inputs[0]
        rows = known.get(a.name or "") if a is not None else None
        pending.append((name, k, n, rows))
    common = Counter(rows for *_, rows in pending if rows is not None).most_common(1)
    fallback = common[0][0] if common else default
    return [Layer(name, k, n, rows or fallback) for name, k, n, rows in pending]


@dataclasses.dataclass(frozen=True)
class RankedKernel:
    """One setting for every layer: its MatMuls' milliseconds per length, and against float."""

    kernel: Kernel
    cost_ms: tuple[float, ...]
    relative: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.kernel.bits,
            "block_size": self.kernel.block_size,
            "accuracy_level": self.kernel.accuracy_level,
            "cost_ms": list(self.cost_ms),
            "x_float": self.relative,
        }


def rank_kernels(
    costs: KernelCosts,
    layers: Sequence[Layer],
    block_sizes: Sequence[int],
    levels: Sequence[int],
    *,
    bits: int = 4,
    min_gain: float = 0.02,
) -> tuple[list[int], list[RankedKernel], tuple[float, ...]]:
    """Every (block size, level) with ``bits`` on every layer, most accurate first (small blocks,
    level 0), and the indices that each replaced the one before as the fastest
    (:func:`won_steps`: a later one must be faster by more than ``min_gain``), the last the one
    to use. Also the float MatMuls' cost."""
    kernels = [Kernel(bits, block, level) for block in block_sizes for level in levels]
    costs.prefetch(layers, [FLOAT_KERNEL, *kernels])
    floats = model_cost(costs, layers, FLOAT_KERNEL)
    ranked = []
    for block in block_sizes:
        for level in levels:
            kernel = Kernel(bits, block, level)
            cost = model_cost(costs, layers, kernel)
            ranked.append(RankedKernel(kernel, cost, relative(cost, floats)))
    return won_steps([r.relative for r in ranked], min_gain), ranked, floats


def won_steps(relatives: Sequence[float], min_gain: float) -> list[int]:
    """The indices that each replaced the one before as the fastest, in order from the first
    (the most accurate), each faster than the one it replaced by more than ``min_gain``; the
    last is the winner."""
    steps = [0]
    for index in range(1, len(relatives)):
        if relatives[index] < relatives[steps[-1]] * (1 - min_gain):
            steps.append(index)
    return steps


@dataclasses.dataclass
class SpeedFilter:
    """The search's hook: which settings each layer may take, given before any error is measured
    (:meth:`allowed`), so the search never measures, let alone spends accuracy on, a setting that
    float beats on speed by more than ``margin`` (see the module's description); it records why.

    ``block_sizes`` are those the kernel choice costed: the search's ladder takes them too
    (:meth:`ladder`), so a block size that runs faster on this CPU (256 on some) is a choice of
    every layer's, not only of the uniform setting's.
    """

    costs: KernelCosts
    layers: Mapping[str, Layer]
    accuracy_level: int
    margin: float = DEFAULT_MARGIN
    block_sizes: tuple[int, ...] = ()
    dropped: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Per setting label: the layers it was dropped from."""
    to_float: list[str] = dataclasses.field(default_factory=list)
    """Layers where even the smallest setting is slower than float: float only."""
    busy: bool = False
    """The kernels were timed on a busy machine: every setting was offered."""

    def kernel(self, setting: Any) -> Kernel:
        if setting.bits is None:
            return FLOAT_KERNEL
        return Kernel(setting.bits, setting.block_size, self.accuracy_level)

    def layer_cost(self, layer: Layer, setting: Any) -> float:
        cost = model_cost(self.costs, [layer], self.kernel(setting))
        return sum(cost)

    def ladder(self, base: Sequence[Any]) -> tuple[Any, ...]:
        """``base`` (the search's settings) with, for each of its bits and symmetries, the block
        sizes costed that it lacks; larger blocks first within each bits, as the ladder orders them."""
        settings = set(base)
        for setting in base:
            settings.update(dataclasses.replace(setting, block_size=b) for b in self.block_sizes)
        return tuple(sorted(settings, key=lambda s: (s.bits, -s.block_size, not s.symmetric)))

    def allowed(self, names: Sequence[str], ladder: Sequence[Any]) -> dict[str, tuple[Any, ...]]:
        """Per layer name, the settings of ``ladder`` it may take (a name without costs keeps the
        whole ladder). Each layer counts at the slowest setting it is offered: the model's MatMuls
        so counted (savings where that is faster than float taken off) stay within the margin of
        their time in float; where they would not, the largest extras over float are refused
        first, one (layer, setting) at a time, until they do (see the module's description)."""
        known = [self.layers[name] for name in names if name in self.layers]
        kernels = [FLOAT_KERNEL, *sorted({self.kernel(s) for s in ladder}, key=lambda k: k.key)]
        self.costs.prefetch([*self.layers.values()], kernels)
        if self.costs.busy:  # timings on a busy machine drop nothing (see KernelCosts.busy)
            self.busy = True
            return {name: tuple(ladder) for name in names}
        floats, extras = self._extras(known, ladder)
        refused = _refuse(extras, self.margin * sum(floats.values()))
        pairs = [(name, setting) for name, settings in refused.items() for setting in settings]
        # A refusal rests on a second timing of the kernels it refuses and of float, the faster
        # of the two kept; then the extras are weighed again.
        layers = [self.layers[name] for name in dict.fromkeys(name for name, _ in pairs)]
        refused_kernels = [FLOAT_KERNEL, *sorted({self.kernel(s) for _, s in pairs}, key=lambda k: k.key)]
        if pairs and self.costs.confirm(layers, refused_kernels):
            if self.costs.busy:
                self.busy = True
                return {name: tuple(ladder) for name in names}
            floats, extras = self._extras(known, ladder)
            refused = _refuse(extras, self.margin * sum(floats.values()))
        for name, settings in refused.items():
            for setting in sorted(settings, key=lambda s: s.label):
                self.dropped.setdefault(setting.label, []).append(name)
        found: dict[str, tuple[Any, ...]] = {}
        for name in names:
            if name not in self.layers:
                found[name] = tuple(ladder)
                continue
            found[name] = tuple(s for s in ladder if s not in refused[name])
            if not found[name]:
                self.to_float.append(name)
        self.costs.save()
        return found

    def _extras(
        self, known: Sequence[Layer], ladder: Sequence[Any]
    ) -> tuple[dict[str, float], dict[str, list[tuple[float, Any]]]]:
        """Every layer's float cost, and per layer of ``known`` each setting's cost over float,
        slowest first."""
        floats = {name: self.layer_cost(layer, _FloatSetting()) for name, layer in self.layers.items()}
        extras: dict[str, list[tuple[float, Any]]] = {}
        for layer in known:
            extras[layer.name] = sorted(
                ((self.layer_cost(layer, s) - floats[layer.name], s) for s in ladder),
                key=lambda x: (-x[0], x[1].label),
            )
        return floats, extras

    def __call__(self, nodes: Sequence[Any]) -> None:
        """Drop from nodes whose errors are already measured the settings :meth:`allowed` refuses."""
        ladder = sorted({s for node in nodes for s in node.options}, key=lambda s: s.label)
        allowed = self.allowed([node.name for node in nodes if node.options], ladder)
        for node in nodes:
            if node.name in allowed:
                for setting in [s for s in node.options if s not in allowed[node.name]]:
                    del node.options[setting]

    def to_dict(self) -> dict[str, Any]:
        return {
            "accuracy_level": self.accuracy_level,
            "margin": self.margin,
            "block_sizes": list(self.block_sizes),
            "dropped": {label: len(names) for label, names in sorted(self.dropped.items())},
            "float_only": list(self.to_float),
            "busy": self.busy,
        }

    def summary(self) -> str:
        """What the search was kept from trading, and why, in a sentence."""
        if self.busy and self.costs.waited is not None:
            from onnx_conv2matmul.speed.machine import busy_text

            return f"every setting offered to the search: {busy_text(self.costs.waited)}"
        if not self.dropped:
            return (
                "every setting offered to the search: on this CPU, each layer at its slowest, the"
                f" model's MatMuls cost at most {self.margin:.0%} more than in float"
            )
        parts = [f"{label} on {len(names)} layers" for label, names in sorted(self.dropped.items())]
        text = (
            "not offered to the search, as float runs faster on this CPU and together they would"
            f" slow the model's MatMuls by more than {self.margin:.0%} of float's time (more accuracy"
            " from float costs no speed there): " + ", ".join(parts)
        )
        if self.to_float:
            text += f"; {len(self.to_float)} layers run fastest in float and stay float"
        return text


def _refuse(extras: Mapping[str, Sequence[tuple[float, Any]]], budget: float) -> dict[str, set[Any]]:
    """Per layer, the settings refused: while the layers' extras over float, each at its slowest
    setting left, add up to more than ``budget``, the largest extra left is refused (``extras``:
    per layer, each setting's extra, slowest first)."""
    refused: dict[str, set[Any]] = {name: set() for name in extras}
    order = sorted(
        ((e, name, s) for name, found in extras.items() for e, s in found if e > 0),
        key=lambda x: (-x[0], x[1], x[2].label),
    )
    total = sum(found[0][0] for found in extras.values() if found)
    for extra, name, setting in order:  # the largest extra left: its layer's worst case
        if total <= budget:
            break
        refused[name].add(setting)
        left = [e for e, s in extras[name] if s not in refused[name]]
        total += (left[0] if left else 0.0) - extra
    return refused


@dataclasses.dataclass(frozen=True)
class _FloatSetting:
    bits: None = None
    block_size: int = 0
