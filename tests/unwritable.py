"""Directories this process cannot create files in, for the "not writable" errors.

Permission bits alone do not do it for root (how CI runs: root bypasses them), so there are
three ways, each skipped where it is not available:

- ``mode-0500``: a directory without write permission (any user but root);
- ``immutable``: a directory with the immutable attribute (``chattr +i``; needs root or
  CAP_LINUX_IMMUTABLE and a filesystem that supports it), which root cannot write in either;
- ``procfs``: ``/proc/sys``, where the kernel refuses new files to every user, root included
  (Linux; read-only in most containers besides).

Each way is checked for real: creating a file in the directory must fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import TIMEOUT

KINDS = ["mode-0500", "immutable", "procfs"]


def _chattr(flag: str, path: Path) -> subprocess.CompletedProcess[str] | None:
    chattr = shutil.which("chattr")
    if chattr is None:
        return None
    return subprocess.run(
        [chattr, flag, str(path)], capture_output=True, text=True, check=False, timeout=TIMEOUT
    )


def _check_really_unwritable(directory: Path, kind: str) -> None:
    if os.access(directory, os.W_OK | os.X_OK):
        pytest.skip(f"{kind}: {directory} is writable for this process (uid {os.geteuid()})")
    probe = directory / ".unwritable-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    os.close(fd)
    probe.unlink()
    pytest.skip(f"{kind}: access() says {directory} is not writable, yet a file could be created in it")


@contextlib.contextmanager
def unwritable_directory(kind: str, parent: Path) -> Iterator[Path]:
    """A directory that nothing can be created in (made under ``parent`` when it is new)."""
    if kind == "mode-0500":
        directory = parent / "read-only"
        directory.mkdir()
        directory.chmod(0o500)
        try:
            _check_really_unwritable(directory, kind)
            yield directory
        finally:
            directory.chmod(0o700)
    elif kind == "immutable":
        directory = parent / "immutable"
        directory.mkdir()
        done = _chattr("+i", directory)
        if done is None or done.returncode != 0:
            why = "no chattr" if done is None else done.stderr.strip()
            pytest.skip(f"immutable: cannot set the attribute here ({why})")
        try:
            _check_really_unwritable(directory, kind)
            yield directory
        finally:
            _chattr("-i", directory)
    elif kind == "procfs":
        directory = Path("/proc/sys")
        if not directory.is_dir():
            pytest.skip("procfs: no /proc/sys here")
        _check_really_unwritable(directory, kind)
        yield directory
    else:
        raise ValueError(kind)
