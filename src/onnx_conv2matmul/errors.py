"""The few exceptions the package raises on purpose."""

from __future__ import annotations


class Conv2MatMulError(Exception):
    """Base class of this package's errors."""


class InputError(Conv2MatMulError):
    """Bad input, output path or option: the user can fix it (CLI exit code 2)."""


class CheckerError(Conv2MatMulError):
    """The ONNX checker rejected the rewritten model."""
