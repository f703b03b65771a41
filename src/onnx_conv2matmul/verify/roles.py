"""Which dims of a model's inputs are batch and which take the check's lengths.

Every symbolic dim of the inputs is a *batch* dim (it takes the batch), a *sequence* dim (it
takes the lengths of the check: time, tokens, samples, height, width...) or *fixed* (a value
given for it). :func:`dim_roles` decides, for the model's inputs together:

1. a dim given a value is fixed;
2. a name that says batch (``batch``, ``B``, ``N``, ``batch_size``...) or sequence (``T``,
   ``time``, ``frames``, ``seq_len``, ``U``, ``tokens``, ``samples``, ``H``, ``W``...)
   decides;
3. otherwise the positions do: a dim on the first axis of an input of rank 2 or more, or
   the first symbolic axis of a state input (``[layers, B, hidden]``), is the batch; a dim
   seen only in rank-1 inputs is the batch when one of them is an integer length input,
   else a signal length; any other dim is a sequence dim.

Unnamed dims follow rule 3 one by one; every unnamed sequence dim takes the same value. A dim
named ``?`` is unnamed: exporters (Paddle2ONNX) write it for any unknown size, so two ``?``
(an image's height and width) are not one dim.
So an input ``[1, 'T', 4]`` (a fixed batch of 1) gets its lengths on ``T``. A model in which
no dim takes the lengths while a dim was taken for the batch from its position alone gets
a warning: the check could not tell its batch from its time axis.
"""

# pragma: no mutate start
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.verify.options import VerifyOptions

STATE_NAME = re.compile(r"(state|cache|hidden|memory|^h0?$|^c0?$|^h_|^c_)", re.IGNORECASE)

LENGTH_NAME = re.compile(r"(^|_)(len|length|lengths|seq_len|n_frames)s?($|_)", re.IGNORECASE)

UNNAMED = "(unnamed)"
"""The key of every unnamed sequence dim: they all take the same value."""

UNNAMED_BATCH = "(unnamed batch)"
"""The key of every unnamed batch dim."""

ANONYMOUS = "?"
"""The name exporters give any unknown size: an unnamed dim, not a dim of that name."""

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
            elif isinstance(dim, str) and dim and dim != ANONYMOUS:
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


# pragma: no mutate end
