"""The bundle command's report when it builds a bundle (the listing's is quantize.report.BundleReport)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from onnx_conv2matmul.errors import ExitCode
from onnx_conv2matmul.report import Command, CommandReport

if TYPE_CHECKING:
    from onnx_conv2matmul.bundle.split import SplitCheck


@dataclasses.dataclass
class BundleFile:
    """One file of the bundle: its path in the folder, size, and the model it belongs to."""

    path: str
    bytes: int
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "model": self.model}


@dataclasses.dataclass
class BundleModelResult:
    """One model of the bundle and how it was made.

    Attributes:
        role: ``encoder``, ``decoder_joint``, ``decoder`` or ``joiner``.
        file: Its ``.onnx`` in the bundle.
        mode: ``matmul_nbits`` or ``int8_dynamic``.
        bytes: With its external data.
        source_bytes: The float model it was made from (for the decoder and joiner, the
            split float model).
        min_cosine: The lowest cosine similarity of a float output to the float model's in
            the accuracy check (None: no float output was compared).
        passed: Whether the accuracy check passed (True when it only measured).
        report: The quantize report (as the ``quantize`` command writes it).
    """

    role: str
    file: str
    mode: str
    bytes: int
    source_bytes: int
    min_cosine: float | None
    passed: bool
    report: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "file": self.file,
            "mode": self.mode,
            "bytes": self.bytes,
            "source_bytes": self.source_bytes,
            "min_cosine": self.min_cosine,
            "passed": self.passed,
        }


@dataclasses.dataclass
class BundleBuildReport(CommandReport):
    """What :func:`~onnx_conv2matmul.bundle.build.build_bundle` did (the ``bundle`` command's
    report when it builds).

    ``output_dir`` is None when nothing was published (an accuracy check failed);
    ``onnx_asr_quantization`` is the ``quantization`` value onnx-asr loads the bundle with
    (None for sherpa-onnx); ``split`` the check of the decoder and joiner against the joint.
    """

    COMMAND: ClassVar[Command] = Command.BUNDLE

    source_dir: str
    layout: str
    output_dir: str | None = None
    onnx_asr_quantization: str | None = None
    files: list[BundleFile] = dataclasses.field(default_factory=list)
    models: list[BundleModelResult] = dataclasses.field(default_factory=list)
    source_bytes: int = 0
    split: SplitCheck | None = None
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def bundle_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.models) and (self.split is None or self.split.passed)

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK if self.passed else ExitCode.FAILED)

    @property
    def inputs(self) -> str:
        return self.source_dir

    @property
    def failure(self) -> str | None:
        failed = [m.role for m in self.models if not m.passed]
        if failed:
            return f"accuracy below the minimum: {', '.join(failed)}; nothing was written"
        if self.split is not None and not self.split.passed:
            return "the split decoder and joiner differ from the joint model; nothing was written"
        return None

    def body(self) -> dict[str, Any]:
        return {
            "output_dir": self.output_dir,
            "layout": self.layout,
            "onnx_asr_quantization": self.onnx_asr_quantization,
            "files": [f.to_dict() for f in self.files],
            "bundle_bytes": self.bundle_bytes,
            "source_bytes": self.source_bytes,
            "models": [m.to_dict() for m in self.models],
            "split": None if self.split is None else self.split.to_dict(),
            "metadata": self.metadata,
            "config": self.config,
            "passed": self.passed,
            "seconds": self.seconds,
        }
