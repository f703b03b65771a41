"""Inputs the user gives: real inputs read from ``.npz`` files and checked against the model,
and the names the options give (inputs, dims, axes) checked against those the model has."""

# pragma: no mutate start
from __future__ import annotations

import dataclasses
import os
import stat
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import InputError, first_line
from onnx_conv2matmul.verify.options import VerifyOptions, feed_source
from onnx_conv2matmul.verify.roles import InputSpec
from onnx_conv2matmul.verify.stream import read_npz, spec_rows


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
        elif os.path.isfile(path) or _stream(path):
            files.append(path)
        elif os.path.exists(path):
            raise InputError(f"inputs path is neither a file, a directory nor a pipe: {path}")
        else:
            raise InputError(f"inputs file not found: {path}")
    if not files:
        raise InputError("no inputs files given")
    return [_read_pipe(path) if _stream(path) else _read_npz(path) for path in files]


PIPE_LIMIT = 1 << 30
"""The most a pipe given as inputs may hold (it is read into memory: a zip archive is read by
seeking, which a pipe cannot do)."""


def _stream(path: str) -> bool:
    """Whether ``path`` is a pipe or a character device (``--inputs <(...)``, ``/dev/stdin``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _read_pipe(path: str) -> Feed:
    """An ``.npz`` archive read from a pipe, into memory, up to :data:`PIPE_LIMIT` bytes."""
    import io

    with open(path, "rb") as handle:
        data = handle.read(PIPE_LIMIT + 1)
    if len(data) > PIPE_LIMIT:
        raise InputError(
            f"inputs pipe {path} holds more than 1 GiB: write it to a file, which is read as needed"
        )
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise InputError(
            f"cannot read inputs pipe {path}: not an .npz file (numpy.savez writes a zip archive)"
        )
    try:
        arrays = read_npz(
            io.BytesIO(data)
        )  # sizes from the headers: a compressed array is not inflated in memory
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise InputError(f"cannot read inputs pipe {path}: {first_line(err)}") from err
    if not arrays:
        raise InputError(f"inputs pipe holds no arrays: {path}")
    return Feed(arrays, path)


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
        why = "not an .npz file (numpy.savez writes a zip archive)" if pickle_guess else first_line(err)
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
    by_name = {spec.name: spec for spec in specs}
    for name, value in options.inputs.items():
        spec = by_name.get(name)
        if spec is not None and np.issubdtype(spec.dtype, np.integer) and float(value) != int(float(value)):
            problems.append(f"input {name!r} is {_kind(spec)}: {value:g} is not a whole number")
    signal = by_name.get(options.signal_input or "")
    if signal is not None and not (np.issubdtype(signal.dtype, np.floating) and len(signal.shape) >= 1):
        floats = [spec.name for spec in specs if np.issubdtype(spec.dtype, np.floating) and spec.shape]
        problems.append(
            f"signal input {signal.name!r} is {_kind(signal)}: the signal is a float tensor"
            f" (the model's float inputs: {', '.join(floats) or 'none'})"
        )
    length = by_name.get(options.length_input or "")
    if length is not None and not (np.issubdtype(length.dtype, np.number) and len(length.shape) <= 1):
        fits = [spec.name for spec in specs if np.issubdtype(spec.dtype, np.integer) and len(spec.shape) <= 1]
        problems.append(
            f"length input {length.name!r} is {_kind(length)}: lengths are one number per batch row, a"
            f" tensor of rank 0 or 1 (the model's integer inputs of that rank: {', '.join(fits) or 'none'})"
        )
    if problems:
        raise InputError("; ".join(problems))


def _kind(spec: InputSpec) -> str:
    """``int64 of rank 1``: what an option naming ``spec`` must agree with."""
    return f"{np.dtype(spec.dtype).name} of rank {len(spec.shape)}"


def _named(noun: str, names: Sequence[str]) -> str:
    """``input 'a'`` or ``inputs 'a', 'b'``."""
    return f"{noun}{'s' if len(names) > 1 else ''} {', '.join(repr(name) for name in names)}"


# pragma: no mutate end


# --------------------------------------------------------------------------- #
# Held-out inputs: the part of the user's samples a choice made on the rest never sees
# --------------------------------------------------------------------------- #
HELD_OUT = (3, 6, 9)
"""Of every ten samples (or blocks of samples) in order, those held out: 30%, spread over the files."""
MIN_SPLIT = 10
"""Fewer samples than this are not split: every one serves the choice, and the report says so."""


@dataclasses.dataclass
class Split:
    """The user's feeds in two: ``chosen_on`` (what a choice sees), ``held`` (what confirms it,
    empty when the samples were too few), and how many samples each holds."""

    chosen_on: list[Feed]
    held: list[Feed]
    chosen_samples: int
    held_samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"chosen_on_samples": self.chosen_samples, "held_out_samples": self.held_samples}


def split_feeds(feeds: Sequence[Mapping[str, np.ndarray]], specs: Sequence[InputSpec] | None) -> Split:
    """Hold out 30% of the samples, deterministically (:data:`HELD_OUT`), from the choice.

    A file of several samples (inputs the model cuts along a free batch axis, see
    :func:`onnx_conv2matmul.verify.stream.cut_inputs`) is cut into ten blocks of consecutive
    samples, and blocks 3, 6 and 9 are held out; views of the arrays, nothing copied. Files of
    one sample (or whose samples cannot be cut) are held out whole, every tenth file at 3, 6 and
    9. Fewer than :data:`MIN_SPLIT` samples in all: nothing is held out."""
    from onnx_conv2matmul.verify.stream import cut_inputs, sample_views

    parts: tuple[list[Feed], list[Feed]] = ([], [])  # chosen on, held out
    counts = [0, 0]
    singles = 0
    cuts = [cut_inputs(specs, feed) if specs else {} for feed in feeds]
    rows = [spec_rows(specs, f) if cut and specs else 1 for f, cut in zip(feeds, cuts, strict=True)]
    if sum(rows) < MIN_SPLIT:
        return Split([_as_feed(f, i) for i, f in enumerate(feeds)], [], sum(rows), 0)
    for index, (feed, cut, samples) in enumerate(zip(feeds, cuts, rows, strict=True)):
        if samples < 2:
            held = singles % 10 in HELD_OUT
            parts[held].append(_as_feed(feed, index))
            counts[held] += 1
            singles += 1
            continue
        # Runs of consecutive samples on the same side: blocks 0-2, 3, 4-5, 6, 7-8, 9.
        runs: list[tuple[bool, int, int]] = []
        edges = [round(samples * k / 10) for k in range(11)]
        for block in range(10):
            start, stop, held = edges[block], edges[block + 1], block in HELD_OUT
            if start == stop:
                continue
            if runs and runs[-1][0] == held and runs[-1][2] == start:
                runs[-1] = (held, runs[-1][1], stop)
            else:
                runs.append((held, start, stop))
        source = feed_source(feed, index)
        for held, start, stop in runs:
            part = Feed(sample_views(feed, cut, start, stop), f"{source} samples {start + 1}-{stop}")
            parts[held].append(part)
            counts[held] += stop - start
    chosen, held_out = parts
    if not chosen or not held_out:
        return Split([_as_feed(f, i) for i, f in enumerate(feeds)], [], sum(rows), 0)
    return Split(chosen, held_out, counts[0], counts[1])


def _as_feed(feed: Mapping[str, np.ndarray], index: int) -> Feed:
    return feed if isinstance(feed, Feed) else Feed(feed, feed_source(feed, index))
