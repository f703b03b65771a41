"""File modes: what a plain ``open`` or ``mkdir`` would give, for files and directories staged
privately (temporary names are created 0600/0700) before they are published."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

PERMISSION_BITS = 0o777
"""The bits an output takes from its input: read, write and execute, never setuid, setgid or sticky."""


def _umask() -> int:
    """The process's umask, read without setting it (setting it, even back, races with other
    threads creating files): from ``/proc/self/status`` where the kernel shows it, else from the
    mode a new directory gets."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    probe = tempfile.mkdtemp()  # private (0700): the probe inside it takes the umask as is
    try:
        inner = os.path.join(probe, "d")
        os.mkdir(inner, 0o777)
        return 0o777 & ~stat.S_IMODE(os.stat(inner).st_mode)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def usual_mode(path: str, *, directory: bool = False) -> None:
    """Give a staged file the mode a plain ``open`` would (temp files are private)."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())
