"""Real inputs of any size: read in place, fed in chunks of samples, their reference kept on disk.

A user's ``--inputs`` file is never refused for its size. The memory budget
(:attr:`VerifyOptions.memory`) decides how the file's samples are fed, not whether:

- **Reading.** An ``.npz`` member that numpy stored uncompressed (``numpy.savez``) is
  memory-mapped where it lies in the archive (:func:`map_member`), so a 700 MB file costs
  nothing until rows are read; a compressed member (``savez_compressed``) is read whole.
- **Samples.** A feed whose float inputs of rank 2 or more (integer ones, ids, when it has
  no such float input) share their first dim ``B`` holds ``B`` samples (batch rows); every
  input whose first axis has ``B`` rows is cut
  along it (:func:`sample_rows`), and so is a state whose samples lie on another axis
  (``[layers, batch, size]``, :func:`cut_inputs`); the others (scalars, tables) are fed
  whole with each chunk. A model whose sample axis is a static 1 takes them one at a time.
- **Chunks.** Each chunk of rows holds at most a third of the budget in inputs and one
  model's outputs (:func:`chunk_rows`): the reference's outputs, the candidate's and the
  inputs then fit at once. Only a single sample that does not fit is refused.
- **Reference on disk.** When the reference outputs of every chunk do not fit the budget
  together, the original's outputs go to ``.npy`` files in a temporary directory
  (:class:`Spill`) and are read back memory-mapped when the candidate's arrive.
- **Reduction.** The rows of one output over the chunks of one file are merged into one
  (:func:`merge_rows`): the largest differences, the element-weighted mean, the worst
  cosines, the samples summed.
"""

# pragma: no mutate start
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
import weakref
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Protocol

import numpy as np

from onnx_conv2matmul.verify.compare import OutputComparison, worst_cosine

CHUNK_SHARE = 3
"""A chunk holds at most ``memory // CHUNK_SHARE`` of inputs plus one model's outputs."""


def map_member(
    path: str, info: zipfile.ZipInfo, shape: tuple[int, ...], dtype: np.dtype, fortran: bool, header: int
) -> np.ndarray | None:
    """The ``.npy`` member ``info`` of the archive at ``path`` memory-mapped in place, its array's
    header (shape, dtype, order and length) as :func:`_member_header` read it; None when it is
    compressed or empty (then read it as usual)."""
    if info.compress_type != zipfile.ZIP_STORED or math.prod(shape) == 0:
        return None
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        local = handle.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        return None
    name_length = int.from_bytes(local[26:28], "little")
    extra_length = int.from_bytes(local[28:30], "little")
    offset = info.header_offset + 30 + name_length + extra_length + header
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


INFLATE_IN_MEMORY_BYTES = 16 * 2**20
"""A compressed array up to this size is read into memory; a larger one is inflated into an
anonymous temporary file (the system removes it however the process ends) and memory-mapped, so
a small archive that declares a large array never has to fit in memory at once."""


def _member_header(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo
) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """The shape, dtype and order an ``.npy`` member declares, and its header's length in bytes,
    read from the member's first bytes (inflating only those when it is compressed).

    Raises:
        ValueError: not a plain ``.npy`` array.
    """
    with archive.open(info) as member:
        try:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
            else:  # 3.0 (UTF-8 field names of structured arrays): no input of a model has them
                raise ValueError(f".npy version {version[0]}.{version[1]}, which holds no model input")
        except ValueError as err:
            raise ValueError(f"member {info.filename!r} is not a .npy array ({err})") from err
        return tuple(int(d) for d in shape), dtype, bool(fortran), member.tell()


def _inflated(
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    header: int,
    shape: tuple[int, ...],
    dtype: np.dtype,
    fortran: bool,
) -> np.ndarray:
    """A compressed member inflated into an anonymous temporary file, chunk by chunk, and mapped.

    Raises:
        ValueError: the array is larger than the space free where temporary files go.
    """
    folder = tempfile.gettempdir()
    size = math.prod(shape) * dtype.itemsize
    free = shutil.disk_usage(folder).free
    if size > free:
        raise ValueError(
            f"compressed array {info.filename!r} inflates to {size / 2**30:.1f} GiB, more than the"
            f" {free / 2**30:.1f} GiB free in {folder} (TMPDIR sets where it goes)"
        )
    with tempfile.TemporaryFile(prefix="onnx-conv2matmul-inputs-") as scratch, archive.open(info) as member:
        member.read(header)
        shutil.copyfileobj(member, scratch, 1 << 22)
        scratch.flush()
        return np.memmap(scratch, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C")


def read_npz(path: str | BinaryIO) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file: each member's size is read from its own header first and
    checked against what the archive says the member holds; an array is memory-mapped where it
    is stored uncompressed, inflated into a mapped temporary file when compressed and larger than
    :data:`INFLATE_IN_MEMORY_BYTES`, read into memory otherwise.

    Raises:
        OSError, ValueError, EOFError, zipfile.BadZipFile: as ``numpy.load`` does; ValueError also
            when a member's header and the archive disagree on its size.
    """
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            shape, dtype, fortran, header = _member_header(archive, info)
            if dtype.hasobject:
                raise ValueError(f"array {name!r} holds Python objects, which are not read (no pickles)")
            declared = header + math.prod(shape) * dtype.itemsize
            if info.file_size != declared:
                raise ValueError(
                    f"array {name!r} declares shape {shape} of {dtype} ({declared} bytes with its"
                    f" header), but the archive holds {info.file_size} bytes for it"
                )
            # A pipe's bytes are read; a file's stored arrays are mapped where they lie.
            mapped = map_member(path, info, shape, dtype, fortran, header) if isinstance(path, str) else None
            if mapped is not None:
                arrays[name] = mapped
            elif info.compress_type != zipfile.ZIP_STORED and declared > INFLATE_IN_MEMORY_BYTES:
                arrays[name] = _inflated(archive, info, header, shape, dtype, fortran)
            else:
                with archive.open(info) as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
    return arrays


def feed_rows(feed: Mapping[str, np.ndarray]) -> int:
    """The samples a feed holds: the first dim its float inputs of rank 2 or more share (its
    integer ones, token or byte ids, when it has no such float input), else 1."""
    arrays = [a for a in feed.values() if isinstance(a, np.ndarray) and a.ndim >= 2]
    floats = [a for a in arrays if np.issubdtype(a.dtype, np.floating)]
    ids = [a for a in arrays if np.issubdtype(a.dtype, np.integer)]
    firsts = {int(array.shape[0]) for array in (floats or ids)}
    return firsts.pop() if len(firsts) == 1 else 1


class SpecLike(Protocol):
    """What the chunking reads of a model input (``verify.roles.InputSpec``): its name and shape."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> list[int | str | None]: ...


def spec_rows(specs: Sequence[SpecLike], feed: Mapping[str, np.ndarray]) -> int:
    """The samples a feed holds for a model: :func:`feed_rows` of the inputs whose first axis the
    model leaves free (or fixes at 1); else 1."""
    free = {
        spec.name
        for spec in specs
        if len(spec.shape) >= 2 and not (isinstance(spec.shape[0], int) and spec.shape[0] > 1)
    }
    return feed_rows({name: array for name, array in feed.items() if name in free})


def _free(shape: Sequence[int | str | None], axis: int) -> bool:
    """Whether the model leaves ``axis`` of an input free for samples (not a static size above 1)."""
    dim = shape[axis] if axis < len(shape) else None
    return not (isinstance(dim, int) and dim > 1)


def cut_inputs(specs: Sequence[SpecLike], feed: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The inputs cut into samples when the feed is fed in chunks, each with the axis it is cut
    along: the first axis, or, for an input whose first axis is not the samples' (a recurrent
    state ``[layers, batch, size]``), the free axis with as many rows that the model names as
    the samples' dim, or, when the model leaves it unnamed, the only such free axis."""
    rows = spec_rows(specs, feed)
    if rows <= 1:
        return {}
    shapes = {spec.name: list(spec.shape) for spec in specs}
    cut = {
        name: 0
        for name, array in feed.items()
        if name in shapes and array.ndim >= 1 and array.shape[0] == rows and _free(shapes[name], 0)
    }
    batch = {dim for name in cut for dim in shapes[name][:1] if isinstance(dim, str)}
    for name, array in feed.items():
        if name in cut or name not in shapes or array.ndim < 2:
            continue
        shape = shapes[name]
        axes = [k for k in range(1, array.ndim) if array.shape[k] == rows and _free(shape, k)]
        dims = [shape[k] if k < len(shape) else None for k in axes]
        named = [k for k, dim in zip(axes, dims, strict=True) if dim in batch]
        # Without the samples' name, an unnamed axis (or any named one, when the samples'
        # dim has no name either); a dim named otherwise is another dim of equal size.
        other = [
            k
            for k, dim in zip(axes, dims, strict=True)
            if dim is None or (not batch and isinstance(dim, str))
        ]
        choice = named or other
        if len(choice) == 1:
            cut[name] = choice[0]
    return cut


def one_at_a_time(specs: Sequence[SpecLike], cut: Mapping[str, int]) -> bool:
    """Whether the model's sample axis is a static 1 for the inputs ``cut`` (see
    :func:`cut_inputs`) where the feed holds several samples."""
    return any(
        spec.name in cut and len(spec.shape) > cut[spec.name] and spec.shape[cut[spec.name]] == 1
        for spec in specs
    )


def sample_rows(
    feed: Mapping[str, np.ndarray], cut: Mapping[str, int], start: int, stop: int
) -> dict[str, np.ndarray]:
    """Samples ``start:stop`` of the inputs in ``cut`` (read into memory), each along its
    axis, the others as they are.

    The pages of a memory-mapped file that were read are given back at once: they are the
    file's, and would otherwise count in the process's memory until the whole file was read.
    """
    rows = {}
    for name, view in sample_views(feed, cut, start, stop).items():
        if name in cut:
            rows[name] = np.array(view, order="C")
            _drop_pages(feed[name])
        else:
            rows[name] = np.asarray(view)
    return rows


def sample_views(
    feed: Mapping[str, np.ndarray], cut: Mapping[str, int], start: int, stop: int
) -> dict[str, np.ndarray]:
    """Samples ``start:stop`` of the inputs in ``cut``, as views along their axis (nothing read),
    the others as they are."""
    return {
        name: array[(slice(None),) * cut[name] + (slice(start, stop),)] if name in cut else array
        for name, array in feed.items()
    }


def _drop_pages(array: np.ndarray) -> None:
    import mmap

    mapped = getattr(array, "_mmap", None)
    if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(mmap.MADV_DONTNEED)


def chunk_rows(rows: int, per_row: int, fixed: int, memory: int, *, single: bool = False) -> int | None:
    """How many samples a chunk takes: as many as keep ``fixed + rows * per_row`` bytes within
    a :data:`CHUNK_SHARE` share of ``memory`` (1 with ``single``); None when one does not fit
    the whole budget (inputs and both models' outputs)."""
    if fixed + 2 * per_row > memory:
        return None
    if single:
        return 1
    share = memory // CHUNK_SHARE
    return max(1, min(rows, (share - fixed) // max(per_row, 1)))


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Rows ``start:stop`` of feed ``feed`` (0-based); ``rows`` None: the feed as it is."""

    feed: int
    start: int
    stop: int
    cut: frozenset[tuple[str, int]] = frozenset()
    """The inputs cut into samples, each with its axis (see :func:`cut_inputs`)."""

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def inputs(self, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        feed = feeds[self.feed]
        if not self.cut:
            return {name: np.asarray(array) for name, array in feed.items()}
        return sample_rows(feed, dict(self.cut), self.start, self.stop)


class ChunkedFeeds(Sequence[Mapping[str, np.ndarray]]):
    """The chunks of real inputs as a sequence of feeds, each read when it is asked for."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]], chunks: Sequence[Chunk]) -> None:
        self.feeds, self.chunks = feeds, list(chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.chunks[index].inputs(self.feeds)

    def __iter__(self) -> Iterator[Mapping[str, np.ndarray]]:
        for chunk in self.chunks:
            yield chunk.inputs(self.feeds)


class Spill:
    """The reference outputs of a check, on disk: one ``.npy`` file per run and output.

    The directory goes with :meth:`close`, or when the last :class:`Spilled` of it is
    garbage (whoever holds the outputs, e.g. a step that compares several candidates).
    """

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="onnx-conv2matmul-reference-")
        self._held: dict[tuple[int, int], Any] = {}
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    def put(self, run: int, outputs: Sequence[Any]) -> Spilled:
        """Keep one run's outputs on disk (anything but a numeric tensor in memory)."""
        for index, value in enumerate(outputs):
            if isinstance(value, np.ndarray) and value.dtype != object:
                np.save(self._path(run, index), value, allow_pickle=False)
            else:
                self._held[(run, index)] = value
        return Spilled(self, run, len(outputs))

    def get(self, run: int, count: int) -> list[Any]:
        """One run's outputs, tensors memory-mapped."""
        return [
            self._held[(run, index)]
            if (run, index) in self._held
            else np.load(self._path(run, index), mmap_mode="r")
            for index in range(count)
        ]

    def _path(self, run: int, output: int) -> str:
        return os.path.join(self.directory, f"{run}-{output}.npy")

    def close(self) -> None:
        self._remove()


class Spilled(list[Any]):
    """One run's reference outputs kept on disk by a :class:`Spill`: :meth:`load` reads them."""

    def __init__(self, spill: Spill, run: int, count: int) -> None:
        super().__init__()
        self.spill, self.run, self.outputs = spill, run, count

    def load(self) -> list[Any]:
        return self.spill.get(self.run, self.outputs)


def merge_rows(rows: Sequence[OutputComparison], chunk_samples: Sequence[int] = ()) -> OutputComparison:
    """One row for an output over the chunks of one file (see the module's documentation);
    ``chunk_samples``: the samples of each chunk, which find the axis an output holds them on."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    failed = [r for r in rows if not r.passed]
    elements = [max(1, math.prod(r.shape)) for r in rows]
    mean = sum(r.mean_abs * n for r, n in zip(rows, elements, strict=True)) / sum(elements)
    cosines = [r.cosine for r in rows if r.cosine is not None]
    shape = list(first.shape)
    if shape:
        axis = _sample_axis(rows, chunk_samples or [r.samples for r in rows])
        shape[axis] = sum(r.shape[axis] if len(r.shape) > axis else 1 for r in rows)
    samples = sum(r.samples for r in rows)
    return OutputComparison(
        length=first.length,
        output=first.output,
        dtype=first.dtype,
        shape=shape,
        max_abs=max(r.max_abs for r in rows),
        mean_abs=mean,
        rel_err=max(r.rel_err for r in rows),
        cosine=min(cosines) if cosines else None,
        max_ref=max(r.max_ref for r in rows),
        mismatches=-1 if any(r.mismatches < 0 for r in rows) else sum(r.mismatches for r in rows),
        passed=not failed,
        note=failed[0].note if failed else first.note,
        samples=samples,
        sample_cosine=worst_cosine(rows) if samples > 1 else None,
        labels=sum(r.labels for r in rows),
        label_flips=sum(r.label_flips for r in rows),
        task=first.task,
    )


def _sample_axis(rows: Sequence[OutputComparison], samples: Sequence[int]) -> int:
    """The axis of an output that holds the samples of each chunk: the first whose size is the
    chunk's samples in every chunk (a state ``[layers, batch, size]`` holds them on axis 1)."""
    rank = min(len(r.shape) for r in rows)
    for axis in range(rank):
        if all(r.shape[axis] == n for r, n in zip(rows, samples, strict=False)):
            return axis
    return 0


# pragma: no mutate end
