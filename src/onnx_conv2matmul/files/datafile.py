"""Writing a model with one external data file, at about the cost of copying the files.

A rewritten model keeps most of its bytes: every weight that is not converted is
unchanged, and a converted weight is replaced by its transpose, of the same size.
So the output's data file is laid out as a copy of the input's data file(s), with
each transposed weight written over the place of the weight it replaces.

- :class:`DataFileWriter` starts copying the input's data files as soon as its protobuf
  is parsed, in a thread, while the graph is built, checked and rewritten. The kernel
  copies (``copy_file_range``, in chunks, with a buffered fallback): nothing is read
  into this process, and whole files copy as fast as ``cp``.
- When the model is final, :meth:`DataFileWriter.finish` places every tensor: an
  unchanged one where its copy is; a new one in the place of a dead tensor of the same
  size (the copy then leaves those old bytes out if it has not reached them), or else
  at the end; ``files.ranges._check_layout`` asserts that no two placements collide. A second
  thread materializes new tensors one at a time and writes each (those the copy has not
  reached first, the others once it has passed them), so memory stays bounded by the
  largest tensor. Meanwhile the calling thread serializes the ``.onnx``.
- Writeback to disk is started as each chunk is written, and the file is fsynced at the
  end, so an output is durable before it is published.
- A data file with more than 1% of its bytes unused by the input model is not copied
  whole; its tensors are copied in runs once the model is final, so the output does
  not inherit dead bytes. :func:`save_with_data_file` lays out a final model this way
  from the start (the quantizer, which replaces most weights, uses it).

The ``.onnx`` refers to the data file as ``onnx_ir.save(..., external_data=...)``
would write it, and the in-memory model is left as it was. Only
:mod:`onnx_conv2matmul.files.output` uses this module.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from onnx_conv2matmul.files.ranges import (
    _align,
    _check_layout,
    _Copy,
    _queue_copy,
    _range,
    _RangeIndex,
    _whole_file_copies,
    _Write,
    read_external,
)

if TYPE_CHECKING:  # imported where used: the copy starts before onnx-ir is imported
    import onnx_ir as ir

    from onnx_conv2matmul._graphs import TensorHolder

ProgressCallback = Callable[[int, int], None]

# Bytes per copy or buffered read: small enough to notice a cancel or a peer's error
# quickly, large enough that the call overhead does not show.
CHUNK_BYTES = 64 * 2**20
_BUFFER_BYTES = 8 * 2**20
_PROGRESS_SECONDS = 0.1
_INFINITY = float("inf")
# Errors that mean "the kernel cannot copy between these files", not "the copy failed".
_HAS_FADVISE = sys.platform.startswith("linux") and hasattr(os, "posix_fadvise")
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


class DataFileWriter:
    """Writes one external data file in two threads: copies, then materialized tensors.

    Copies are made in increasing output order; a write into copied bytes waits until
    the copy has passed it. The first error stops both threads and is raised by
    :meth:`finish`.
    """

    def __init__(
        self,
        data_path: str,
        early_copies: list[_Copy] | None = None,
        early_tensors: list[tuple[str, int, int]] | None = None,
    ) -> None:
        self.data_path = data_path
        early_copies = early_copies or []
        # Per source file, its early copies by source offset (a file may be copied in pieces).
        self._early_by_file: dict[str, list[_Copy]] = {}
        for copy in sorted(early_copies, key=lambda c: c.source_offset):
            self._early_by_file.setdefault(copy.source, []).append(copy)
        self._early_starts = {
            path: [c.source_offset for c in copies] for path, copies in self._early_by_file.items()
        }
        # The tensor ranges inside the early copies: a dead one is a place for a new tensor.
        self._early_tensors = early_tensors or []
        self._early_end = max((c.offset + c.length for c in early_copies), default=0)
        self._copies: queue.Queue[_Copy | None] = queue.Queue()
        self._copied_until = 0
        # The end of the chunk being copied, set with the skips it saw (under the lock).
        self._copy_reach = 0
        # Output ranges inside the early copies that new tensors will fill, sorted.
        self._skips: list[tuple[int, int]] = []
        self._all_copied = False
        self._done = 0
        self._total = self._early_end
        self._condition = threading.Condition()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._writer: threading.Thread | None = None
        self._fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            self._grow(self._early_end)
        except BaseException:
            os.close(self._fd)
            raise
        for copy in early_copies:
            self._copies.put(copy)
        self._copier = threading.Thread(target=self._run, args=(self._copy_all,), daemon=True)
        self._copier.start()

    @classmethod
    def start(cls, data_path: str, ranges: list[tuple[str, int, int]]) -> DataFileWriter:
        """Start copying the files that the tensors at ``ranges`` use almost entirely."""
        return cls(data_path, *_whole_file_copies(ranges))

    def _grow(self, size: int) -> None:
        """Extend the file to ``size`` (never shrink it: on ext4, truncating a file to 0 makes
        its close wait until the data is allocated on disk, a long stall on large files)."""
        if size > os.fstat(self._fd).st_size:
            os.ftruncate(self._fd, size)

    # -- threads -----------------------------------------------------------------

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except _Cancelled:
            pass
        except BaseException as err:  # handed to the calling thread by finish()
            with self._condition:
                self._errors.append(err)
                self._condition.notify_all()
            self._stop.set()

    def _advance(self, nbytes: int, copied_until: int | None = None) -> None:
        if self._stop.is_set():
            raise _Cancelled
        with self._condition:
            self._done += nbytes
            if copied_until is not None:
                self._copied_until = copied_until
            self._condition.notify_all()

    def _copy_all(self) -> None:
        sources: dict[str, int] = {}
        try:
            while (copy := self._copies.get()) is not None:
                if copy.source not in sources:
                    sources[copy.source] = os.open(copy.source, os.O_RDONLY)
                self._copy(sources[copy.source], copy)
        finally:
            for fd in sources.values():
                os.close(fd)
            with self._condition:
                self._all_copied = True
                self._condition.notify_all()

    def _next_skip(self, offset: int) -> tuple[int, int] | None:
        """The first range the copy may leave out that ends after ``offset``."""
        skips = self._skips  # replaced whole by _layout, never changed in place
        index = bisect.bisect_right(skips, (offset, _INFINITY))
        if index and skips[index - 1][1] > offset:
            return skips[index - 1]
        return skips[index] if index < len(skips) else None

    def _copy(self, source: int, copy: _Copy) -> None:
        done = 0
        kernel = hasattr(os, "copy_file_range")
        end = copy.offset + copy.length
        while done < copy.length:
            offset = copy.offset + done
            with self._condition:
                skip = self._next_skip(offset)
                if skip is None or skip[0] > offset:
                    size = min(CHUNK_BYTES, copy.length - done, (skip[0] if skip else end) - offset)
                    self._copy_reach = offset + size
            if skip is not None and skip[0] <= offset:
                # A new tensor will be written here: copying the old bytes would be wasted.
                step = min(skip[1], end) - offset
                done += step
                self._advance(step, copied_until=offset + step)
                continue
            if kernel:
                try:
                    moved = os.copy_file_range(
                        source, self._fd, size, copy.source_offset + done, copy.offset + done
                    )
                except OSError as err:
                    if err.errno not in _NO_KERNEL_COPY:
                        raise
                    kernel = False
                    continue
            else:
                moved = self._copy_buffered(source, copy.source_offset + done, copy.offset + done, size)
            if moved == 0:
                raise OSError(errno.EIO, f"external data file ended early: {copy.source}")
            _start_writeback(self._fd, copy.offset + done, moved)
            done += moved
            self._advance(moved, copied_until=copy.offset + done)

    def _copy_buffered(self, source: int, source_offset: int, offset: int, size: int) -> int:
        moved = 0
        while moved < size:
            chunk = os.pread(source, min(_BUFFER_BYTES, size - moved), source_offset + moved)
            if not chunk:
                break
            self._pwrite(chunk, offset + moved)
            moved += len(chunk)
        return moved

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view = view[written:]
            offset += written

    def _write_all(self, writes: list[_Write], copy_reach: int) -> None:
        """Write ``writes``: first those at or beyond ``copy_reach``, at once, then the others,
        each once the copy has passed it.

        The copy never writes beyond ``copy_reach`` into a place that a new tensor takes:
        it had seen the places when it started every chunk after that point.
        """
        ahead = [w for w in writes if w.offset >= copy_reach]
        behind = [w for w in writes if w.offset < copy_reach]
        for write in ahead + behind:
            if self._stop.is_set():
                raise _Cancelled
            data = _payload(write.tensor)
            if len(data) != write.length:
                raise ValueError(
                    f"tensor {write.tensor.name!r} has {len(data)} bytes, expected {write.length}"
                )
            if write.offset < copy_reach:
                # The copy may have written its place already: write over it once it has.
                self._wait_for_copy(write.offset + write.length)
            self._pwrite(data, write.offset)
            _start_writeback(self._fd, write.offset, write.length)
            del data
            self._advance(write.length)

    def _wait_for_copy(self, end: int) -> None:
        with self._condition:
            self._condition.wait_for(
                lambda: self._copied_until >= end or self._all_copied or self._stop.is_set()
            )
        if self._stop.is_set():
            raise _Cancelled

    # -- placing the final model ---------------------------------------------------

    def _layout(
        self, model: ir.Model, data_name: str, threshold: int
    ) -> list[tuple[TensorHolder, ir.TensorProtocol]]:
        """Place every tensor; queue the remaining copies and start the writes.

        Returns, for each tensor holder that changes while the ``.onnx`` is written,
        the tensor to write there.
        """
        import onnx_ir as ir

        from onnx_conv2matmul._graphs import is_external, tensor_holders

        base_dir = os.path.dirname(os.path.abspath(self.data_path))
        entries = [(holder, holder.get()) for holder in tensor_holders(model)]
        live = {_range(t) for _, t in entries if is_external(t) and int(t.nbytes) > threshold}
        live_index = _RangeIndex(live)
        # Places inside the early copies that no tensor of the final model uses. Two dead
        # tensors may share bytes (an exporter that deduplicates weights): a place is given once.
        free: dict[int, list[int]] = {}
        taken_until: dict[str, int] = {}
        for path, start, end in sorted(set(self._early_tensors)):
            if (path, start, end) in live or start < taken_until.get(path, 0):
                continue
            if live_index.overlaps(path, start, end):
                continue
            taken_until[path] = end
            offset = self._copied_offset(path, start, end)
            assert offset is not None
            free.setdefault(end - start, []).append(offset)
        copies: list[_Copy] = []
        writes: list[_Write] = []
        swaps: list[tuple[TensorHolder, ir.TensorProtocol]] = []
        placed: dict[int, ir.ExternalTensor] = {}  # one place for a tensor held twice
        end_of_file = self._early_end
        for holder, tensor in entries:
            nbytes = int(tensor.nbytes)
            if nbytes <= threshold:
                if is_external(tensor):  # its own bytes, not a mapping of the whole file
                    swaps.append((holder, ir.tensor(read_external(tensor), name=tensor.name)))
                continue
            if id(tensor) not in placed:
                if is_external(tensor):
                    offset = self._copied_offset(*_range(tensor))
                    if offset is None:
                        offset, end_of_file = _queue_copy(copies, tensor, end_of_file)
                else:
                    if free.get(nbytes):
                        offset = free[nbytes].pop(0)
                    else:
                        offset = _align(end_of_file, nbytes)
                        end_of_file = offset + nbytes
                    writes.append(_Write(tensor, offset, nbytes))
                placed[id(tensor)] = ir.ExternalTensor(
                    data_name,
                    offset,
                    nbytes,
                    tensor.dtype,
                    shape=ir.Shape([int(d) for d in tensor.shape.numpy()]),
                    name=tensor.name or "",
                    base_dir=base_dir,
                )
            swaps.append((holder, placed[id(tensor)]))
        self._grow(end_of_file)
        writes.sort(key=lambda w: w.offset)
        _check_layout(copies, writes, list(placed.values()), self._early_end, end_of_file)
        with self._condition:
            self._skips = [(w.offset, w.offset + w.length) for w in writes if w.offset < self._early_end]
            copy_reach = self._copy_reach
            self._total = self._early_end + sum(c.length for c in copies) + sum(w.length for w in writes)
        for copy in copies:
            self._copies.put(copy)
        self._copies.put(None)
        self._writer = threading.Thread(
            target=self._run, args=(lambda: self._write_all(writes, copy_reach),), daemon=True
        )
        self._writer.start()
        return swaps

    def _copied_offset(self, path: str, start: int, end: int) -> int | None:
        """Where the bytes ``[start, end)`` of ``path`` are in the output, if copied early."""
        index = bisect.bisect_right(self._early_starts.get(path, []), start) - 1
        if index < 0:
            return None
        copy = self._early_by_file[path][index]
        return copy.offset + start - copy.source_offset if copy.contains(path, start, end) else None

    # -- the end ---------------------------------------------------------------------

    def finish(
        self,
        model: ir.Model,
        onnx_path: str,
        *,
        threshold: int,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Place ``model``'s tensors, write the ``.onnx`` and wait for the data file."""
        import onnx_ir as ir

        data_name = os.path.basename(self.data_path)
        try:
            swaps = self._layout(model, data_name, threshold)
            originals = [(holder, holder.get()) for holder, _ in swaps]
            try:
                for holder, tensor in swaps:
                    holder.set(tensor)
                ir.save(model, onnx_path)
            finally:
                for holder, tensor in originals:
                    holder.set(tensor)
            self._wait(progress)
        except BaseException:
            self.cancel()
            raise

    def _wait(self, progress: ProgressCallback | None) -> None:
        threads = [t for t in (self._copier, self._writer) if t is not None]
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(_PROGRESS_SECONDS)
            if progress is not None:
                with self._condition:
                    progress(self._done, self._total)
        if self._errors:
            raise self._errors[0]
        os.fsync(self._fd)  # little is left to write: see _start_writeback
        os.close(self._fd)
        self._fd = -1

    def cancel(self) -> None:
        """Stop both threads and wait for them (their errors are dropped)."""
        self._stop.set()
        self._copies.put(None)
        with self._condition:
            self._condition.notify_all()
        for thread in (self._copier, self._writer):
            if thread is not None:
                thread.join()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes at ``offset`` to disk, without waiting.

    The data file is fsynced before it is published; started as each chunk is written,
    the writeback runs alongside the copy instead of all at the end. On Linux,
    ``POSIX_FADV_DONTNEED`` starts the writeback of dirty pages (and drops only pages
    already clean). Elsewhere this does nothing.
    """
    if _HAS_FADVISE and length > 0:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _payload(tensor: ir.TensorProtocol) -> bytes | memoryview:
    """The bytes of ``tensor`` as the data file holds them, as ``tensor.tobytes()`` gives them.

    A type of whole bytes on a little-endian host is written straight from its array:
    ``tobytes()`` would copy every weight once more.
    """
    import onnx_ir as ir

    if sys.byteorder == "little" and tensor.dtype != ir.DataType.STRING and tensor.dtype.bitwidth % 8 == 0:
        array = np.ascontiguousarray(tensor.numpy())
        return array.reshape(-1).view(np.uint8).data
    return tensor.tobytes()


def save_with_data_file(
    model: ir.Model,
    onnx_path: str,
    data_name: str,
    *,
    threshold: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Write ``model`` and its tensors above ``threshold`` bytes into ``data_name``, densely.

    ``data_name`` is relative to the directory of ``onnx_path``; it is written even when
    every tensor is small enough to stay inline (then it is empty).
    """
    data_path = os.path.join(os.path.dirname(os.path.abspath(onnx_path)), data_name)
    DataFileWriter(data_path).finish(model, onnx_path, threshold=threshold, progress=progress)


class _Cancelled(Exception):
    pass
