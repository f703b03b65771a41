"""Rewrite pointwise ONNX convolutions into MatMul so weight-only quantizers cover them.

onnx-ir and the rewrite are imported on first use (``convert``, ``convert_file``):
a command can parse its input and start copying its data file first.

Importing this package (or any of its public modules) changes nothing in the
interpreter: no import hooks, no stand-in modules, no signal handlers, no switch
interval. onnx-ir, once imported, is the module a plain ``import onnx_ir`` gives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.errors import CheckerError, Conv2MatMulError, InputError
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvEntry, ConvertReport, Status

if TYPE_CHECKING:
    from onnx_conv2matmul.api import convert, convert_file
    from onnx_conv2matmul.rewrite.passes import ConvToMatMulPass

__all__ = [
    "CheckerError",
    "Conv2MatMulError",
    "ConvEntry",
    "ConvToMatMulPass",
    "ConvertOptions",
    "ConvertReport",
    "InputError",
    "SkipReason",
    "Status",
    "__version__",
    "convert",
    "convert_file",
]


# Imported on first use: they import onnx-ir.
_LAZY = {"convert": "api", "convert_file": "api", "ConvToMatMulPass": "rewrite.passes"}
_SUBMODULES = ("api", "cli", "files", "quantize", "report", "rewrite", "verify")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
