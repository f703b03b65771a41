"""Synthesised inputs the model can take: values read from its graph, then sizes found by running it.

A trained model often runs only at some of the values its inputs declare as free: a text
recognizer ``x [N, 3, H, W]`` whose network squeezes the height to 1 runs only for heights
around the 48 it was trained at; a VAD whose ``sr`` scalar picks a branch with an ``If``
works only at the sample rates it compares ``sr`` with. Before a check plans its runs,
:func:`discover` looks, in order:

1. **The graph.** An integer input of a few elements (a scalar such as ``sr``) that the
   graph compares with a constant in ``Equal`` (directly, or through a ``Cast``,
   ``Squeeze``, ``Unsqueeze``, ``Reshape`` or ``Identity``; in the main graph or an
   ``If``/``Loop`` body; the ``Equal`` usually feeds an ``If`` or a ``Where``) takes the
   first such constant; the model's metadata can also give it (a key named as the input).
   A metadata entry naming an input's shape (``<input>_shape``, ``input_shape`` or
   ``shape``: a list of the input's rank) fixes its symbolic axes other than the first.
2. **Probes.** When the inputs have two or more sequence dims (an image's height and
   width, each unnamed axis counted on its own), the original runs once at the first
   default length; then each dim alone at the other default and spare lengths, the
   smallest first, until it runs. A dim that runs at none of them (or, when the first run
   fails, one whose change alone lets the model run) is
   scanned over multiples of 16 (image inputs) or 8 up to twice the largest default
   length, and fixed at the middle of the first run of sizes it runs at (heights 16 to 80
   for the recognizer above: 48). Probes are small runs whose outputs are dropped at once.

What was found goes into the options (:attr:`VerifyOptions.inputs` for values,
:attr:`VerifyOptions.axes` for sizes) with how each was found
(:attr:`VerifyOptions.found`), so every later step that synthesises inputs from those
options (the check, the search, the latency step) feeds the same shapes and values. A dim
that no probe could settle is left to the plan's spare lengths; when the model runs at none
of them, the check's error names the dims and the way out (real inputs).
"""

# pragma: no mutate start
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import ModelRunError
from onnx_conv2matmul.verify.feeds import synthesise_inputs
from onnx_conv2matmul.verify.options import (
    DEFAULT_LENGTHS,
    IMAGE_LENGTHS,
    IMAGE_SPARE_LENGTHS,
    SPARE_LENGTHS,
    Found,
    VerifyOptions,
)
from onnx_conv2matmul.verify.roles import UNNAMED, InputSpec, Role, Roles, dim_roles

GRAPH_READ_LIMIT = 64 * 2**20
"""The graph is read for constants and metadata only from ``.onnx`` files up to this size."""
SMALL_INTEGER_ELEMENTS = 4
"""An integer input of at most this many elements (all dims static) is a value, not data."""
_PASS_THROUGH = frozenset({"Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"})
_COMPARISONS = frozenset({"Equal"})
_SHAPE_KEYS = ("{name}_shape", "input_shape", "shape")


def read_graph(path: str) -> Any:
    """The model's proto without external data, or None when too large or unreadable."""
    import onnx

    try:
        if os.path.getsize(path) > GRAPH_READ_LIMIT:
            return None
        return onnx.load(path, load_external_data=False)
    except Exception:  # unreadable here: onnxruntime says why when it loads it
        return None


def _small_integer(spec: InputSpec) -> bool:
    if not np.issubdtype(spec.dtype, np.integer):
        return False
    if not all(isinstance(d, int) and d > 0 for d in spec.shape):
        return False
    return int(np.prod([int(d) for d in spec.shape if isinstance(d, int)])) <= SMALL_INTEGER_ELEMENTS


def _integer_constants(graph: Any, into: dict[str, int]) -> None:
    """Integer constants of one element in ``graph`` (initializers and Constant nodes)."""
    from onnx import TensorProto, numpy_helper

    def add(name: str, tensor: Any) -> None:
        if tensor.data_location == TensorProto.EXTERNAL:
            return
        array = numpy_helper.to_array(tensor)
        if array.size == 1 and np.issubdtype(array.dtype, np.integer):
            into[name] = int(array.reshape(()))

    for tensor in graph.initializer:
        add(tensor.name, tensor)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
            attribute = node.attribute[0]
            if attribute.name == "value":
                add(node.output[0], attribute.t)
            elif attribute.name == "value_int":
                into[node.output[0]] = int(attribute.i)
            elif attribute.name == "value_ints" and len(attribute.ints) == 1:
                into[node.output[0]] = int(attribute.ints[0])


def compared_values(model: Any, specs: Sequence[InputSpec]) -> dict[str, tuple[int, str]]:
    """Per small integer input: the constant the graph first compares it with, and where."""
    wanted = {spec.name for spec in specs if _small_integer(spec)}
    if not wanted or model is None:
        return {}
    from onnx_conv2matmul._graphs import proto_graphs

    graphs = list(proto_graphs(model.graph))
    constants: dict[str, int] = {}
    for graph in graphs:
        _integer_constants(graph, constants)
    # What each input flows to unchanged in value (names are unique across subgraphs).
    alias: dict[str, str] = {name: name for name in wanted}
    found: dict[str, tuple[int, str]] = {}
    for graph in graphs:
        for node in graph.node:
            if node.op_type in _PASS_THROUGH and node.input and node.input[0] in alias:
                for output in node.output:
                    alias[output] = alias[node.input[0]]
            if node.op_type not in _COMPARISONS or len(node.input) != 2:
                continue
            a, b = node.input
            for mine, other in ((a, b), (b, a)):
                source = alias.get(mine)
                if source is not None and source not in found and other in constants:
                    value = constants[other]
                    found[source] = (value, f"graph: compared with {value} in {node.op_type} {node.name!r}")
    return found


def metadata_values(
    model: Any, specs: Sequence[InputSpec]
) -> tuple[dict[str, tuple[int, str]], dict[str, int]]:
    """Values of small integer inputs and sizes of input axes that the model's metadata gives."""
    if model is None:
        return {}, {}
    props = {p.key.lower(): p.value for p in model.metadata_props}
    values: dict[str, tuple[int, str]] = {}
    axes: dict[str, int] = {}
    for spec in specs:
        if _small_integer(spec) and spec.name.lower() in props:
            with contextlib.suppress(ValueError):
                values[spec.name] = (int(props[spec.name.lower()].strip()), f"metadata {spec.name!r}")
            continue
        for key in (k.format(name=spec.name.lower()) for k in _SHAPE_KEYS):
            shape = _int_list(props.get(key))
            if shape is not None and len(shape) == len(spec.shape):
                for axis, (size, dim) in enumerate(zip(shape, spec.shape, strict=True)):
                    if axis > 0 and size > 0 and not (isinstance(dim, int) and dim > 0):
                        axes[f"{spec.name}[{axis}]"] = size
                break
    return values, axes


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


@dataclasses.dataclass(frozen=True)
class Slot:
    """A sequence dim as the probes vary it: its label and the input axes it sets."""

    label: str
    places: tuple[str, ...]


def slots(roles: Roles) -> list[Slot]:
    """The sequence dims, each unnamed axis on its own."""
    found: list[Slot] = []
    for dim in roles.dims:
        if dim.role is not Role.SEQUENCE:
            continue
        if dim.key == UNNAMED:
            found.extend(Slot(place, (place,)) for place in dim.places)
        else:
            found.append(Slot(f"{dim.key!r} ({', '.join(dim.places)})", dim.places))
    return found


Attempt = Callable[[Mapping[str, int]], "str | None"]


def _image(specs: Sequence[InputSpec], roles: Roles) -> bool:
    from onnx_conv2matmul.verify.plan import image_input

    return image_input(specs, roles) is not None


def settle(slot: Slot, attempt: Attempt, step: int, largest: int) -> tuple[int, str] | None:
    """The middle of the first run of multiples of ``step`` (up to ``largest``) the model runs
    at with ``slot`` set to them alone, and how that was found; None when it runs at none."""
    good: list[int] = []
    failed_after: int | None = None
    for size in range(step, largest + 1, step):
        if attempt({place: size for place in slot.places}) is None:
            good.append(size)
        elif good:
            failed_after = size
            break
    if not good:
        return None
    value = good[(len(good) - 1) // 2]  # the median, the lower one of two
    upper = f", not at {failed_after}" if failed_after is not None else ""
    return value, (
        f"probe: the original runs with {slot.label} from {good[0]} to {good[-1]} in steps of"
        f" {step}{upper}; the middle of that range"
    )


def probe(
    specs: Sequence[InputSpec], options: VerifyOptions, run: Callable[[Mapping[str, np.ndarray]], None]
) -> list[Found]:
    """The sizes the probes fix (see the module's documentation); ``run`` raises
    :class:`ModelRunError` when the original cannot run on the inputs."""
    roles = dim_roles(specs, options)
    found_slots = slots(roles)
    if len(found_slots) < 2:
        return []
    image = _image(specs, roles)
    lengths = options.lengths or (IMAGE_LENGTHS if image else DEFAULT_LENGTHS)
    step = 16 if image else 8
    largest = 2 * max(lengths)
    pins: dict[str, int] = {}

    def attempt(more: Mapping[str, int]) -> str | None:
        trial = dataclasses.replace(options, axes={**options.axes, **pins, **more})
        trial_roles = dim_roles(specs, trial)
        values = trial_roles.values(lengths[0], trial, batch=1)
        feeds, _ = synthesise_inputs(specs, 1, trial, values, trial_roles)
        try:
            run(feeds)
        except ModelRunError as err:
            return str(err)
        return None

    found: list[Found] = []
    spares = IMAGE_SPARE_LENGTHS if image else SPARE_LENGTHS
    others = sorted({n for n in (*lengths, *spares) if n != lengths[0]})
    base_runs = attempt({}) is None
    for slot in found_slots:
        if base_runs and any(attempt({p: n for p in slot.places}) is None for n in others):
            continue  # it runs at other sizes: the plan's lengths suit it
        settled = settle(slot, attempt, step, largest)
        if settled is None:
            continue
        value, how = settled
        pins.update((place, value) for place in slot.places)
        found.extend(Found(place, value, how) for place in slot.places)
        if not base_runs and attempt({}) is None:
            break
    return found


def graph_specs(model: Any) -> list[InputSpec] | None:
    """The inputs a model's proto declares (initializers aside), as onnxruntime lists them;
    None when one has a type that is not a plain tensor."""
    from onnx import helper

    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        if value.type.WhichOneof("value") != "tensor_type" or not value.type.tensor_type.HasField("shape"):
            return None
        try:
            dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        except (KeyError, ValueError):
            return None
        dims: list[int | str | None] = []
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        specs.append(InputSpec(value.name, dtype.type, dims))
    return specs


def needs_probes(specs: Sequence[InputSpec], options: VerifyOptions) -> bool:
    """Whether :func:`probe` would run the model: two or more sequence dims."""
    return len(slots(dim_roles(specs, options))) >= 2


def discover(
    path: str,
    options: VerifyOptions,
    specs: Sequence[InputSpec],
    run: Callable[[Mapping[str, np.ndarray]], None],
    model: Any = None,
) -> VerifyOptions:
    """``options`` with the values and sizes found for the model at ``path`` (see the module's
    documentation) and ``found`` set; as they are with real inputs or when already looked for.
    ``model`` is its proto when already read (:func:`read_graph`)."""
    if options.feeds is not None or options.found is not None:
        return options
    model = model if model is not None else read_graph(path)
    lengths_of = dim_roles(specs, options).length_of
    found: list[Found] = []
    inputs = dict(options.inputs)
    meta_values, meta_axes = metadata_values(model, specs)
    for source in (meta_values, compared_values(model, specs)):
        for name, (value, how) in source.items():
            if name not in inputs and name not in lengths_of:
                inputs[name] = value
                found.append(Found(name, value, how))
    axes = dict(options.axes)
    for place, size in meta_axes.items():
        if place not in axes:
            axes[place] = size
            found.append(Found(place, size, "metadata: the input's shape"))
    resolved = dataclasses.replace(options, inputs=inputs, axes=axes)
    found.extend(probe(specs, resolved, run))
    axes.update((f.what, f.value) for f in found if "[" in f.what)
    return dataclasses.replace(resolved, axes=axes, found=tuple(found))


# pragma: no mutate end
