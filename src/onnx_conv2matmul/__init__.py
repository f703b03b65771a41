"""Rewrite pointwise ONNX convolutions into MatMul so weight-only quantizers cover them.

One function per command (``convert``/``convert_file``, ``verify_files``, ``quantize_file``,
``inspect_file``, ``check_bundle``, ``build_bundle``, ``bench_models``), each returning its typed
report; the options and report types beside them. onnx-ir and onnxruntime are imported on first
use: a command can parse its input and start copying its data file first.

Importing this package (or any of its public modules) changes nothing in the
interpreter: no import hooks, no stand-in modules, no signal handlers, no switch
interval. onnx-ir, once imported, is the module a plain ``import onnx_ir`` gives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.errors import (
    CheckerError,
    Conv2MatMulError,
    DestinationBusy,
    InputError,
    ModelLoadError,
    ModelRunError,
    OptionConflict,
    TargetUnreachable,
    ValidationError,
)
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvEntry, ConvertReport, Status

if TYPE_CHECKING:
    from onnx_conv2matmul.api import (
        bench_models,
        build_bundle,
        check_bundle,
        convert,
        convert_file,
        inspect_file,
        quantize_file,
        verify_files,
    )
    from onnx_conv2matmul.bundle.build import BundleOptions
    from onnx_conv2matmul.bundle.report import BundleBuildReport
    from onnx_conv2matmul.files.progress import Progress
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.quantize.report import BundleReport, InspectReport, QuantizeReport
    from onnx_conv2matmul.quantize.search_options import AutoOptions
    from onnx_conv2matmul.quantize.settings import NodeSetting, QuantizeOptions
    from onnx_conv2matmul.rewrite.passes import ConvToMatMulPass
    from onnx_conv2matmul.speed.bench import BenchReport
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.speed.timing import TimingOptions
    from onnx_conv2matmul.verify.check import VerifyOptions, VerifyReport, load_inputs
    from onnx_conv2matmul.verify.report import VerifyCommandReport

# Imported on first use: they import onnx-ir, onnxruntime or numpy.
_LAZY = {
    "convert": "api",
    "convert_file": "api",
    "verify_files": "api",
    "quantize_file": "api",
    "inspect_file": "api",
    "check_bundle": "api",
    "build_bundle": "api",
    "BundleOptions": "bundle.build",
    "BundleBuildReport": "bundle.report",
    "bench_models": "api",
    "BenchReport": "speed.bench",
    "SpeedOptions": "speed.choose",
    "TimingOptions": "speed.timing",
    "ConvToMatMulPass": "rewrite.passes",
    "Progress": "files.progress",
    "AutoOptions": "quantize.search_options",
    "MetricTarget": "quantize.metric",
    "NodeSetting": "quantize.settings",
    "QuantizeOptions": "quantize.settings",
    "BundleReport": "quantize.report",
    "InspectReport": "quantize.report",
    "QuantizeReport": "quantize.report",
    "VerifyOptions": "verify.check",
    "VerifyReport": "verify.check",
    "load_inputs": "verify.check",
    "VerifyCommandReport": "verify.report",
}

__all__ = [
    "AutoOptions",
    "BenchReport",
    "BundleBuildReport",
    "BundleOptions",
    "BundleReport",
    "CheckerError",
    "Conv2MatMulError",
    "ConvEntry",
    "ConvToMatMulPass",
    "ConvertOptions",
    "ConvertReport",
    "DestinationBusy",
    "InputError",
    "InspectReport",
    "MetricTarget",
    "ModelLoadError",
    "ModelRunError",
    "NodeSetting",
    "OptionConflict",
    "Progress",
    "QuantizeOptions",
    "QuantizeReport",
    "SkipReason",
    "SpeedOptions",
    "Status",
    "TargetUnreachable",
    "TimingOptions",
    "ValidationError",
    "VerifyCommandReport",
    "VerifyOptions",
    "VerifyReport",
    "__version__",
    "bench_models",
    "build_bundle",
    "check_bundle",
    "convert",
    "convert_file",
    "inspect_file",
    "load_inputs",
    "quantize_file",
    "verify_files",
]
_SUBMODULES = ("api", "bundle", "cli", "files", "quantize", "report", "rewrite", "speed", "verify")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
