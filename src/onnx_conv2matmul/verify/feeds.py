"""The inputs of a check: real ones read from files, or synthesised from each input's type and shape.

**Dim roles.** Every symbolic dim of the inputs is a *batch* dim (it takes the batch), a
*sequence* dim (it takes the lengths of the check: time, tokens, samples, height, width...)
or *fixed* (a value given for it). :func:`dim_roles` decides, for the model's inputs
together:

1. a dim given a value is fixed;
2. a name that says batch (``batch``, ``B``, ``N``, ``batch_size``...) or sequence (``T``,
   ``time``, ``frames``, ``seq_len``, ``U``, ``tokens``, ``samples``, ``H``, ``W``...)
   decides;
3. otherwise the positions do: a dim on the first axis of an input of rank 2 or more, or
   the first symbolic axis of a state input (``[layers, B, hidden]``), is the batch; a dim
   seen only in rank-1 inputs is the batch when one of them is an integer length input,
   else a signal length; any other dim is a sequence dim.

Unnamed dims follow rule 3 one by one; every unnamed sequence dim takes the same value.
So an input ``[1, 'T', 4]`` (a fixed batch of 1) gets its lengths on ``T``. A model in which
no dim takes the lengths while a dim was taken for the batch from its position alone gets
a warning: the check could not tell its batch from its time axis.

**Synthesis.** Floats are standard normal (seeded by the seed and the run's length), state
inputs zeros, integers random in [0, 4), bools random; an integer rank-1 input whose name
says length gets, in every batch row, the value of the sequence dim it measures (the dim of
the input its name starts with, e.g. ``target_length`` -> ``targets``; else the main one).
"""

# pragma: no mutate start
from __future__ import annotations

import dataclasses
import enum
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.verify.options import VerifyOptions, feed_source
from onnx_conv2matmul.verify.stream import feed_rows, read_npz, spec_rows

STATE_NAME = re.compile(r"(state|cache|hidden|memory|^h0?$|^c0?$|^h_|^c_)", re.IGNORECASE)
LENGTH_NAME = re.compile(r"(^|_)(len|length|lengths|seq_len|n_frames)s?($|_)", re.IGNORECASE)
UNNAMED = "(unnamed)"
"""The key of every unnamed sequence dim: they all take the same value."""
UNNAMED_BATCH = "(unnamed batch)"
"""The key of every unnamed batch dim."""

_BATCH_WORDS = {"b", "n", "bs", "nb", "batch", "batches", "batchsize", "nbatch", "numbatch"}
_SEQUENCE_WORDS = {
    "t", "u", "s", "l", "h", "w", "seq", "len", "length", "lengths", "step", "steps",
    "height", "width", "depth", "time", "frame", "frames", "sample", "samples", "token", "tokens",
    "char", "chars", "word", "words", "chunk", "chunks", "src", "tgt", "sequence", "nframes",
}  # fmt: skip
_SEQUENCE_PARTS = ("time", "seq", "frame", "sample", "token", "length", "height", "width", "step")


@dataclasses.dataclass
class InputSpec:
    """One input of a model: its name, numpy element type and shape (ints, names or None)."""

    name: str
    dtype: Any
    shape: list[int | str | None]
    # (low, high, why): the values the model's own first op says it takes (see input_value_ranges).
    value_range: tuple[float, float, str] | None = None


_InputSpec = InputSpec  # its name before the verify package was split


class Feed(dict[str, np.ndarray]):
    """One set of real inputs (input name to array) and the file it was read from."""

    def __init__(self, arrays: Mapping[str, np.ndarray], source: str) -> None:
        super().__init__(arrays)
        self.source = source


def load_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Feed]:
    """Read real inputs: each ``.npz`` file is one feed, its keys the model's input names.

    A directory stands for the ``.npz`` files in it, in name order. The arrays are checked
    against a model later (``VerifyOptions.feeds``); here only the files.

    Raises:
        InputError: a path that does not exist, a directory without ``.npz`` files, or a
            file that is not a readable ``.npz`` of plain arrays.
    """
    files: list[str] = []
    for path in (os.fspath(p) for p in paths):
        if os.path.isdir(path):
            found = sorted(
                os.path.join(path, name)
                for name in os.listdir(path)
                if name.endswith(".npz") and os.path.isfile(os.path.join(path, name))
            )
            if not found:
                raise InputError(f"no .npz files in the inputs directory {path}")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise InputError(f"inputs file not found: {path}")
    if not files:
        raise InputError("no inputs files given")
    return [_read_npz(path) for path in files]


def _read_npz(path: str) -> Feed:
    try:
        if not zipfile.is_zipfile(path) and _is_npy(path):
            raise InputError(f"not an .npz file (a single .npy array): {path}")
        arrays = read_npz(path)  # memory-mapped where stored uncompressed
    except InputError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        # A file that is neither zip nor .npy: numpy would take it for a pickle, zipfile says
        # "File is not a zip file"; either way, say what an .npz file is.
        pickle_guess = isinstance(err, (ValueError, zipfile.BadZipFile)) and not zipfile.is_zipfile(path)
        why = "not an .npz file (numpy.savez writes a zip archive)" if pickle_guess else _first_line(err)
        raise InputError(f"cannot read inputs file {path}: {why}") from err
    if not arrays:
        raise InputError(f"inputs file holds no arrays: {path}")
    return Feed(arrays, path)


def _is_npy(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(6) == b"\x93NUMPY"


def check_feeds_for_graph(graph_inputs: Sequence[Any], feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
    """:func:`check_feeds` against an onnx-ir graph's inputs (initializers aside), before any run.

    Raises:
        InputError: as :func:`check_feeds`.
    """
    specs = []
    for value in graph_inputs:
        if value.is_initializer() or value.dtype is None:
            continue
        shape = value.shape
        dims: list[int | str | None] = (
            [d if isinstance(d, int) else (d.value if d.value else None) for d in shape] if shape else []
        )
        specs.append(InputSpec(value.name, value.dtype.numpy(), dims))
    check_feeds(specs, feeds)


def check_feeds(specs: Sequence[InputSpec], feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Refuse feeds that do not fit the model: names, element types, ranks and static dims.

    Raises:
        InputError: one line naming the feed and the first problem found.
    """
    by_name = {spec.name: spec for spec in specs}
    for index, feed in enumerate(feeds):
        where = f"inputs {feed_source(feed, index)}"
        missing = [name for name in by_name if name not in feed]
        unknown = [name for name in feed if name not in by_name]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing {_named('input', missing)}")
            if unknown:
                parts.append(f"unknown {_named('input', unknown)}")
            known = ", ".join(by_name) or "none"
            raise InputError(f"{where}: {'; '.join(parts)} (the model's inputs: {known})")
        for name, spec in by_name.items():
            array = feed[name]
            want = np.dtype(spec.dtype)
            if array.dtype != want:
                raise InputError(f"{where}: input {name!r} is {array.dtype}, the model takes {want}")
            if array.ndim != len(spec.shape):
                raise InputError(
                    f"{where}: input {name!r} has rank {array.ndim} {list(array.shape)},"
                    f" the model takes rank {len(spec.shape)} {spec.shape}"
                )
            rows = spec_rows(specs, feed)
            for axis, (got, dim) in enumerate(zip(array.shape, spec.shape, strict=True)):
                if axis == 0 and dim == 1 and rows > 1 and got == rows:
                    continue  # a fixed batch of 1: the file's samples are fed one at a time
                if isinstance(dim, int) and dim > 0 and got != dim:
                    raise InputError(
                        f"{where}: input {name!r} has {got} on axis {axis}, the model takes {dim}"
                        f" {spec.shape}"
                    )


class Role(str, enum.Enum):
    """What a symbolic dim takes in a check."""

    BATCH = "batch"
    SEQUENCE = "sequence"
    FIXED = "fixed"


@dataclasses.dataclass(frozen=True)
class DimRole:
    """One symbolic dim: its key (its name, or :data:`UNNAMED` / :data:`UNNAMED_BATCH`), its
    role, why it has it, and where it appears (``input[axis]``)."""

    key: str
    role: Role
    why: str
    places: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.key, "role": self.role.value, "why": self.why, "inputs": list(self.places)}


@dataclasses.dataclass(frozen=True)
class Roles:
    """The dims of a model's inputs and what each takes (see :func:`dim_roles`).

    Attributes:
        dims: Every dim, in order of first appearance.
        axes: Per input, each axis: its static size or the key of its dim.
        primary: The main sequence dim (the first one of the signal input), or None.
        length_of: Per length input, the key of the sequence dim it measures (None: none).
        signal: The main signal input, or None.
        speech: The signal input is a speech encoder's features: ``[B, F, T]`` or
            ``[B, T, F]`` with a static F, T the model's only sequence dim, and a length input.
        warnings: What the check could not tell for sure.
    """

    dims: tuple[DimRole, ...]
    axes: Mapping[str, tuple[int | str, ...]]
    primary: str | None
    length_of: Mapping[str, str | None]
    signal: str | None
    speech: bool
    warnings: tuple[str, ...]

    def keys(self, role: Role) -> list[str]:
        return [d.key for d in self.dims if d.role is role]

    @property
    def sequence(self) -> list[str]:
        """The sequence dims, the primary first."""
        keys = self.keys(Role.SEQUENCE)
        return sorted(keys, key=lambda k: k != self.primary)

    def values(self, length: int, options: VerifyOptions, *, batch: int | None = None) -> dict[str, int]:
        """Every dim's value in a run where each sequence dim takes ``length``."""
        values = {}
        for dim in self.dims:
            if dim.role is Role.FIXED:
                values[dim.key] = options.dims[dim.key]
            elif dim.role is Role.BATCH:
                values[dim.key] = options.batch if batch is None else batch
            else:
                values[dim.key] = length
        return values

    def shape(self, name: str, values: Mapping[str, int]) -> list[int]:
        """The shape of input ``name`` in a run with these dim values."""
        return [axis if isinstance(axis, int) else values[axis] for axis in self.axes[name]]


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def name_says(name: str) -> Role | None:
    """What a dim's name says: batch, sequence, or nothing (None)."""
    words = _words(name)
    if any(w in _BATCH_WORDS or "batch" in w for w in words):
        return Role.BATCH
    if any(w in _SEQUENCE_WORDS or any(p in w for p in _SEQUENCE_PARTS) for w in words):
        return Role.SEQUENCE
    return None


def _symbolic(dim: int | str | None) -> bool:
    return not (isinstance(dim, int) and dim > 0)


def _state_batch_axis(spec: InputSpec) -> int | None:
    """The first symbolic axis of a state input whose first axis is static (``[layers, B, H]``)."""
    if len(spec.shape) < 2 or _symbolic(spec.shape[0]) or not STATE_NAME.search(spec.name):
        return None
    return next((axis for axis, dim in enumerate(spec.shape) if _symbolic(dim)), None)


def _by_position(spec: InputSpec, axis: int, options: VerifyOptions) -> tuple[Role, str]:
    """The role a dim takes from where it sits, and why."""
    where = f"{spec.name}[{axis}]"
    if len(spec.shape) >= 2 and axis == 0:
        return Role.BATCH, f"position: the first axis of {where.split('[')[0]}"
    if axis == _state_batch_axis(spec):
        return Role.BATCH, f"position: the first symbolic axis of the state input {spec.name}"
    if len(spec.shape) == 1:
        if np.issubdtype(spec.dtype, np.integer):
            return Role.BATCH, f"position: one value per batch row in the integer input {spec.name}"
        return Role.SEQUENCE, f"position: the length of the rank-1 signal {spec.name}"
    return Role.SEQUENCE, f"position: axis {axis} of {spec.name}"


def _named_role(name: str, places: list[tuple[InputSpec, int]], options: VerifyOptions) -> tuple[Role, str]:
    if name in options.dims:
        return Role.FIXED, "given"
    said = name_says(name)
    if all(len(spec.shape) == 1 for spec, _ in places):
        # Only in rank-1 inputs: per batch row when its name is the batch's or a length
        # input holds it; otherwise a signal (wave [samples]).
        if said is Role.BATCH and any("batch" in w or w in ("b", "bs") for w in _words(name)):
            return Role.BATCH, "name"
        if any(_is_length_spec(spec, options) for spec, _ in places):
            return Role.BATCH, "position: the dim of a length input, one value per batch row"
        return Role.SEQUENCE, "position: the length of a rank-1 signal"
    if said is not None:
        return said, "name"
    ranked = [(spec, axis) for spec, axis in places if len(spec.shape) >= 2]
    for spec, axis in ranked:
        role, why = _by_position(spec, axis, options)
        if role is Role.BATCH:
            return role, why
    return _by_position(*ranked[0], options)


def dim_roles(specs: Sequence[InputSpec], options: VerifyOptions) -> Roles:
    """The role of every symbolic dim of ``specs`` (see the module's documentation)."""
    places: dict[str, list[tuple[InputSpec, int]]] = {}
    unnamed: dict[str, list[tuple[str, str]]] = {UNNAMED_BATCH: [], UNNAMED: []}
    axes: dict[str, tuple[int | str, ...]] = {}
    for spec in specs:
        row: list[int | str] = []
        for axis, declared in enumerate(spec.shape):
            dim = options.axes.get(f"{spec.name}[{axis}]", declared)
            if not _symbolic(dim):
                row.append(int(dim))  # type: ignore[arg-type]
            elif isinstance(dim, str) and dim:
                places.setdefault(dim, []).append((spec, axis))
                row.append(dim)
            else:
                role, why = _by_position(spec, axis, options)
                key = UNNAMED_BATCH if role is Role.BATCH else UNNAMED
                unnamed[key].append((f"{spec.name}[{axis}]", why))
                row.append(key)
        axes[spec.name] = tuple(row)
    dims: list[DimRole] = []
    for name, found in places.items():
        role, why = _named_role(name, found, options)
        dims.append(DimRole(name, role, why, tuple(f"{s.name}[{a}]" for s, a in found)))
    for key, found_unnamed in unnamed.items():
        if found_unnamed:
            role = Role.BATCH if key == UNNAMED_BATCH else Role.SEQUENCE
            dims.append(DimRole(key, role, found_unnamed[0][1], tuple(p for p, _ in found_unnamed)))
    return _complete(specs, dims, axes, options)


def _complete(
    specs: Sequence[InputSpec],
    dims: list[DimRole],
    axes: dict[str, tuple[int | str, ...]],
    options: VerifyOptions,
) -> Roles:
    """The signal input, the main sequence dim, what each length input measures, the warnings."""
    by_key = {d.key: d for d in dims}
    sequence = {d.key for d in dims if d.role is Role.SEQUENCE}
    with_sequence = [s for s in specs if any(a in sequence for a in axes[s.name] if isinstance(a, str))]
    signal = options.signal_input
    if signal is None:
        floats = [
            s for s in with_sequence if np.issubdtype(s.dtype, np.floating) and not STATE_NAME.search(s.name)
        ]
        chosen = floats or with_sequence
        signal = chosen[0].name if chosen else None
    primary = None
    if signal is not None:
        primary = next((a for a in axes.get(signal, ()) if isinstance(a, str) and a in sequence), None)
    if primary is None and sequence:
        primary = next(d.key for d in dims if d.key in sequence)
    warnings: list[str] = []
    length_of: dict[str, str | None] = {}
    for spec in specs:
        if _is_length_spec(spec, options):
            length_of[spec.name] = _measured_dim(spec.name, specs, axes, sequence, primary, warnings)
    if not sequence:
        guessed = [d for d in dims if d.role is Role.BATCH and d.why.startswith("position")]
        for dim in guessed:
            warnings.append(
                f"no dim takes the lengths, and whether dim {dim.key} ({', '.join(dim.places)}) is the"
                " batch or a time axis cannot be told: it was taken for the batch from its position;"
                " give it a value to check other sizes"
            )
    speech = _speech(specs, by_key, axes, signal, sequence, length_of)
    return Roles(tuple(dims), axes, primary, length_of, signal, speech, tuple(warnings))


def _measured_dim(
    name: str,
    specs: Sequence[InputSpec],
    axes: Mapping[str, tuple[int | str, ...]],
    sequence: set[str],
    primary: str | None,
    warnings: list[str],
) -> str | None:
    """The sequence dim a length input measures: the only one, that of the input its name
    starts with, or the main one (with a warning)."""
    if len(sequence) <= 1:
        return primary
    stem = LENGTH_NAME.sub("", name).strip("_").lower()
    if stem:
        for spec in specs:
            if spec.name != name and spec.name.lower().startswith(stem):
                found = next((a for a in axes[spec.name] if isinstance(a, str) and a in sequence), None)
                if found is not None:
                    return found
    warnings.append(f"which dim the length input {name!r} measures cannot be told: it gets {primary!r}")
    return primary


def _speech(
    specs: Sequence[InputSpec],
    by_key: Mapping[str, DimRole],
    axes: Mapping[str, tuple[int | str, ...]],
    signal: str | None,
    sequence: set[str],
    length_of: Mapping[str, str | None],
) -> bool:
    """Whether the signal input is a speech encoder's features (see :class:`Roles`)."""
    if signal is None or len(sequence) != 1:
        return False
    spec = next(s for s in specs if s.name == signal)
    row = axes[signal]
    if len(row) != 3 or not np.issubdtype(spec.dtype, np.floating) or not isinstance(row[0], str):
        return False
    if by_key[row[0]].role is not Role.BATCH:
        return False
    (time,) = sequence
    rest = [a for a in row[1:] if a != time]
    return time in row[1:] and len(rest) == 1 and isinstance(rest[0], int) and time in length_of.values()


def _is_length_spec(spec: InputSpec, options: VerifyOptions) -> bool:
    if options.length_input is not None:
        return spec.name == options.length_input
    return (
        np.issubdtype(spec.dtype, np.integer) and len(spec.shape) == 1 and bool(LENGTH_NAME.search(spec.name))
    )


def synthesise_inputs(
    specs: Sequence[InputSpec],
    length: int,
    options: VerifyOptions,
    values: Mapping[str, int] | None = None,
    roles: Roles | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Inputs for one run, and how each was made.

    ``values`` gives every dim's value (see :meth:`Roles.values`); without it every
    sequence dim takes ``length``. ``length`` seeds the random inputs. With real inputs
    (``options.feeds``), ``length`` is the feed's number, from 1.
    """
    if options.feeds is not None:
        feed = options.feeds[length - 1]
        return {spec.name: feed[spec.name] for spec in specs}, {
            spec.name: "from the input files" for spec in specs
        }
    roles = roles or dim_roles(specs, options)
    values = values if values is not None else roles.values(length, options)
    rng = np.random.default_rng([options.seed, length])
    feeds: dict[str, np.ndarray] = {}
    how: dict[str, str] = {}
    for spec in specs:
        dims = roles.shape(spec.name, values)
        if spec.name in options.inputs:
            feeds[spec.name] = np.full(dims, options.inputs[spec.name], dtype=spec.dtype)
            how[spec.name] = f"fixed {options.inputs[spec.name]}"
        elif spec.name in roles.length_of:
            measured = roles.length_of[spec.name]
            fill = values[measured] if measured is not None else _largest_static(roles, roles.signal)
            feeds[spec.name] = np.full(dims, fill, dtype=spec.dtype)
            how[spec.name] = f"length of {measured} per batch row" if measured else "length per batch row"
        elif np.issubdtype(spec.dtype, np.floating):
            if spec.name != options.signal_input and STATE_NAME.search(spec.name):
                feeds[spec.name] = np.zeros(dims, dtype=spec.dtype)
                how[spec.name] = "zeros (state)"
            elif spec.value_range is not None:
                low, high, why = spec.value_range
                feeds[spec.name] = rng.uniform(low, high, size=dims).astype(spec.dtype)
                how[spec.name] = f"uniform in [{low:g}, {high:g}] ({why})"
            else:
                feeds[spec.name] = rng.standard_normal(dims).astype(spec.dtype)
                how[spec.name] = "standard normal"
        elif spec.dtype is np.bool_:
            feeds[spec.name] = rng.integers(0, 2, size=dims).astype(np.bool_)
            how[spec.name] = "random bool"
        else:
            feeds[spec.name] = rng.integers(0, 4, size=dims).astype(spec.dtype)
            how[spec.name] = "random integers in [0, 4)"
    return feeds, how


def feed_samples(feed: Mapping[str, np.ndarray]) -> int:
    """How many samples one run's inputs hold: the first dim of its float inputs of rank 2 or
    more when they all agree on it (a batch), else 1."""
    return feed_rows(feed)


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


def _largest_static(roles: Roles, signal: str | None) -> int:
    """What a length input gets when no dim takes the lengths: the signal's largest axis."""
    row = roles.axes.get(signal or "", ())
    return max((a for a in row if isinstance(a, int)), default=1)


def _symbolic_dims(specs: Sequence[InputSpec]) -> list[str]:
    """The named symbolic dims of the inputs, in order of first appearance."""
    names: dict[str, None] = {}
    for spec in specs:
        names.update((dim, None) for dim in spec.shape if isinstance(dim, str))
    return list(names)


def check_names(specs: Sequence[InputSpec], options: VerifyOptions) -> None:
    """Refuse option names that match no input or symbolic dim of the model.

    A misspelt name would otherwise be ignored and the input synthesised as usual,
    checking something other than what was asked for (e.g. the other branch of an If).

    Raises:
        InputError: one line naming every unknown name and the names that exist.
    """
    inputs = [spec.name for spec in specs]
    dims = _symbolic_dims(specs)
    known_inputs = f"(the model's inputs: {', '.join(inputs) or 'none'})"
    known_dims = f"(the inputs' symbolic dims: {', '.join(dims) or 'none'})"
    problems = []
    unknown = [name for name in options.inputs if name not in inputs]
    if unknown:
        problems.append(f"unknown {_named('input', unknown)} {known_inputs}")
    unknown = [name for name in options.dims if name not in dims]
    if unknown:
        problems.append(f"unknown {_named('dim', unknown)} {known_dims}")
    places = {f"{spec.name}[{axis}]" for spec in specs for axis in range(len(spec.shape))}
    unknown = [name for name in options.axes if name not in places]
    if unknown:
        problems.append(f"unknown {_named('input axis', unknown)} {known_inputs}")
    for role, name in (("signal", options.signal_input), ("length", options.length_input)):
        if name is not None and name not in inputs:
            problems.append(f"unknown {role} input {name!r} {known_inputs}")
    if problems:
        raise InputError("; ".join(problems))


def _named(noun: str, names: Sequence[str]) -> str:
    """``input 'a'`` or ``inputs 'a', 'b'``."""
    return f"{noun}{'s' if len(names) > 1 else ''} {', '.join(repr(name) for name in names)}"


def _signature(specs: Sequence[InputSpec]) -> str:
    return ", ".join(f"{s.name}: {np.dtype(s.dtype).name}{s.shape}" for s in specs)


def _same_signature(a: Sequence[InputSpec], b: Sequence[InputSpec]) -> bool:
    """Same names and types; same rank and the same value wherever both dims are static."""
    by_name = {s.name: s for s in b}
    if len(a) != len(b) or set(by_name) != {s.name for s in a}:
        return False
    for spec in a:
        other = by_name[spec.name]
        if np.dtype(spec.dtype) != np.dtype(other.dtype) or len(spec.shape) != len(other.shape):
            return False
        for x, y in zip(spec.shape, other.shape, strict=True):
            if isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0 and x != y:
                return False
    return True


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else err.__class__.__name__


# pragma: no mutate end
