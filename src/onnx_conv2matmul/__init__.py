"""Rewrite pointwise ONNX convolutions into MatMul so weight-only quantizers cover them."""

from onnx_conv2matmul._lazy import import_onnx_ir

import_onnx_ir()  # before any module below imports it

from onnx_conv2matmul._version import __version__  # noqa: E402
from onnx_conv2matmul.api import convert, convert_file  # noqa: E402
from onnx_conv2matmul.errors import CheckerError, Conv2MatMulError, InputError  # noqa: E402
from onnx_conv2matmul.options import ConvertOptions  # noqa: E402
from onnx_conv2matmul.reasons import SkipReason  # noqa: E402
from onnx_conv2matmul.report import ConvEntry, ConvertReport, Status  # noqa: E402

__all__ = [
    "CheckerError",
    "Conv2MatMulError",
    "ConvEntry",
    "ConvertOptions",
    "ConvertReport",
    "InputError",
    "SkipReason",
    "Status",
    "__version__",
    "convert",
    "convert_file",
]
