"""Child processes for tests, started the same way however the test run itself was started.

A test run started in the background (``pytest ... &`` in a script, ``nohup``, some CI
runners) passes SIGINT (and with ``nohup`` SIGHUP) to its children as ignored, and Python
then installs no handler for it: a child could not be interrupted the way a user
interrupts the tool from a terminal. So :func:`python_code` starts every child's code with
the dispositions a terminal gives (SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP end the
process), and :func:`finish` and :class:`LineReader` wait with a time limit: a child that
hangs fails its test instead of blocking the run.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import TextIO

import pytest

ROOT = Path(__file__).resolve().parents[1]

TIMEOUT = 120.0
"""Seconds a child may take: a guard against a hang only, far above any normal run."""

FOREGROUND_SIGNALS = """\
import signal as _signal
_signal.signal(_signal.SIGINT, _signal.default_int_handler)
_signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
_signal.signal(_signal.SIGHUP, _signal.SIG_DFL)
del _signal
"""
"""The signal dispositions of a Python process started from a terminal."""


def python_code(code: str) -> str:
    """``code`` (dedented), run with the signal dispositions of a terminal's process."""
    return FOREGROUND_SIGNALS + textwrap.dedent(code)


def entry_point() -> tuple[str, str]:
    """The console script's ``module:function`` from pyproject.toml."""
    import tomllib  # Python 3.11 and later

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["onnx-conv2matmul"].partition(":")
    return module, function


def console_code(prelude: str) -> str:
    """Python code that runs ``prelude``, then the console entry point on ``sys.argv[1:]``."""
    module, function = entry_point()
    start = f"""
        import sys
        sys.argv[0] = "onnx-conv2matmul"
        from {module} import {function}
        sys.exit({function}())
        """
    return python_code(textwrap.dedent(prelude) + textwrap.dedent(start))


def run_python(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (see :func:`python_code`) in a new interpreter; fail the test on a hang."""
    try:
        return subprocess.run(
            [sys.executable, "-c", python_code(code), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the child process did not finish within {timeout:g} s: {err.stderr!r}")


def spawn_console(
    prelude: str, *args: str, env: dict[str, str] | None = None, stdin: int = subprocess.DEVNULL
) -> subprocess.Popen[str]:
    """Start the console entry point after ``prelude`` (see :func:`console_code`); its stdout
    and stderr are pipes, its stdin ``stdin``."""
    if env is None:
        env = dict(os.environ)
        env.pop("ONNX_CONV2MATMUL_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-c", console_code(prelude), *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


class LineReader:
    """The lines of a child's stderr, read by a thread, so that waiting for one can time out.

    It takes the stream over from ``proc``: end the child with :meth:`finish`.
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        stream, proc.stderr = proc.stderr, None
        self._proc = proc
        self._lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: TextIO) -> None:
        with stream:
            for line in stream:
                self._lines.put(line)
        self._lines.put("")  # the end of the stream

    def wait_for(self, wanted: str, timeout: float = TIMEOUT) -> str:
        """Read up to the line ``wanted`` (without its newline); return what came before it.

        Fails the test (after killing the child) when the stream ends or the time runs out first.
        """
        before: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                self._proc.kill()
                pytest.fail(f"no {wanted!r} line within {timeout:g} s: {''.join(before)}")
            if not line:
                out, err = self.finish()
                pytest.fail(f"the process ended early ({self._proc.returncode}): {''.join(before)}{err}{out}")
            if line == wanted + "\n":
                return "".join(before)
            before.append(line)

    def finish(self, timeout: float = TIMEOUT) -> tuple[str, str]:
        """Wait for the child (see :func:`finish`): its stdout and the rest of its stderr."""
        out, _ = finish(self._proc, timeout)
        self._thread.join(timeout)
        lines = []
        while not self._lines.empty():
            lines.append(self._lines.get_nowait())
        return out, "".join(lines)


def finish(proc: subprocess.Popen[str], timeout: float = TIMEOUT) -> tuple[str, str]:
    """Wait for ``proc`` and return its stdout and stderr; on a hang, kill it and fail the test."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not end within {timeout:g} s: {err}{out}")
    return out or "", err or ""
