"""The few exceptions the package raises on purpose."""

from __future__ import annotations


class Conv2MatMulError(Exception):
    """Base class of this package's errors."""


class InputError(Conv2MatMulError):
    """Bad input, output path or option: the user can fix it (CLI exit code 2)."""


class CheckerError(Conv2MatMulError):
    """The ONNX checker rejected the rewritten model."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while the console entry point ran.

    Raised by the handler :func:`onnx_conv2matmul._entry.install_signal_handlers` installs,
    so a SIGTERM unwinds like Ctrl-C and every cleanup runs; the exit code is 128 + ``signum``.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
