"""One pass of a quantize plan into an output: the state the workflow's steps share.

The :class:`~onnx_conv2matmul.quantize.plan.QuantizePlan` is frozen; what a pass finds on the way
(the kernel choice, the search's settings, the original's score) lives in a :class:`Run`.
"""

from __future__ import annotations

import dataclasses
import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnx_conv2matmul.files import output as _output
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.search_options import AutoOptions
    from onnx_conv2matmul.quantize.settings import QuantizeOptions


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class Run:
    """One pass of a plan into an output: the plan, where it writes, what it has found so far.

    ``quantize`` and ``auto`` start as the plan's and follow the run (the kernel choice and the
    search replace them).
    """

    plan: QuantizePlan
    output: _output.Output
    report: QuantizeReport
    quantize: QuantizeOptions = dataclasses.field(init=False)
    auto: AutoOptions | None = dataclasses.field(init=False)
    original_score: float | None = None

    def __post_init__(self) -> None:
        self.quantize = self.plan.quantize
        self.auto = self.plan.auto
