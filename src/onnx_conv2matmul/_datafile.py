"""Writing a model with one external data file, at about the cost of copying the files.

A rewritten model keeps most of its bytes unchanged: every weight that is not
converted still sits in the input's data file(s), usually next to its neighbours.
The writer lays the output out in the model's tensor order, packed densely, and:

- copies each run of tensors that are adjacent both in a source file and in the
  output with one ``copy_file_range`` (the kernel copies; nothing is read into this
  process), falling back to buffered reads where the kernel cannot copy;
- in a second thread, materializes every other tensor (the transposed weights) one
  at a time and writes it at its offset, so memory stays bounded by the largest one;
- meanwhile serializes the ``.onnx`` file in the calling thread.

onnx-ir's own writer copies tensor by tensor; on a 2.4 GB encoder that is about
1.5x slower than one ``cp``. The ``.onnx`` refers to the data file exactly as
``onnx_ir.save(..., external_data=...)`` would write it, and the in-memory model is
left as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Iterator

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs

ProgressCallback = Callable[[int, int], None]

# Bytes per copy or buffered read: small enough to notice a cancel or a peer's error
# quickly, large enough that the call overhead does not show.
CHUNK_BYTES = 64 * 2**20
_BUFFER_BYTES = 8 * 2**20
# Errors that mean "the kernel cannot copy between these files", not "the copy failed".
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


@dataclasses.dataclass
class _Holder:
    """Where a tensor lives in the model: an initializer or a node's tensor attribute."""

    value: ir.Value | None = None
    node: ir.Node | None = None
    attribute: str = ""

    def get(self) -> ir.TensorProtocol:
        if self.value is not None:
            assert self.value.const_value is not None
            return self.value.const_value
        assert self.node is not None
        return self.node.attributes[self.attribute].as_tensor()

    def set(self, tensor: ir.TensorProtocol) -> None:
        if self.value is not None:
            self.value.const_value = tensor
        else:
            assert self.node is not None
            self.node.attributes[self.attribute] = ir.AttrTensor(self.attribute, tensor)


@dataclasses.dataclass
class _Copy:
    source: str
    source_offset: int
    offset: int
    length: int


@dataclasses.dataclass
class _Write:
    tensor: ir.TensorProtocol
    offset: int
    length: int


@dataclasses.dataclass
class Layout:
    """Where every tensor of the output goes and how its bytes get there."""

    copies: list[_Copy]
    writes: list[_Write]
    # (holder, tensor to serialize) for every tensor whose holder changes while saving.
    swaps: list[tuple[_Holder, ir.TensorProtocol]]
    size: int

    @property
    def copied_bytes(self) -> int:
        return sum(c.length for c in self.copies)


def _holders(model: ir.Model) -> Iterator[_Holder]:
    for graph, _ in walk_graphs(model.graph):
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield _Holder(value=value)
        for node in graph:
            for name, attr in node.attributes.items():
                if not attr.is_ref() and attr.type == ir.AttributeType.TENSOR:
                    yield _Holder(node=node, attribute=name)


def plan_layout(model: ir.Model, data_name: str, base_dir: str, threshold: int) -> Layout:
    """Place every tensor above ``threshold`` bytes in ``data_name``, densely, in model order.

    Tensors at or below the threshold are kept in the ``.onnx`` (read now if external).
    """
    copies: list[_Copy] = []
    writes: list[_Write] = []
    swaps: list[tuple[_Holder, ir.TensorProtocol]] = []
    placed: dict[int, ir.ExternalTensor] = {}  # one place for a tensor held twice
    offset = 0
    for holder in _holders(model):
        tensor = holder.get()
        nbytes = int(tensor.nbytes)
        if nbytes <= threshold:
            if isinstance(tensor, ir.ExternalTensor):
                swaps.append((holder, ir.tensor(tensor.numpy(), name=tensor.name)))
            continue
        if id(tensor) not in placed:
            placed[id(tensor)] = ir.ExternalTensor(
                data_name,
                offset,
                nbytes,
                tensor.dtype,
                shape=ir.Shape(tensor.shape.numpy()),
                name=tensor.name or "",
                base_dir=base_dir,
            )
            if isinstance(tensor, ir.ExternalTensor):
                source_offset = tensor.offset or 0
                last = copies[-1] if copies else None
                if (
                    last is not None
                    and last.source == tensor.path
                    and last.source_offset + last.length == source_offset
                    and last.offset + last.length == offset
                ):
                    last.length += nbytes
                else:
                    copies.append(_Copy(tensor.path, source_offset, offset, nbytes))
            else:
                writes.append(_Write(tensor, offset, nbytes))
            offset += nbytes
        swaps.append((holder, placed[id(tensor)]))
    return Layout(copies, writes, swaps, offset)


class _Cancelled(Exception):
    pass


class _Job:
    """Runs the copies and the writes in two threads; the first error stops both."""

    def __init__(self, layout: Layout, data_path: str, progress: ProgressCallback | None) -> None:
        self._layout = layout
        self._progress = progress
        self._lock = threading.Lock()
        self._done = 0
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(self._fd, layout.size)
        except BaseException:
            os.close(self._fd)
            raise
        self._threads = [
            threading.Thread(target=self._run, args=(self._copy_all,), daemon=True),
            threading.Thread(target=self._run, args=(self._write_all,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except _Cancelled:
            pass
        except BaseException as err:  # handed to the calling thread by finish()
            with self._lock:
                self._errors.append(err)
            self._stop.set()

    def _advance(self, nbytes: int) -> None:
        if self._stop.is_set():
            raise _Cancelled
        with self._lock:
            self._done += nbytes
            if self._progress is not None:
                self._progress(self._done, self._layout.size)

    def _copy_all(self) -> None:
        sources: dict[str, int] = {}
        try:
            for copy in self._layout.copies:
                if copy.source not in sources:
                    sources[copy.source] = os.open(copy.source, os.O_RDONLY)
                self._copy(sources[copy.source], copy)
        finally:
            for fd in sources.values():
                os.close(fd)

    def _copy(self, source: int, copy: _Copy) -> None:
        done = 0
        kernel = hasattr(os, "copy_file_range")
        while done < copy.length:
            size = min(CHUNK_BYTES, copy.length - done)
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
                raise OSError(errno.EIO, f"external data ended early: {copy.source}")
            done += moved
            self._advance(moved)

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

    def _write_all(self) -> None:
        for write in self._layout.writes:
            if self._stop.is_set():
                raise _Cancelled
            data = write.tensor.tobytes()
            if len(data) != write.length:
                raise ValueError(
                    f"tensor {write.tensor.name!r} has {len(data)} bytes, expected {write.length}"
                )
            self._pwrite(data, write.offset)
            del data
            self._advance(write.length)

    def finish(self, cancel: bool = False) -> None:
        """Wait for both threads; raise the first error. With ``cancel``, stop them first."""
        if cancel:
            self._stop.set()
        try:
            for thread in self._threads:
                thread.join()
        finally:
            os.close(self._fd)
        if self._errors:
            raise self._errors[0]


def save_with_data_file(
    model: ir.Model,
    onnx_path: str,
    data_name: str,
    *,
    threshold: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Write ``model`` to ``onnx_path`` and its tensors above ``threshold`` to ``data_name``.

    ``data_name`` is relative to the directory of ``onnx_path``; it is written even when
    every tensor is small enough to stay inline (then it is empty). The model is left
    unchanged.
    """
    base_dir = os.path.dirname(os.path.abspath(onnx_path))
    layout = plan_layout(model, data_name, base_dir, threshold)
    job = _Job(layout, os.path.join(base_dir, data_name), progress)
    originals = [(holder, holder.get()) for holder, _ in layout.swaps]
    try:
        for holder, tensor in layout.swaps:
            holder.set(tensor)
        ir.save(model, onnx_path)
    except BaseException:
        with contextlib.suppress(BaseException):  # the error that stopped us is the one to report
            job.finish(cancel=True)
        raise
    finally:
        for holder, tensor in originals:
            holder.set(tensor)
    job.finish()
