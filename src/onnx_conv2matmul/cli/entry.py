"""The console entry point: signal handling first, then the command line.

This module imports nothing heavy, so SIGINT, SIGTERM and SIGHUP are handled before click, onnx
and the rest are imported: a Ctrl-C at start-up is one line and exit 130, never a traceback.

:func:`run` owns its process, so it alone may change the interpreter for speed (see its
docstring); importing the package, or calling ``cli.app.main`` or ``cli.app.run`` from a host
program, changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys

from onnx_conv2matmul.cli.signals import (
    NOTHING_WRITTEN,
    asks_for_json,
    error_json,
    exit_interrupted,
    install_signal_handlers,
)


def run() -> None:
    """The console script: signal handlers, then the command line (``cli.run``).

    Being the whole process, it also defers sympy (see :mod:`onnx_conv2matmul.cli.lazy_import`),
    and ends the process with ``os._exit`` once the command has finished (every file
    written and closed, every thread joined), skipping the teardown that frees a large
    graph object by object. Each was kept because it measurably shortens a conversion;
    the interpreter's switch interval is left alone (a shorter one, for the thread that
    copies data files, made no measurable difference).
    """
    from onnx_conv2matmul.cli import streams

    streams.guard()  # closed or vanishing stdout/stderr cannot change the run
    install_signal_handlers()
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
