"""Where tensors lie in data files: their byte ranges, which source files are copied whole, the
alignment of the copies in the output's data file and the invariants of its layout (read by
:mod:`onnx_conv2matmul.files.datafile`).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import os
from typing import TYPE_CHECKING

import onnx

from onnx_conv2matmul.files.paths import contained_location

if TYPE_CHECKING:
    import numpy as np
    import onnx_ir as ir

# A source file is copied whole when the input model uses this share of its bytes.
WHOLE_FILE_MIN_USE = 0.99
# Copies of at least this size start on a page boundary of the output, where the kernel
# copies fastest; the padding costs at most 0.4% of the file.
_PAGE = 4096
_ALIGN_FROM_BYTES = 2**20
_INFINITY = float("inf")


def _normalize(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _range(tensor: ir.ExternalTensor) -> tuple[str, int, int]:
    start = tensor.offset or 0
    return _normalize(tensor.path), start, start + int(tensor.nbytes)


def read_external(tensor: ir.ExternalTensor) -> np.ndarray:
    """A copy of an external tensor's array, read from its own bytes only.

    onnx-ir's ``numpy()`` maps the whole data file for each tensor and keeps the mapping as long
    as the array lives: a few hundred small tensors of a 2.4 GB file reserve terabytes of
    address space, which a limit on it (``ulimit -v``) refuses. This reads the tensor's range.

    Raises:
        InputError: the file holds fewer bytes there than the tensor's shape and type take.
    """
    import numpy as np

    from onnx_conv2matmul.errors import InputError

    if tensor.dtype.bitwidth < 8:  # packed sub-byte types: onnx-ir unpacks them
        array = np.array(tensor.numpy())
        tensor.release()
        return array
    nbytes = int(tensor.nbytes)
    with open(tensor.path, "rb") as handle:
        handle.seek(tensor.offset or 0)
        data = bytearray(handle.read(nbytes))
    if len(data) != nbytes:
        raise InputError(
            f"{tensor.path}: tensor {tensor.name!r} takes {nbytes} bytes at offset {tensor.offset or 0},"
            f" the file holds {len(data)} there"
        )
    dtype = np.dtype(tensor.dtype.numpy()).newbyteorder("<")
    return np.frombuffer(data, dtype=dtype).reshape([int(d) for d in tensor.shape.numpy()])


@dataclasses.dataclass
class _Copy:
    """Bytes copied unchanged from a source file into the output."""

    source: str
    source_offset: int
    offset: int
    length: int

    def contains(self, path: str, start: int, end: int) -> bool:
        return path == self.source and self.source_offset <= start and end <= self.source_offset + self.length


@dataclasses.dataclass
class _Write:
    """A tensor materialized in this process and written at ``offset``."""

    tensor: ir.TensorProtocol
    offset: int
    length: int


def _align(offset: int, length: int) -> int:
    return -(-offset // _PAGE) * _PAGE if length >= _ALIGN_FROM_BYTES else offset


def _union_bytes(ranges: list[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for start, end in sorted(ranges):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


# Bytes per element of the types whose size the protobuf alone tells (sub-byte types are left out).
# Not ``ir.DataType.itemsize``: this runs on the protobuf before onnx-ir is imported, so that the
# copy starts sooner; and onnx's numpy mapping gives 1 byte for 4-bit types and 8 for strings.
_ITEMSIZE = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT16: 2,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.BOOL: 1,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.UINT32: 4,
    onnx.TensorProto.UINT64: 8,
    onnx.TensorProto.BFLOAT16: 2,
}


def external_ranges(proto: onnx.ModelProto, base_dir: str, threshold: int) -> dict[str, tuple[str, int, int]]:
    """Initializer name -> (file, start, end) of every external initializer of the main graph
    above ``threshold`` bytes.

    Read from the parsed protobuf, so the copy can start before the graph is built.
    Tensors of subgraphs and attributes are not listed: a file they share is then less
    likely to be copied whole, and their places are never reused, which is always safe.
    """
    ranges = {}
    sizes: dict[str, int | None] = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        itemsize = _ITEMSIZE.get(tensor.data_type)
        if "location" not in info or ("length" not in info and itemsize is None):
            continue  # left to the final layout, which knows every type
        path = contained_location(base_dir, info["location"])
        if path is None:
            continue  # the loader rejects the model
        try:
            start = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else math.prod(tensor.dims) * (itemsize or 0)
        except ValueError:
            continue  # not a number: the loader rejects the model
        if path not in sizes:
            try:
                sizes[path] = os.path.getsize(path)
            except OSError:
                sizes[path] = None
        size = sizes[path]
        if start < 0 or length < 0 or size is None or start + length > size:
            continue  # outside the file (or no file): the loader rejects the model
        if length > threshold:
            ranges[tensor.name] = (path, start, start + length)
    return ranges


def _whole_file_copies(ranges: list[tuple[str, int, int]]) -> tuple[list[_Copy], list[tuple[str, int, int]]]:
    """Copies of the files that ``ranges`` cover almost entirely, in order of first use,
    each from its first used byte to its last. Also returns the ranges inside the copies."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, start, end in ranges:
        by_file.setdefault(path, []).append((start, end))
    copies: list[_Copy] = []
    inside: list[tuple[str, int, int]] = []
    offset = 0
    for path, used in by_file.items():
        start = min(s for s, _ in used)
        end = max(e for _, e in used)
        if _union_bytes(used) < WHOLE_FILE_MIN_USE * (end - start):
            continue
        inside.extend((path, s, e) for s, e in used)
        offset = _align(offset, end - start)
        copies.append(_Copy(path, start, offset, end - start))
        offset += end - start
    return copies, inside


class _RangeIndex:
    """Byte ranges of files, sorted per file, to ask whether a range overlaps one of them."""

    def __init__(self, ranges: set[tuple[str, int, int]]) -> None:
        self._starts: dict[str, list[int]] = {}
        self._reach: dict[str, list[int]] = {}  # the furthest end among ranges up to each one
        for path, start, end in sorted(ranges):
            starts = self._starts.setdefault(path, [])
            reach = self._reach.setdefault(path, [])
            starts.append(start)
            reach.append(max(end, reach[-1]) if reach else end)

    def overlaps(self, path: str, start: int, end: int) -> bool:
        before = bisect.bisect_left(self._starts.get(path, []), end)  # ranges starting before `end`
        return before > 0 and self._reach[path][before - 1] > start


def _queue_copy(copies: list[_Copy], tensor: ir.ExternalTensor, end_of_file: int) -> tuple[int, int]:
    """Copy ``tensor`` to the end of the file, in one run with the previous copy if adjacent.

    Returns its offset and the new end of the file.
    """
    path, start, end = _range(tensor)
    last = copies[-1] if copies else None
    if (
        last is not None
        and last.source == path
        and last.source_offset + last.length == start
        and last.offset + last.length == end_of_file
    ):
        last.length += end - start
        return end_of_file, end_of_file + end - start
    offset = _align(end_of_file, end - start)
    copies.append(_Copy(path, start, offset, end - start))
    return offset, offset + end - start


def _check_layout(
    copies: list[_Copy],
    writes: list[_Write],
    placed: list[ir.ExternalTensor],
    early_end: int,
    end_of_file: int,
) -> None:
    """Assert the layout's invariants; a failure is a bug of this module.

    1. The late copies lie after the early ones, in increasing order, without overlap.
    2. No two writes overlap, and none overlaps a late copy.
    3. A write inside the early copies takes the place of a dead tensor, so no tensor of
       the final model other than itself lies there.
    4. Every placed tensor lies inside the file.
    """
    reach = early_end
    for copy in copies:
        assert copy.offset >= reach, f"late copy at {copy.offset} overlaps what comes before {reach}"
        reach = copy.offset + copy.length
    spans = sorted(
        [(w.offset, w.offset + w.length) for w in writes] + [(c.offset, c.offset + c.length) for c in copies]
    )
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"a write overlaps another write or a copy at {start}"
    own = {(w.offset, w.length) for w in writes}
    for tensor in placed:
        start, end = int(tensor.offset or 0), int(tensor.offset or 0) + int(tensor.length or 0)
        assert start >= 0 and end <= end_of_file, f"tensor {tensor.name!r} lies outside the file"
        if (start, end - start) in own:
            continue
        index = bisect.bisect_right(spans, (start, _INFINITY))
        for span_start, span_end in spans[max(0, index - 1) : index + 1]:
            if (span_start, span_end - span_start) in own:
                assert span_end <= start or end <= span_start, f"a new tensor is written over {tensor.name!r}"
