"""onnxruntime's quantizers log as they go (every node at INFO, advice on the root logger, a
progress bar on stdout); their records are taken into this package's logger instead.

While :func:`onnxruntime_logs_captured` is active, a filter on each of onnxruntime's quantizer
loggers (and, for the records onnxruntime's modules send to the root logger, on the root logger)
re-logs every such record to :data:`logger` at DEBUG and drops it where it was. Nothing else
about logging changes: no level, handler or propagation is set, and the records of any other
library pass as they did. A host program that wants them configures ``onnx_conv2matmul``'s
logger as it likes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# The loggers onnxruntime's weight-only and dynamic quantizers log to by name.
_NAMED = (
    "onnxruntime.quantization.matmul_nbits_quantizer",
    "neural_compressor",
)
_ONNXRUNTIME_DIR = os.sep + "onnxruntime" + os.sep


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
        yield
    finally:
        for target, taker in filters:
            target.removeFilter(taker)
