"""The console entry point: signal handling first, then the command line.

This module imports nothing heavy, so SIGINT, SIGTERM and SIGHUP are handled before click, onnx
and the rest are imported: a Ctrl-C at start-up is one line and exit 130, never a traceback.

:func:`run` owns its process, so it alone may change the interpreter for speed (see its
docstring); importing the package, or calling ``cli.app.main`` or ``cli.app.run`` from a host
program, changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

from onnx_conv2matmul.cli.signals import (
    NOTHING_WRITTEN,
    asks_for_json,
    error_json,
    exit_interrupted,
    install_signal_handlers,
)

MMAP_THRESHOLD = 4 * 2**20
"""Allocations of at least this many bytes get pages of their own from the system (see
:func:`_return_large_blocks`)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_large_blocks() -> None:
    """Have the C allocator give large blocks back to the system as soon as they are freed.

    glibc serves a block above its mmap threshold with pages of its own, returned on free, but
    raises that threshold to the size of each such block freed (up to 32 MiB): after the first
    chunks of an ``--inputs`` file, a chunk's outputs come from the heap, whose freed space the
    process keeps. Feeding 2,000 samples in chunks then held about twice the memory budget above
    what the chunks need (a 64 MiB budget: 148 MiB; with the threshold fixed at
    :data:`MMAP_THRESHOLD`, about 35 MiB, at the same speed). A process-wide setting, so only
    the console script, which is the whole process, makes it; elsewhere (no glibc): nothing.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def run() -> None:
    """The console script: signal handlers, then the command line (``cli.run``).

    Being the whole process, it also fixes the C allocator's mmap threshold
    (:func:`_return_large_blocks`), defers sympy (see :mod:`onnx_conv2matmul.cli.lazy_import`),
    and ends the process with ``os._exit`` once the command has finished (every file
    written and closed, every thread joined), skipping the teardown that frees a large
    graph object by object. Each was kept because it measurably shortens a conversion;
    the interpreter's switch interval is left alone (a shorter one, for the thread that
    copies data files, made no measurable difference).
    """
    from onnx_conv2matmul.cli import streams

    streams.guard()  # closed or vanishing stdout/stderr cannot change the run
    install_signal_handlers()
    _return_large_blocks()
    from onnx_conv2matmul.cli import lazy_import as _lazy

    _lazy.install()
    started = False
    try:
        from onnx_conv2matmul.cli import app as cli

        started = True
        cli.run()
    except KeyboardInterrupt as interrupt:
        if not started:  # while importing: nothing was written
            exit_interrupted(interrupt, NOTHING_WRITTEN, _print_json_if_asked)
        # A second signal while cli.run reported the first one: that report says the rest.
        exit_interrupted(interrupt, "exiting")
    except SystemExit as exit_:
        if exit_.code is not None and not isinstance(exit_.code, int):
            raise  # a message for the interpreter to print
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(
                OSError, ValueError, AttributeError
            ):  # a closed pipe: nothing more to say
                stream.flush()
        os._exit(exit_.code or 0)


def _print_json_if_asked(code: int, message: str) -> None:
    if asks_for_json(sys.argv[1:]):
        sys.stdout.write(error_json(None, code, message) + "\n")
