"""The reports of quantize, inspect and bundle."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from onnx_conv2matmul.errors import ExitCode
from onnx_conv2matmul.report import Command, CommandReport

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.other_weights import OtherWeightsResult
    from onnx_conv2matmul.quantize.projection import NBitsProjection, WeightStats
    from onnx_conv2matmul.quantize.search_result import AutoResult
    from onnx_conv2matmul.quantize.settings import NodeSetting
    from onnx_conv2matmul.quantize.trade import TransposeTrade
    from onnx_conv2matmul.quantize.unchanged import Unchanged
    from onnx_conv2matmul.rewrite.report import ConvEntry, ConvertReport
    from onnx_conv2matmul.verify.check import VerifyReport


@dataclasses.dataclass
class QuantizeReport(CommandReport):
    """What ``quantize`` did, as data.

    ``mode`` is ``matmul_nbits`` or ``int8_dynamic``; ``output_path`` is None when the
    accuracy check failed and nothing was written. ``settings`` is the resolved setting of
    each MatMul that became MatMulNBits, by node name; ``options["quantize"]`` is a settings
    file's object that replays the run.
    """

    COMMAND: ClassVar[Command] = Command.QUANTIZE

    mode: str
    input_path: str
    output_path: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    rewrite: dict[str, Any] = dataclasses.field(default_factory=dict)
    matmuls: int = 0
    quantized_nodes: int = 0
    excluded: list[str] = dataclasses.field(default_factory=list)
    settings: dict[str, NodeSetting] = dataclasses.field(default_factory=dict)
    weights_without_rewrite: WeightStats | None = None
    weights_with_rewrite: WeightStats | None = None
    weight_kinds: Any = None
    """The original's float weights by kind (``quantize.inspection.WeightKinds``), read before the rewrite."""
    coverage: dict[str, Any] | None = None
    """The share of the original's float weight bytes stored quantized, by kind (see
    :mod:`onnx_conv2matmul.quantize.inspection`); None for int8 dynamic quantization."""
    input_bytes: int = 0
    output_bytes: int = 0
    external_data: bool = False
    seconds: float = 0.0
    seconds_by_phase: dict[str, float] = dataclasses.field(default_factory=dict)
    peak_rss_bytes: int = 0
    peak_rss_quantize_bytes: int = 0
    bytes_written: int | None = None
    """Bytes written to disk (the result and the scratch files), counted by the one pass."""
    one_pass: dict[str, Any] | None = None
    """The one pass's candidates and decision (see :mod:`onnx_conv2matmul.quantize.onepass`)."""
    verification: VerifyReport | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    other_weights: OtherWeightsResult | None = None
    auto: AutoResult | None = None
    latency: dict[str, Any] | None = None
    kernel_choice: dict[str, Any] | None = None
    kernel_plan: Any = None
    """The kernel settings chosen from per-shape costs (``quantize.kernel.KernelPlan``), or None."""
    accuracy: dict[str, Any] = dataclasses.field(default_factory=dict)
    unchanged: Unchanged | None = None
    """Why no MatMul was quantized (None when some were, or in int8 dynamic mode)."""
    transposes: TransposeTrade | None = None
    """The trade of the convs whose rewrite adds Transposes, when it was weighed."""

    @property
    def passed(self) -> bool:
        metric = self.accuracy.get("metric") or {}
        if metric.get("passed") is False or self.held_out_missed:
            return False
        return self.verification is None or self.verification.passed

    @property
    def held_out_missed(self) -> bool:
        """Whether the result met the criterion on the samples it was chosen on and missed it on
        the held-out ones."""
        held = self.accuracy.get("held_out") or {}
        return held.get("passed") is False

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK if self.passed else ExitCode.FAILED)

    @property
    def failure(self) -> str | None:
        if self.passed:
            return None
        metric = self.accuracy.get("metric") or {}
        if metric.get("passed") is False:
            return (
                f"the score of {metric['function']} dropped from {metric['original_score']:.6g} to"
                f" {metric['score']:.6g}, more than {metric['max_drop']:g}"
                f"{' (relative)' if metric['relative'] else ''}; nothing was written"
            )
        if self.held_out_missed:
            return self.held_out_failure()
        assert self.verification is not None
        min_cosine = self.verification.options.min_cosine
        if min_cosine is not None:
            return f"accuracy below the minimum cosine similarity {min_cosine:g}; nothing was written"
        return "the outputs differ where they must match; nothing was written"

    def held_out_failure(self, hint: str = "") -> str:
        """What the held-out samples missed, after which steps back; ``hint`` ends it."""
        held = self.accuracy["held_out"]
        steps = held.get("steps") or []
        if not steps:
            return f"{held['note']}; nothing was written{hint}"
        aimed = ", then ".join(f"{step['chosen_with_min_cosine']:g}" for step in steps)
        return (
            f"{held['note']}, after {len(steps)} step(s) back (chosen with a minimum cosine of {aimed},"
            f" then {held['chosen_with_min_cosine']:g} on those samples); nothing was written{hint}"
        )

    @property
    def inputs(self) -> str:
        return self.input_path

    @property
    def ratio(self) -> float | None:
        """Output bytes over input bytes (None when the input size is unknown)."""
        return self.output_bytes / self.input_bytes if self.input_bytes else None

    def body(self) -> dict[str, Any]:
        without, with_ = self.weights_without_rewrite, self.weights_with_rewrite
        return {
            "mode": self.mode,
            "output": self.output_path,
            "options": self.options,
            "rewrite": self.rewrite,
            "matmuls": self.matmuls,
            "quantized_nodes": self.quantized_nodes,
            "excluded": self.excluded,
            "quantized": [{"node": name, **setting.to_dict()} for name, setting in self.settings.items()],
            "weights_without_rewrite": without.to_dict() if without else None,
            "weights_with_rewrite": with_.to_dict() if with_ else None,
            "files": {
                "input_bytes": self.input_bytes,
                "output_bytes": self.output_bytes,
                "ratio": None if self.ratio is None else round(self.ratio, 4),
                "external_data": self.external_data,
            },
            "seconds": round(self.seconds, 2),
            "seconds_by_phase": self.seconds_by_phase,
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_rss_quantize_bytes": self.peak_rss_quantize_bytes,
            "bytes_written": self.bytes_written,
            "one_pass": self.one_pass,
            "verification": None if self.verification is None else self.verification.to_dict(),
            "warnings": self.warnings,
            "other_weights": None if self.other_weights is None else self.other_weights.to_dict(),
            "auto": None if self.auto is None else self.auto.to_dict(),
            "latency": self.latency,
            "kernel_choice": self.kernel_choice,
            "kernel_costs": None if self.kernel_plan is None else self.kernel_plan.to_dict(),
            "accuracy": self.accuracy or None,
            "unchanged": None if self.unchanged is None else self.unchanged.to_dict(),
            "transposes": None if self.transposes is None else self.transposes.to_dict(),
            "coverage": self.coverage,
        }


@dataclasses.dataclass(frozen=True)
class BundleModel:
    """One model of a bundle: its file name, its size with its external data, and those files.

    In a manifest, also ``files`` (each file's ``path``, ``bytes`` and ``sha256``) and
    ``quantization`` (from the model's quantize report, None without one).
    """

    name: str
    size: int
    external_data: list[str]
    files: list[dict[str, Any]] | None = None
    quantization: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"model": self.name, "bytes": self.size, "external_data": self.external_data}
        if self.files is not None:
            data["files"] = self.files
            data["quantization"] = self.quantization
        return data


@dataclasses.dataclass
class BundleReport(CommandReport):
    """The models in a directory (``input``), each with its external data, and the total size.

    ``warnings``: what looks missing (an encoder without its decoder, or the other way round).
    """

    COMMAND: ClassVar[Command] = Command.BUNDLE

    directory: str
    models: list[BundleModel] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(m.size for m in self.models)

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK)

    @property
    def failure(self) -> None:
        return None

    @property
    def inputs(self) -> str:
        return self.directory

    def body(self) -> dict[str, Any]:
        return {
            "models": [m.to_dict() for m in self.models],
            "total_bytes": self.total_bytes,
            "warnings": self.warnings,
        }


@dataclasses.dataclass
class InspectNode:
    """One node as ``inspect`` shows it: convert's entry, plus the node's attributes.

    Attributes:
        entry: What ``convert`` with the same options does to the node (its report entry;
            ``inspect`` fills the weight's shape, type and size when the analysis stopped
            before reading them, e.g. for an op it does not rewrite).
        kernel: The kernel's spatial dims (from the weight, else ``kernel_shape``); None
            for a node that is not a convolution or whose kernel is unknown.
        group, strides, pads, dilations, auto_pad: The convolution's attributes, defaults
            filled in; None for a node that is not a convolution.
        transposes_added: For a converted convolution, how many Transpose nodes its
            conversion adds to the model after the cleanup (negative: it removes some); the
            sum over the converted convs is ``transposes_after - transposes_before``. None
            for the other nodes.
    """

    entry: ConvEntry
    kernel: list[int] | None = None
    group: int | None = None
    strides: list[int] | None = None
    pads: list[int] | None = None
    dilations: list[int] | None = None
    auto_pad: str | None = None
    transposes_added: int | None = None

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "entry"}
        return {**self.entry.to_dict(), **fields}


@dataclasses.dataclass
class InspectReport(CommandReport):
    """What ``convert`` would do to a model and what MatMulNBits would then take; nothing written.

    ``rewrite`` is the report of the rewrite pass run in memory (the one ``convert`` runs),
    ``nodes`` its entries with the nodes' attributes, in the same order.
    """

    COMMAND: ClassVar[Command] = Command.INSPECT

    input_path: str
    rewrite: ConvertReport
    nodes: list[InspectNode]
    projection: NBitsProjection
    external_data: bool = False
    checker: str | None = None
    coverage: dict[str, Any] | None = None
    """The share of the float weight bytes MatMulNBits could take after the rewrite, by kind (see
    :mod:`onnx_conv2matmul.quantize.inspection`): what ``quantize`` reports as stored quantized."""

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK)

    @property
    def failure(self) -> None:
        return None

    @property
    def inputs(self) -> str:
        return self.input_path

    def body(self) -> dict[str, Any]:
        return {
            "options": self.rewrite.options,
            "opset": self.rewrite.opset,
            "files": {"input_bytes": self.projection.model_bytes, "external_data": self.external_data},
            "checker": self.checker,
            "totals": self.rewrite.totals(),
            "convs": [node.to_dict() for node in self.nodes],
            "projection": self.projection.to_dict(),
            "coverage": self.coverage,
        }
