"""The write path: a model in, its files out at the destination, never half written.

:class:`Output` is the only way in. It holds the destination for the run (see
:class:`~onnx_conv2matmul.files.publish.Destination`: the lock, the data file's name, the
atomic publishing), stages the model's files in a hidden directory beside it, and hands
back a :class:`Staged` output to check, then publish or keep aside.

Writing costs about one copy of the files (see :mod:`onnx_conv2matmul.files.datafile`). When
the input keeps its weights in external data, :meth:`Output.prefetch` starts copying its
data files into the new data file as soon as the input is parsed, while the graph is
built and rewritten; :meth:`Output.stage` then places the final model's tensors. Without
it, :meth:`Output.stage` lays the data file out from the final model alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import onnx

from onnx_conv2matmul.errors import Hint, InputError
from onnx_conv2matmul.files import datafile as _datafile
from onnx_conv2matmul.files import owned
from onnx_conv2matmul.files import publish as _publish
from onnx_conv2matmul.files.datafile import ProgressCallback
from onnx_conv2matmul.files.modes import PERMISSION_BITS, usual_mode
from onnx_conv2matmul.files.ranges import external_ranges

if TYPE_CHECKING:  # imported where used: the copy starts before onnx-ir is imported
    import onnx_ir as ir

# Tensors at or below this size stay inside the .onnx file: onnxruntime cannot read
# shape-like inputs (Reshape shapes, axes) from external data.
INLINE_THRESHOLD_BYTES = 1024


def save(
    model: ir.Model, onnx_path: str, data_name: str | None, *, progress: ProgressCallback | None = None
) -> None:
    """Write ``model`` to ``onnx_path`` as it is, with no staging (a scratch copy).

    With ``data_name``, tensors above :data:`INLINE_THRESHOLD_BYTES` go into that data file
    beside it, wherever the model's tensors were (attributes and subgraphs included).
    """
    if data_name is not None:
        _datafile.save_with_data_file(
            model, onnx_path, data_name, threshold=INLINE_THRESHOLD_BYTES, progress=progress
        )
    else:
        import onnx_ir as ir

        ir.save(model, onnx_path)


def file_modes(onnx_path: str, data_files: list[str]) -> tuple[int, int]:
    """Permission bits for an output's ``.onnx`` and data file: those of the input's, without
    setuid, setgid or sticky (as ``install`` copies a file's bits).

    The data file takes the bits of the input's first data file (or of its ``.onnx``
    when it had none), so weights kept private stay private.
    """
    onnx_mode = os.stat(onnx_path).st_mode & PERMISSION_BITS
    data_mode = os.stat(data_files[0]).st_mode & PERMISSION_BITS if data_files else onnx_mode
    return onnx_mode, data_mode


class Output:
    """One model written to ``path`` (a context manager; see the module docstring).

    Args:
        path: The ``.onnx`` to write or replace.
        source: The input model when it is not the destination: its files are never removed.

    Raises:
        DestinationBusy: another process is writing ``path``.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: str | None = None) -> None:
        self._destination = _publish.Destination(path, source=source)
        self._prefetch: _datafile.DataFileWriter | None = None
        self._prefetch_dir = ""

    @property
    def path(self) -> str:
        return self._destination.path

    @property
    def data_name(self) -> str:
        """The name the output's data file will have (beside :attr:`path`)."""
        return self._destination.data_name

    def protect(self, paths: list[str]) -> None:
        """Never remove ``paths`` (the data files the input model reads)."""
        self._destination.protect(paths)

    def prefetch(self, proto: onnx.ModelProto, base_dir: str) -> None:
        """Start copying the external data of the input ``proto`` (parsed from a file in
        ``base_dir``) into the output's data file; a model without external initializers
        is left to :meth:`stage`."""
        if self._prefetch is not None:
            raise RuntimeError("prefetch() was already called")
        if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            return
        ranges = external_ranges(proto, base_dir, INLINE_THRESHOLD_BYTES)
        self._prefetch_dir = self._destination.staging_dir()
        data_path = os.path.join(self._prefetch_dir, self.data_name)
        self._prefetch = _datafile.DataFileWriter.start(data_path, list(ranges.values()))

    def stage(self, model: ir.Model, *, external: bool, progress: ProgressCallback | None = None) -> Staged:
        """Write ``model`` into a staging directory beside the destination.

        With ``external`` (implied after :meth:`prefetch` started a copy), tensors above
        :data:`INLINE_THRESHOLD_BYTES` go into one data file named :attr:`data_name`;
        otherwise the model is one file.
        """
        name = self._destination.name
        if self._prefetch is not None:
            writer, directory = self._prefetch, self._prefetch_dir
            self._prefetch = None
            writer.finish(
                model, os.path.join(directory, name), threshold=INLINE_THRESHOLD_BYTES, progress=progress
            )
            return Staged(self._destination, directory, os.path.join(directory, name), writer.data_path)

        def write(directory: str) -> str:
            onnx_path = os.path.join(directory, name)
            save(model, onnx_path, self.data_name if external else None, progress=progress)
            return onnx_path

        return self.stage_with(write)

    def stage_with(self, write: Callable[[str], str]) -> Staged:
        """Stage the files ``write(directory)`` makes in a new staging directory.

        ``write`` returns the path of the ``.onnx`` it wrote there; a data file it refers to
        must be named :attr:`data_name`, in the same directory. Anything else it leaves
        there is removed with the directory.
        """
        directory = self._destination.staging_dir()
        try:
            onnx_path = write(directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        data_path = os.path.join(directory, self.data_name)
        return Staged(
            self._destination, directory, onnx_path, data_path if os.path.exists(data_path) else None
        )

    def stage_made(self, onnx_path: str) -> Staged:
        """Stage a model another run wrote under this output's name (in a scratch directory, see
        :meth:`scratch`): its ``.onnx`` and its data file beside it are moved, not copied."""
        if os.path.basename(onnx_path) != self._destination.name:
            raise ValueError(f"{onnx_path} is not named {self._destination.name}")
        data = os.path.join(os.path.dirname(onnx_path), self.data_name)

        def write(directory: str) -> str:
            target = os.path.join(directory, self._destination.name)
            os.replace(onnx_path, target)
            if os.path.exists(data):
                os.replace(data, os.path.join(directory, self.data_name))
            return target

        return self.stage_with(write)

    @contextlib.contextmanager
    def scratch(self, kind: str) -> Iterator[str]:
        """A hidden directory beside the destination for a step's own files, removed when
        the block ends (``kind``, lowercase letters, is part of its name).

        It is guarded as the staging is (see :meth:`_publish.Destination.scratch_dir`): a
        run killed inside the block leaves it to the next run, which removes it.
        """
        path = self._destination.scratch_dir(kind)
        try:
            yield path
        finally:
            self._destination.remove_scratch(path)

    def close(self) -> None:
        """Stop a copy no stage took over, remove unused staging, release the destination."""
        if self._prefetch is not None:
            self._prefetch.cancel()
            self._prefetch = None
        self._destination.release()

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class Staged:
    """A model written to a staging directory beside its destination."""

    destination: _publish.Destination
    directory: str
    onnx_path: str
    data_path: str | None

    @property
    def size(self) -> int:
        size = os.path.getsize(self.onnx_path)
        if self.data_path is not None:
            size += os.path.getsize(self.data_path)
        return size

    def publish(self, modes: tuple[int, int]) -> None:
        """Put the model in place (see :mod:`onnx_conv2matmul.files.publish`)."""
        self.destination.publish(self.directory, self.onnx_path, self.data_path, modes=modes)
        self.directory = ""

    def keep(self, directory: str, modes: tuple[int, int]) -> str:
        """Move the staged files into ``directory``; return the model path.

        An existing ``directory`` is replaced only when it is a folder this tool kept, unchanged
        (its mark names every entry, see :mod:`onnx_conv2matmul.files.owned`); else refused.
        """
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise InputError(f"cannot keep the failed output: {directory} exists and is not a directory")
        if os.path.isdir(directory):
            odd = None if os.path.islink(directory) else owned.foreign_entries(directory)
            if odd is None or odd:
                why = f"it holds {', '.join(odd[:3])}" if odd else "it is not a folder this tool kept"
                raise InputError(
                    f"cannot keep the failed output in {directory}: {why}; nothing was deleted"
                    " (remove it yourself)",
                    hint=Hint.KEPT_PATH,
                )
            shutil.rmtree(directory)
        os.chmod(self.onnx_path, modes[0])
        if self.data_path is not None:
            os.chmod(self.data_path, modes[1])
        owned.mark(self.directory, files=True)
        usual_mode(self.directory, directory=True)
        os.replace(self.directory, directory)
        self.directory = ""  # the files now belong to the caller
        return os.path.join(directory, os.path.basename(self.onnx_path))

    def discard(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()
