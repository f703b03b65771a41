"""Standard streams that cannot change a run: closed at start, or a pipe that goes away.

What happens to stdout and stderr never changes the result or the exit code of a run:

* a standard descriptor (0, 1, 2) closed when the process starts is opened on the null
  device first, so no file the tool opens takes its number (a model written through fd 1
  would receive the tables), and Python's ``sys.stdout``/``sys.stderr`` exist;
* writes to stdout and stderr go through :class:`Tolerant`, which drops what a stream that
  went away or is full (a broken pipe, a closed descriptor, a full disk) cannot take, and
  every later write to it:
  the run goes on, and ends with the exit code its work earned.

Only the console entry point installs this (:func:`guard`): it owns its process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

_GONE = (errno.EPIPE, errno.EBADF, errno.ECONNRESET, errno.EINVAL, errno.ENOSPC, errno.EIO)


class Tolerant:
    """A text stream that stops writing, silently, once the stream behind it went away."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return int(self._stream.write(text))
            except (OSError, ValueError) as err:  # ValueError: the file object was closed
                if isinstance(err, OSError) and err.errno not in _GONE:
                    raise
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError) as err:
                if isinstance(err, OSError) and err.errno not in _GONE:
                    raise
                self.broken = True

    def isatty(self) -> bool:
        if self.broken:
            return False
        try:
            return bool(self._stream.isatty())
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _open_closed_descriptors() -> None:
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def guard() -> None:
    """Make the process's standard streams unable to change the run (see the module docstring)."""
    _open_closed_descriptors()
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:  # the descriptor was closed when Python started
            with contextlib.suppress(OSError):
                setattr(sys, name, os.fdopen(os.dup(fd), mode, encoding="utf-8", errors="replace"))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Tolerant):
            setattr(sys, name, Tolerant(stream))


class Diversion:
    """Stdout made the tool's alone while a command works: what anything else writes there goes to
    stderr, or nowhere with ``-q`` (a dependency's progress bars, onnxruntime's k_quant prints
    some; a ``--validate`` function's prints; and, where stdout is the process's descriptor 1,
    what a process it starts writes there). The tool's own output goes to the real stdout,
    through a descriptor of its own. Installed by the command line only, which owns its process."""

    def __init__(self) -> None:
        self._state: tuple[Any, _Elsewhere, int | None, Any] | None = None

    def divert(self, stdout: Any, quiet: Callable[[], bool]) -> Any:
        """Divert; the stream the tool writes its own output to from now on."""
        if self._state is not None:
            return stdout
        real: int | None = None
        own = stdout
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stdout.fileno() == 1:
                stdout.flush()
                encoding = getattr(stdout, "encoding", None) or "utf-8"
                own = Tolerant(os.fdopen(os.dup(1), "w", encoding=encoding))
                real = os.dup(1)
                os.dup2(2, 1)
        elsewhere = _Elsewhere(quiet)
        self._state = (sys.stdout, elsewhere, real, stdout)
        sys.stdout = elsewhere  # type: ignore[assignment]
        return own

    @contextlib.contextmanager
    def undiverted(self, own: Any) -> Iterator[None]:
        """Descriptor 1 as it was, while a path the user named is written (``/dev/stdout``)."""
        real = self._state[2] if self._state is not None else None
        if real is None:
            yield
            return
        with contextlib.suppress(OSError, ValueError):
            own.flush()
        os.dup2(real, 1)
        try:
            yield
        finally:
            os.dup2(2, 1)

    def restore(self, own: Any) -> Any:
        """Undo :meth:`divert`; the stream the tool writes to from now on (the one it had)."""
        if self._state is None:
            return own
        previous, elsewhere, real, before = self._state
        self._state = None
        with contextlib.suppress(OSError, ValueError):
            own.flush()
        if sys.stdout is elsewhere:
            sys.stdout = previous
        if real is not None:
            with contextlib.suppress(OSError):
                os.dup2(real, 1)
            os.close(real)
            with contextlib.suppress(OSError, ValueError):
                own.close()  # the tool's own descriptor: descriptor 1 is stdout again
        return before


class _Elsewhere:
    """``sys.stdout`` while diverted: stderr, or nothing when ``quiet()``."""

    def __init__(self, quiet: Callable[[], bool]) -> None:
        self._quiet = quiet

    def write(self, text: str) -> int:
        if not self._quiet():
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 2
