"""Rewrite pointwise ONNX convolutions into MatMul so weight-only quantizers cover them."""

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.api import convert, convert_file
from onnx_conv2matmul.errors import CheckerError, Conv2MatMulError, InputError
from onnx_conv2matmul.options import ConvertOptions
from onnx_conv2matmul.reasons import SkipReason
from onnx_conv2matmul.report import ConvEntry, ConvertReport, Status

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
