"""Putting a staged model in place, so that no interruption can leave a mismatched model.

The invariant: at every instant, every ``.onnx`` this tool writes or replaces refers to a
complete data file that was written for it. Killing the process at any point leaves
either the old model or the new one at the destination, and nothing but hidden
staging directories beside it, which the next run for that destination removes.

How :class:`Destination` keeps it:

1. A lock on the destination (a hidden ``.<name>.lock`` beside it, held with ``flock``
   for the whole run and removed at its end): a second writer to the same destination
   is refused.
2. The new data file never takes a name that exists: ``<name>.data`` when it is free,
   else ``<name>.1.data``, ``<name>.2.data``, ... So the data file that the old
   ``.onnx`` (or any other model) reads is never overwritten.
3. Publishing: fsync the staged files; rename the data file into place, fsync the
   directory; rename the ``.onnx`` into place (the switch), fsync the directory; only
   then remove the data files that the replaced ``.onnx`` read and that were named
   after it (``<name>.data``, ``<name>.N.data``). SIGINT, SIGTERM and SIGHUP are held back
   during these steps and delivered after them, so a run has published or not.
4. Before step 3 the names of those files, and the new data file's, are written to a
   journal in the staging directory. A run killed between the renames leaves that
   directory; the next run deletes the journal's files that its destination does not
   read, then the directory.
5. Scratch directories (a copy of the model that a step of the run writes for itself, such
   as the quantize search's) are staging directories too, named after the step
   (``.<name>.auto-XXXXXXXX.tmp``): removed at the end of the run, and left by a killed run
   only until the next run for that destination. Any run that writes into the same
   directory also removes the staging and scratch directories of other destinations
   whose lock is free, as long as they hold no journal (nothing was published from them).
6. A directory is taken for a staging or scratch directory by proof, not by its name: each
   holds this tool's mark (:mod:`onnx_conv2matmul.files.owned`), written right after it was
   made, and removed last when the directory is removed. Recovery and the sweep leave alone
   a directory named like one that holds something but not the mark (a run killed before
   writing the mark, or after removing it, leaves an empty directory, which they remove).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from onnx_conv2matmul.errors import DestinationBusy, InputError
from onnx_conv2matmul.files import owned
from onnx_conv2matmul.files.modes import PERMISSION_BITS, usual_mode
from onnx_conv2matmul.files.paths import data_files

if TYPE_CHECKING:  # imported where used: the console script's start stays light
    pass

_JOURNAL = "obsolete.json"
# The replaced .onnx is parsed to find the data files it reads only up to this size; a
# larger one (a single-file model) keeps every data file named after it.
_PARSE_LIMIT_BYTES = 256 * 2**20
# A staging directory, as tempfile.mkdtemp(prefix=".<name>.[<kind>-]", suffix=".tmp") makes it:
# 8 random characters, after the kind of scratch directory for those that are one.
_STAGING_TAIL = r"\.(?:[a-z]+-)?[a-z0-9_]{8}\.tmp"
_ANY_STAGING = re.compile(rf"\.(.+){_STAGING_TAIL}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def referenced_files(path: str) -> set[str] | None:
    """Normalized paths of the external data files the model at ``path`` reads.

    ``None`` when the file is too large to parse cheaply or cannot be parsed.
    """
    import onnx

    try:
        if os.path.getsize(path) > _PARSE_LIMIT_BYTES:
            return None
        proto = onnx.load(path, load_external_data=False)
    except Exception:
        return None
    return data_files(proto, os.path.dirname(os.path.abspath(path)))


class Destination:
    """The place a model is written to, held for one run (a context manager).

    Args:
        path: The ``.onnx`` to write or replace.
        source: The input model when it is not the destination: its files are never
            removed, whatever their names (see also :meth:`protect`).

    Raises:
        DestinationBusy: another process holds the destination.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: str | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.directory, self.name = os.path.split(self.path)
        self._source = source
        self._keep = {os.path.realpath(source)} if source is not None else set()
        self._lock_path = os.path.join(self.directory, f".{self.name}.lock")
        self._lock_fd = _lock(self._lock_path, self.path)
        self._staging: list[str] = []
        try:
            self._recover()
            self.data_name = self._free_data_name()
        except BaseException:
            self.release()
            raise

    # -- names -----------------------------------------------------------------------

    def _staging_pattern(self) -> re.Pattern[str]:
        return re.compile(rf"\.{re.escape(self.name)}{_STAGING_TAIL}")

    def _is_own_data(self, path: str) -> bool:
        """Whether ``path`` is a data file named after this destination."""
        directory, name = os.path.split(path)
        own = re.fullmatch(rf"{re.escape(self.name)}(\.\d+)?\.data", name)
        return own is not None and os.path.realpath(directory) == os.path.realpath(self.directory)

    def _free_data_name(self) -> str:
        for index in range(1000):
            name = f"{self.name}.data" if index == 0 else f"{self.name}.{index}.data"
            if not os.path.lexists(os.path.join(self.directory, name)):
                return name
        raise InputError(
            f"no free name for the data file of {self.path}: remove old {self.name}.N.data files"
        )

    def staging_dir(self) -> str:
        """A new hidden directory beside the destination, on the same filesystem.

        It is removed when the destination is released, unless it was published or moved.
        """
        path = tempfile.mkdtemp(prefix=f".{self.name}.", suffix=".tmp", dir=self.directory)
        self._staging.append(path)
        owned.mark(path)
        return path

    def scratch_dir(self, kind: str) -> str:
        """A new hidden directory beside the destination for a step's own files (``kind``:
        lowercase letters, such as ``auto``), under the same guard as a staging directory:
        removed by :meth:`remove_scratch` or when the destination is released, and by the
        next run when this one is killed."""
        if not re.fullmatch("[a-z]+", kind):
            raise ValueError(f"a scratch directory's kind is lowercase letters, not {kind!r}")
        path = tempfile.mkdtemp(prefix=f".{self.name}.{kind}-", suffix=".tmp", dir=self.directory)
        self._staging.append(path)
        owned.mark(path)
        return path

    def remove_scratch(self, path: str) -> None:
        """Remove a directory :meth:`scratch_dir` made, now rather than at the end of the run."""
        _remove_dir(path)
        if path in self._staging:
            self._staging.remove(path)

    # -- recovery ----------------------------------------------------------------------

    def _recover(self) -> None:
        """Remove what killed runs for this destination left (we hold the lock), then the
        abandoned staging of other destinations in the directory (see :meth:`_sweep`)."""
        entries = os.listdir(self.directory)
        pattern = self._staging_pattern()
        stale = [e for e in entries if pattern.fullmatch(e) and _ours(os.path.join(self.directory, e))]
        self._sweep(entries)
        if not stale:
            return
        in_use = referenced_files(self.path) if os.path.exists(self.path) else set()
        if self._source is not None:
            source_files = referenced_files(self._source)
            if source_files is None:
                in_use = None  # cannot tell what the input reads: remove nothing
            else:
                self.protect(source_files)
        for entry in stale:
            directory = os.path.join(self.directory, entry)
            for path in _read_journal(directory):
                if in_use is not None and path not in in_use and self._removable(path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            _remove_dir(directory)

    def _sweep(self, entries: list[str]) -> None:
        """Remove the staging and scratch directories of other destinations in the directory
        that no run holds (their lock is free) and that hold no journal.

        A directory without a journal was never published from: removing it touches nothing
        outside it. One with a journal is left to its own destination's next run, which knows
        what that destination reads. Each abandoned directory is moved into one of this run's
        own while the other lock is held (a rename: the lock is held for moments), then
        removed with it.
        """
        abandoned: dict[str, list[str]] = {}
        for entry in entries:
            match = _ANY_STAGING.fullmatch(entry)
            path = os.path.join(self.directory, entry)
            if match is None or match.group(1) == self.name or not os.path.isdir(path):
                continue
            if not os.path.islink(path) and not os.path.lexists(os.path.join(path, _JOURNAL)) and _ours(path):
                abandoned.setdefault(match.group(1), []).append(entry)
        if not abandoned:
            return
        trash = self.staging_dir()
        for name, found in abandoned.items():
            try:
                fd = _lock(os.path.join(self.directory, f".{name}.lock"), name)
            except DestinationBusy:
                continue  # a run is writing that destination: its directories are in use
            except OSError:
                continue  # cannot tell: leave them
            try:
                for entry in found:
                    with contextlib.suppress(OSError):
                        os.rename(os.path.join(self.directory, entry), os.path.join(trash, entry))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, f".{name}.lock"))
                os.close(fd)
        _remove_dir(trash)
        self._staging.remove(trash)

    def protect(self, paths: Iterable[str]) -> None:
        """Never remove ``paths`` (the data files the input model reads)."""
        self._keep.update(os.path.realpath(p) for p in paths)

    def _removable(self, path: str) -> bool:
        return self._is_own_data(path) and os.path.realpath(path) not in self._keep

    # -- publishing --------------------------------------------------------------------

    def publish(self, staging: str, onnx_path: str, data_path: str | None, *, modes: tuple[int, int]) -> None:
        """Move the staged model into place (see the module docstring); remove ``staging``.

        ``data_path`` must be named :attr:`data_name` (the ``.onnx`` refers to it by name).
        ``modes`` are the permission bits of the ``.onnx`` and of the data file.
        """
        if data_path is not None and os.path.basename(data_path) != self.data_name:
            raise ValueError(f"staged data file {data_path!r} is not named {self.data_name!r}")
        new_data = os.path.join(self.directory, self.data_name) if data_path is not None else None
        old = referenced_files(self.path) if os.path.exists(self.path) else set()
        obsolete = sorted(p for p in (old or ()) if p != new_data and self._removable(p))
        journal = obsolete + ([new_data] if new_data is not None else [])
        with open(os.path.join(staging, _JOURNAL), "w", encoding="utf-8") as handle:
            json.dump(journal, handle)
        os.chmod(onnx_path, modes[0])
        if data_path is not None:
            os.chmod(data_path, modes[1])
            _fsync(data_path)
        _fsync(onnx_path)
        with _DEFERRAL.get()():
            if data_path is not None and new_data is not None:
                os.rename(data_path, new_data)
                _fsync(self.directory)
            os.rename(onnx_path, self.path)
            _fsync(self.directory)
            for path in obsolete:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            _remove_dir(staging)

    # -- the lock ----------------------------------------------------------------------

    def release(self) -> None:
        """Remove what is left of the staging directories, then the lock file, then release
        the lock (in that order, see :func:`_lock`)."""
        for path in self._staging:
            _remove_dir(path)
        self._staging.clear()
        if self._lock_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock_path)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _ours(path: str) -> bool:
    """Whether a directory named like a staging directory is one: it holds this tool's mark,
    or nothing at all (what a run killed around writing or removing the mark leaves)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    if owned.is_marked(path):
        return True
    try:
        return not os.listdir(path)
    except OSError:
        return False


def _remove_dir(path: str) -> None:
    """Remove a directory the tool made, its mark last: a removal cut short leaves a directory
    that still proves itself the tool's (or an empty one)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if name == owned.MARK:
            continue
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(path, owned.MARK))
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _read_journal(directory: str) -> list[str]:
    try:
        with open(os.path.join(directory, _JOURNAL), encoding="utf-8") as handle:
            names = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _lock(lock_path: str, destination: str) -> int:
    """Hold ``lock_path`` with ``flock``; refuse at once when another process holds it.

    The holder removes the file before releasing it, so a process that locked a file
    which is no longer at ``lock_path`` (it opened it just before the removal) tries
    again with a new one.
    """
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DestinationBusy(
                    f"another run is writing {destination}; try again when it has finished"
                ) from None
            raise
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and current.st_ino == os.fstat(fd).st_ino:
            return fd
        os.close(fd)


_DEFERRAL: contextvars.ContextVar[Callable[[], AbstractContextManager[object]]] = contextvars.ContextVar(
    "onnx_conv2matmul_publish_deferral", default=contextlib.nullcontext
)


@contextlib.contextmanager
def interruptions_deferred_by(hold: Callable[[], AbstractContextManager[object]]) -> Iterator[None]:
    """Within the block, the renames that put an output in place run inside ``hold()``.

    The caller's way to keep an interruption from falling between them: the command line passes
    a context that holds its signals back until the block ends. The library never touches signal
    handlers itself; without this, a run interrupted there is recovered by the next run onto the
    same output (its journal says what was published).
    """
    token = _DEFERRAL.set(hold)
    try:
        yield
    finally:
        _DEFERRAL.reset(token)


def publish_directory(staging: str, destination: str) -> None:
    """Put a staged folder in place of ``destination`` (a folder, or nothing yet).

    Hidden entries left in ``staging`` (locks, scratch) are removed first. Where the system
    can swap two paths atomically (Linux ``renameat2``), ``destination`` is the old folder or
    the new one at every instant; elsewhere there is a moment without it. The old folder is
    removed after the switch. The renames run inside the caller's deferral, as a model's do
    (:func:`interruptions_deferred_by`).
    """
    for name in os.listdir(staging):
        if name.startswith("."):
            path = os.path.join(staging, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    usual_mode(staging, directory=True)
    for name in os.listdir(staging):
        _fsync(os.path.join(staging, name))
    parent = os.path.dirname(os.path.abspath(destination))
    old = None
    with _DEFERRAL.get()():
        if os.path.isdir(destination) and _exchange(staging, destination):
            _fsync(parent)
            old = staging  # the old folder now lies at the staging path
        else:
            if os.path.isdir(destination):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(destination)}.old-", dir=parent)
                os.rename(destination, os.path.join(old, "folder"))
            os.rename(staging, destination)
            _fsync(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (``renameat2`` with ``RENAME_EXCHANGE``); False where the
    system cannot."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        renameat2 = ctypes.CDLL(name, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return bool(renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0)


def set_metadata(path: str, entries: dict[str, str]) -> None:
    """Add ``entries`` to the ``metadata_props`` of the model at ``path`` (same keys replaced).

    Only the ``.onnx`` file is rewritten (through a temporary file renamed into place); its
    external data stays where it is.
    """
    import onnx

    proto = onnx.load(path, load_external_data=False)
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key not in entries]
    del proto.metadata_props[:]
    for key, value in [*kept, *entries.items()]:
        proto.metadata_props.add(key=key, value=value)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        onnx.save_model(proto, tmp)
        os.chmod(tmp, os.stat(path).st_mode & PERMISSION_BITS)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
