"""onnxruntime's quantizers log as they go (every node at INFO, advice on the root logger, a
progress bar on stdout); their records are taken into this package's logger instead.

While :func:`onnxruntime_logs_captured` is active, a filter on each of onnxruntime's quantizer
loggers (and, for the records onnxruntime's modules send to the root logger, on the root logger)
re-logs every such record to :data:`logger` at DEBUG and drops it where it was. Nothing else
about logging changes: no level or propagation is set, no handler of the host's is added or
removed, and the records of any other library pass as they did. A host program that wants them
configures ``onnx_conv2matmul``'s logger as it likes.

onnxruntime also changes the root logger: importing ``matmul_nbits_quantizer`` calls
``logging.basicConfig`` (a stderr handler, level INFO), and ``quantize_dynamic`` logs through
``logging.warning``, which calls it too. ``basicConfig`` does nothing when the root logger has a
handler, so while onnxruntime's code runs (the import, through :func:`matmul_nbits_quantizer`
only, and every :func:`onnxruntime_logs_captured` block) a root logger without one gets a
placeholder; it passes a record on to ``logging.lastResort`` as Python would with no handler at
all, and is the only handler removed afterwards: never one of the host's. (A host that calls
``basicConfig`` from another thread during such a block finds it done nothing.)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import types
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# The loggers onnxruntime's weight-only and dynamic quantizers log to by name.
_NAMED = (
    "onnxruntime.quantization.matmul_nbits_quantizer",
    "neural_compressor",
)
_ONNXRUNTIME_DIR = os.sep + "onnxruntime" + os.sep
_QUANTIZER = "onnxruntime.quantization.matmul_nbits_quantizer"
_importing = threading.Lock()


class _NoHandler(logging.Handler):
    """The root logger's placeholder: a record no other handler takes goes to
    ``logging.lastResort``, as it would with no handler at all."""

    def emit(self, record: logging.LogRecord) -> None:
        found = logging.Logger.manager.loggerDict.get(record.name)
        chain: logging.Logger | None = found if isinstance(found, logging.Logger) else logging.getLogger()
        while chain is not None:
            if any(h is not self for h in chain.handlers):
                return
            if not chain.propagate:
                break
            chain = chain.parent
        last = logging.lastResort
        if last is not None and record.levelno >= last.level:
            last.handle(record)


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """A block whose ``logging.basicConfig`` calls change nothing (see the module docstring)."""
    root = logging.getLogger()
    if root.handlers:
        yield
        return
    placeholder = _NoHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeHandler(placeholder)


def matmul_nbits_quantizer() -> types.ModuleType:
    """onnxruntime's ``matmul_nbits_quantizer`` module, imported without the root logger change
    its import makes (see the module docstring)."""
    module = sys.modules.get(_QUANTIZER)
    if module is not None:
        return module
    with _importing, root_logger_kept():
        return importlib.import_module(_QUANTIZER)


class _TakeOver(logging.Filter):
    """Re-log a record to :data:`logger` at DEBUG and drop it (only onnxruntime's, when asked)."""

    def __init__(self, *, onnxruntime_only: bool) -> None:
        super().__init__()
        self.onnxruntime_only = onnxruntime_only

    def filter(self, record: logging.LogRecord) -> bool:
        if self.onnxruntime_only and _ONNXRUNTIME_DIR not in record.pathname:
            return True
        logger.debug("%s [%s] %s", record.name, record.levelname, record.getMessage())
        return False


@contextlib.contextmanager
def onnxruntime_logs_captured() -> Iterator[None]:
    """Take onnxruntime's quantizer log records into this package's logger for the block."""
    filters = [(logging.getLogger(name), _TakeOver(onnxruntime_only=False)) for name in _NAMED]
    filters.append((logging.getLogger(), _TakeOver(onnxruntime_only=True)))
    for target, taker in filters:
        target.addFilter(taker)
    try:
        with root_logger_kept():
            yield
    finally:
        for target, taker in filters:
            target.removeFilter(taker)
