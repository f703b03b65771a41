"""Signals and interruptions of the command line: handlers, exit codes and the one-line message.

SIGINT, SIGTERM and SIGHUP are handled. This module imports nothing heavy: the entry point
(:mod:`onnx_conv2matmul.cli.entry`) installs the handlers before click, onnx and the rest are
imported. A library import never changes signal handling: only the entry point and
``cli.app.run`` install the handlers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, NoReturn

from onnx_conv2matmul.errors import Interrupted, exit_code_for

JSON_STDOUT_FLAG = "--report-json-stdout"
INSPECT_JSON_FLAG = "--json"
NOTHING_WRITTEN = "nothing was written"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install_signal_handlers() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread.

    Cleanups (staging and scratch directories, copy threads) then run for SIGTERM
    (``timeout``, ``docker stop``) and SIGHUP (a closed terminal or SSH session) exactly as
    for Ctrl-C. A signal the parent process set to be ignored (``nohup``, background jobs)
    stays ignored. Call from the main thread.
    """
    for signum in _SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _raise_interrupted)


def _raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    """Raise :class:`Interrupted`, once: the run now unwinds and exits, so further signals
    (a second Ctrl-C) are ignored, and cannot cut its cleanups short."""
    for other in _SIGNALS:
        if signal.getsignal(other) is _raise_interrupted:
            signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal number: 130 for SIGINT (a plain KeyboardInterrupt), 143 for SIGTERM,
    129 for SIGHUP."""
    return exit_code_for(interrupt)


def interrupted_message(interrupt: KeyboardInterrupt, detail: str) -> str:
    """``interrupted; <detail>``, naming the signal unless it is Ctrl-C."""
    signum = getattr(interrupt, "signum", signal.SIGINT)
    name = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    return f"interrupted{name}; {detail}"


def asks_for_json(argv: Sequence[str]) -> bool:
    """Whether ``--report-json-stdout`` (or ``inspect``'s ``--json``) is among the options
    (before any ``--``)."""
    options = list(argv[: list(argv).index("--")] if "--" in argv else argv)
    return JSON_STDOUT_FLAG in options or (options[:1] == ["inspect"] and INSPECT_JSON_FLAG in options)


def error_json(command: str | None, return_code: int, error: str) -> str:
    """The one JSON object printed on stdout when a command ends without its report."""
    from onnx_conv2matmul.report import ErrorReport

    return json.dumps(ErrorReport(command, return_code, error).to_dict(), indent=2)


def exit_interrupted(
    interrupt: KeyboardInterrupt, detail: str, print_json: Callable[[int, str], None] | None = None
) -> NoReturn:
    """Exit 128 + signal at once, after one line on stderr and ``print_json(code, message)``.

    Further signals are ignored from here on: the exit itself is not interrupted.
    """
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    code = exit_code(interrupt)
    message = interrupted_message(interrupt, detail)
    try:
        if print_json is not None:
            print_json(code, message)
        sys.stdout.flush()
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    except OSError:  # a closed pipe: nothing more to say
        pass
    os._exit(code)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold back SIGINT, SIGTERM and SIGHUP until the block ends, then deliver them (the command
    line passes this to :func:`onnx_conv2matmul.files.publish.interruptions_deferred_by`, so that
    an interruption never falls between the renames that publish an output).

    The handlers are swapped for ones that only take note, and restored at the end;
    masking the signals would not do, since any thread may receive them. Signal
    handlers belong to the main thread: elsewhere nothing is held back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous: dict[int, Any] = {}
    for signum in _SIGNALS:
        if signal.getsignal(signum) is not None:  # None: installed outside Python, left alone
            previous[signum] = signal.signal(signum, lambda number, _frame: pending.append(number))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in pending:
            signal.raise_signal(number)
