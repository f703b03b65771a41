"""The commands' reports: typed data sharing one JSON envelope, rendered elsewhere (``render.py``).

Every JSON object the command line prints or writes comes from :func:`envelope`: a command's
report (:class:`CommandReport`: convert, verify, quantize, bundle, inspect) or, when a command ends
without one, an :class:`ErrorReport`. ``schema/report.schema.json`` in the source tree
describes them all.

This module imports nothing heavy (the console entry point may use it before anything else):
the types of other modules it names are for type checking only.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.errors import ExitCode
from onnx_conv2matmul.rewrite.reasons import SkipReason

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.search import AutoResult
    from onnx_conv2matmul.quantize.other_weights import OtherWeightsResult
    from onnx_conv2matmul.quantize.nbits import NodeSetting, WeightStats
    from onnx_conv2matmul.verify.check import VerifyReport

SCHEMA_VERSION = 2
TOOL = "onnx-conv2matmul"


class Command(str, enum.Enum):
    """The commands that print a report."""

    CONVERT = "convert"
    VERIFY = "verify"
    QUANTIZE = "quantize"
    BUNDLE = "bundle"
    INSPECT = "inspect"


# The commands that take several inputs: their envelope has ``inputs`` (a list), not ``input``.
_SEVERAL_INPUTS = frozenset({Command.VERIFY.value})
_ENVELOPE_KEYS = ("schema_version", "tool", "version", "command", "input", "inputs", "return_code", "error")


def envelope(
    command: Command | str | None,
    *,
    inputs: str | list[str] | None,
    return_code: int,
    error: str | None,
    body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The one JSON object of a command: the envelope, then the command's own ``body``.

    The envelope is ``schema_version``, ``tool``, ``version``, ``command`` (None when not
    known), ``input`` (or, for ``verify``, ``inputs``: a list; None when not known),
    ``return_code`` and ``error``.

    Raises:
        ValueError: ``error`` is None while ``return_code`` is not 0, or the other way round
            (``error`` is null exactly when the command succeeded); ``inputs`` does not suit
            the command; or ``body`` repeats an envelope key.
    """
    if (error is None) != (return_code == ExitCode.OK):
        raise ValueError(f"error must be null exactly when return_code is 0: {return_code}, {error!r}")
    name = command.value if isinstance(command, Command) else command
    several = name in _SEVERAL_INPUTS
    if inputs is not None and isinstance(inputs, list) != several:
        raise ValueError(f"command {name!r} takes {'a list of inputs' if several else 'one input'}")
    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": TOOL,
        "version": __version__,
        "command": name,
        "inputs" if several else "input": inputs,
        "return_code": return_code,
        "error": error,
    }
    clash = [key for key in body or {} if key in _ENVELOPE_KEYS]
    if clash:
        raise ValueError(f"the body repeats envelope keys: {clash}")
    data.update(body or {})
    return data


class CommandReport(abc.ABC):
    """What a command did, as data; :meth:`to_dict` is its JSON object.

    ``return_code`` is the command line's exit code; ``failure`` says why it is not 0 (None
    exactly when it is 0), in words that name no command-line flag.
    """

    COMMAND: ClassVar[Command]

    @property
    @abc.abstractmethod
    def return_code(self) -> int: ...

    @property
    @abc.abstractmethod
    def failure(self) -> str | None: ...

    @property
    @abc.abstractmethod
    def inputs(self) -> str | list[str] | None:
        """The envelope's ``input`` (or ``inputs`` for ``verify``)."""

    @abc.abstractmethod
    def body(self) -> dict[str, Any]:
        """The command's own keys, after the envelope."""

    def to_dict(self, *, error: str | None = None) -> dict[str, Any]:
        """The report as one JSON object (see :func:`envelope`).

        ``error``: the message of a failed run in the caller's words (the command line
        names its flags); by default :attr:`failure`.
        """
        return envelope(
            self.COMMAND,
            inputs=self.inputs,
            return_code=self.return_code,
            error=self.failure if error is None else error,
            body=self.body(),
        )


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """The object printed instead of a report when a command ends without one.

    An error, a usage error or an interrupt: the envelope alone, ``return_code`` not 0.
    """

    command: str | None
    return_code: int
    error: str
    inputs: str | list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return envelope(self.command, inputs=self.inputs, return_code=self.return_code, error=self.error)


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


@dataclasses.dataclass
class VerifyCommandReport(CommandReport):
    """The verify command's report: one comparison of two models (``verification``)."""

    COMMAND: ClassVar[Command] = Command.VERIFY

    verification: VerifyReport

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK if self.verification.passed else ExitCode.FAILED)

    @property
    def failure(self) -> str | None:
        return None if self.verification.passed else "verification failed: the models differ"

    @property
    def inputs(self) -> list[str]:
        return [self.verification.original, self.verification.candidate]

    def body(self) -> dict[str, Any]:
        return {"verification": self.verification.to_dict()}


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
    input_bytes: int = 0
    output_bytes: int = 0
    external_data: bool = False
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    peak_rss_quantize_bytes: int = 0
    verification: VerifyReport | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    other_weights: OtherWeightsResult | None = None
    auto: AutoResult | None = None

    @property
    def passed(self) -> bool:
        return self.verification is None or self.verification.passed

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK if self.passed else ExitCode.FAILED)

    @property
    def failure(self) -> str | None:
        if self.passed:
            return None
        assert self.verification is not None
        min_cosine = self.verification.options.min_cosine
        if min_cosine is not None:
            return f"accuracy below the minimum cosine similarity {min_cosine:g}; nothing was written"
        return "the outputs differ where they must match; nothing was written"

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
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_rss_quantize_bytes": self.peak_rss_quantize_bytes,
            "verification": None if self.verification is None else self.verification.to_dict(),
            "warnings": self.warnings,
            "other_weights": None if self.other_weights is None else self.other_weights.to_dict(),
            "auto": None if self.auto is None else self.auto.to_dict(),
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
    """The models in a directory (``input``), each with its external data, and the total size."""

    COMMAND: ClassVar[Command] = Command.BUNDLE

    directory: str
    models: list[BundleModel] = dataclasses.field(default_factory=list)

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
class NBitsProjection:
    """What MatMulNBits quantization would make of a model, worked out from shapes alone.

    Attributes:
        bits, block_size, symmetric: The quantizer's settings.
        weights_without_rewrite: Float weight bytes of the model as it is, and the share on
            MatMul input B (what the quantizer takes).
        weights_with_rewrite: The same after the rewrite.
        packed_bytes: The quantized weights, ``[N, ceil(K / block), block * bits / 8]`` uint8
            each.
        scale_bytes: The scales, ``[N, ceil(K / block)]`` in the weight's float type each.
        zero_point_bytes: The zero points (asymmetric only), ``[N, ceil(blocks * bits / 8)]``
            uint8 each.
        float_bytes_removed: The float weights the quantized ones replace (a weight another
            node also reads stays).
        tensor_bytes: Every tensor of the rewritten model, in bytes.
        projected_tensor_bytes: The same after quantization.
        model_bytes: The input's files (the ``.onnx`` and its external data).
        projected_model_bytes: The quantized model's files: ``projected_tensor_bytes`` plus
            what the input's files hold besides tensors (the graph, names, attributes).
    """

    bits: int
    block_size: int
    symmetric: bool
    weights_without_rewrite: WeightStats
    weights_with_rewrite: WeightStats
    packed_bytes: int = 0
    scale_bytes: int = 0
    zero_point_bytes: int = 0
    float_bytes_removed: int = 0
    tensor_bytes: int = 0
    model_bytes: int = 0

    @property
    def quantized_bytes(self) -> int:
        return self.packed_bytes + self.scale_bytes + self.zero_point_bytes

    @property
    def projected_tensor_bytes(self) -> int:
        return self.tensor_bytes - self.float_bytes_removed + self.quantized_bytes

    @property
    def projected_model_bytes(self) -> int:
        return self.projected_tensor_bytes + self.model_bytes - self.tensor_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "weights_without_rewrite": self.weights_without_rewrite.to_dict(),
            "weights_with_rewrite": self.weights_with_rewrite.to_dict(),
            "matmul_nbits": self.weights_with_rewrite.quantizable_matmuls,
            "packed_bytes": self.packed_bytes,
            "scale_bytes": self.scale_bytes,
            "zero_point_bytes": self.zero_point_bytes,
            "float_bytes_removed": self.float_bytes_removed,
            "tensor_bytes": self.tensor_bytes,
            "projected_tensor_bytes": self.projected_tensor_bytes,
            "model_bytes": self.model_bytes,
            "projected_model_bytes": self.projected_model_bytes,
        }


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
        }
