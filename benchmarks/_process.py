"""One command in a process of its own, with its wall time, CPU time and peak RSS.

Linux starts a process's ``ru_maxrss`` at the peak RSS of the image that exec replaced, so a
command forked straight from a benchmark that holds onnxruntime sessions, numpy arrays or a
memory-mapped file reports at least the benchmark's own peak (a Python parent that once held
500 MiB makes ``/bin/true`` report 527 MiB). :func:`run_measured` forks the command from a small
interpreter started for it instead (``python -I -S``, about 10 MB), which reports the command's
usage back on a pipe: a peak RSS exact above that size.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

LAUNCHER = """
import os, sys, time
fd, argv = int(sys.argv[1]), sys.argv[2:]
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.close(fd)
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - start
code = os.waitstatus_to_exitcode(status)
os.write(fd, f"{seconds} {usage.ru_maxrss} {usage.ru_utime} {usage.ru_stime} {code}".encode())
"""


@dataclasses.dataclass(frozen=True)
class Measured:
    """A finished command: exit code (negative: killed by that signal), wall seconds, peak RSS in
    KiB (as ``ru_maxrss``), user and system CPU seconds, and its output where it was piped."""

    returncode: int
    seconds: float
    ru_maxrss: int
    ru_utime: float
    ru_stime: float
    stdout: Any = None
    stderr: Any = None

    @property
    def peak_bytes(self) -> int:
        return self.ru_maxrss * 1024


def run_measured(argv: Sequence[str], **popen: Any) -> Measured:
    """Run ``argv`` to completion, forked from a small launcher, and measure it.

    ``popen`` goes to ``subprocess.Popen`` of the launcher, whose streams, environment,
    working directory and niceness the command inherits (``stdout``, ``stderr``, ``env``,
    ``cwd``, ``preexec_fn``, ``text``); piped output comes back in the result.
    """
    read, write = os.pipe()
    try:
        start = time.perf_counter()
        launcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", LAUNCHER, str(write), *argv], pass_fds=(write,), **popen
        )
        os.close(write)
        write = -1
        stdout, stderr = launcher.communicate()
        with os.fdopen(read, "rb") as pipe:
            read = -1
            fields = pipe.read().decode().split()
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
    if len(fields) != 5:  # the launcher itself failed
        return Measured(launcher.returncode or 1, time.perf_counter() - start, 0, 0.0, 0.0, stdout, stderr)
    seconds, peak, user, system, code = fields
    return Measured(int(code), float(seconds), int(peak), float(user), float(system), stdout, stderr)


def run_quiet(argv: Sequence[str], env: dict[str, str] | None = None) -> tuple[int, float, int, str]:
    """:func:`run_measured` with stdout discarded: exit code, wall seconds, peak RSS bytes and
    stderr."""
    usage = run_measured(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return usage.returncode, usage.seconds, usage.peak_bytes, usage.stderr or ""
