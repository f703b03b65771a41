"""The convert command's report: what happened to every Conv-like node and Gemm, and its check."""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

from onnx_conv2matmul.errors import ExitCode
from onnx_conv2matmul.report import Command, CommandReport
from onnx_conv2matmul.rewrite.reasons import SkipReason

if TYPE_CHECKING:
    from onnx_conv2matmul.verify.check import VerifyReport


class Status(str, enum.Enum):
    CONVERTED = "converted"
    SKIPPED = "skipped"


@dataclasses.dataclass
class ConvEntry:
    """What happened to one Conv-like node.

    Attributes:
        name: The node's name (empty if it had none).
        scope: Where the node lives: ``""`` for the main graph, otherwise the
            path of owning nodes and attributes, e.g. ``"If_0/then_branch"``.
        op_type: ``Conv``, ``ConvInteger``, ...
        domain: The node's domain (``""`` for the default domain).
        status: Converted or skipped.
        reason: Why it was skipped (``None`` when converted).
        detail: Specific values behind the decision, for humans.
        weight_shape: Shape of the weight when it is a known constant.
        weight_dtype: Element type of the weight (``FLOAT``, ``FLOAT16``, ...).
        params: Number of weight elements (0 when unknown).
        weight_bytes: Size of the weight in bytes (0 when unknown).
        matmul: Name of the emitted MatMul node, for a quantizer's exclude list.
        extra_ops: Ops emitted beside Transpose/MatMul/Add (``Pad``, ``Slice``, ``Split`` and
            ``Concat`` for groups, a FusedConv's activation).
    """

    name: str
    scope: str
    op_type: str
    domain: str
    status: Status
    reason: SkipReason | None = None
    detail: str = ""
    weight_shape: list[int] | None = None
    weight_dtype: str | None = None
    params: int = 0
    weight_bytes: int = 0
    matmul: str | None = None
    extra_ops: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["reason"] = self.reason.value if self.reason is not None else None
        return data


@dataclasses.dataclass
class ConvertReport(CommandReport):
    """Everything a rewrite did, as data.

    ``input_path`` and ``output_path`` are None for a model rewritten in memory
    (:func:`onnx_conv2matmul.convert`); ``output_path`` is also None when verification failed
    and nothing was written, or the directory the output was kept in.
    """

    COMMAND: ClassVar[Command] = Command.CONVERT

    entries: list[ConvEntry] = dataclasses.field(default_factory=list)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    opset: int | None = None
    transposes_cancelled: int = 0
    transposes_before: int = 0
    transposes_after: int = 0
    tensors_removed: int = 0
    constants_lifted: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    input_path: str | None = None
    output_path: str | None = None
    input_bytes: int | None = None
    output_bytes: int | None = None
    external_data: bool | None = None
    checker: str | None = None
    verification: VerifyReport | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def converted(self) -> list[ConvEntry]:
        return [e for e in self.entries if e.status is Status.CONVERTED]

    @property
    def skipped(self) -> list[ConvEntry]:
        return [e for e in self.entries if e.status is Status.SKIPPED]

    @property
    def converted_params(self) -> int:
        return sum(e.params for e in self.converted)

    @property
    def converted_weight_bytes(self) -> int:
        return sum(e.weight_bytes for e in self.converted)

    @property
    def skip_counts(self) -> dict[str, int]:
        counts = Counter(e.reason.value for e in self.skipped if e.reason is not None)
        return dict(sorted(counts.items()))

    @property
    def op_type_counts(self) -> dict[str, dict[str, int]]:
        """Per op type (``Conv``, ``Gemm``, ...): the nodes considered and how many were converted."""
        counts: dict[str, dict[str, int]] = {}
        for e in self.entries:
            count = counts.setdefault(e.op_type, {"nodes": 0, "converted": 0})
            count["nodes"] += 1
            count["converted"] += e.status is Status.CONVERTED
        return dict(sorted(counts.items()))

    @property
    def verification_passed(self) -> bool | None:
        return None if self.verification is None else self.verification.passed

    @property
    def return_code(self) -> int:
        """0 on success, 1 when verification failed."""
        return int(ExitCode.FAILED if self.verification_passed is False else ExitCode.OK)

    @property
    def failure(self) -> str | None:
        if self.return_code == ExitCode.OK:
            return None
        kept = f"the output was kept in {self.output_path}" if self.output_path else "nothing was written"
        return f"verification failed: the output differs from the input; {kept}"

    @property
    def inputs(self) -> str | None:
        return self.input_path

    def totals(self) -> dict[str, Any]:
        return {
            "convs": len(self.entries),
            "converted": len(self.converted),
            "skipped": len(self.skipped),
            "converted_params": self.converted_params,
            "converted_weight_bytes": self.converted_weight_bytes,
            "skipped_by_reason": self.skip_counts,
            "by_op_type": self.op_type_counts,
            "transposes_before": self.transposes_before,
            "transposes_after": self.transposes_after,
            "transposes_cancelled": self.transposes_cancelled,
            "tensors_removed": self.tensors_removed,
            "constants_lifted": self.constants_lifted,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
        }

    def body(self) -> dict[str, Any]:
        return {
            "output": self.output_path,
            "options": self.options,
            "opset": self.opset,
            "files": {
                "input_bytes": self.input_bytes,
                "output_bytes": self.output_bytes,
                "external_data": self.external_data,
            },
            "checker": self.checker,
            "totals": self.totals(),
            "nodes": [e.to_dict() for e in self.entries],
            "verification": None if self.verification is None else self.verification.to_dict(),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
        }
