"""The ``bench MODEL...`` command's library side: several models timed side by side, what kind of
quantization each holds, and a warning for every quantized model slower than the baseline.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

from onnx_conv2matmul.errors import ExitCode
from onnx_conv2matmul.report import Command, CommandReport
from onnx_conv2matmul.speed.timing import Clock, SessionFactory, TimingOptions, TimingReport, time_models

INT8_OPS = frozenset(
    {
        "MatMulInteger",
        "DynamicQuantizeLinear",
        "DynamicQuantizeMatMul",
        "QLinearMatMul",
        "ConvInteger",
        "QLinearConv",
    }
)
"""Ops of an int8 model (``quantize_dynamic``'s and static quantization's), any domain."""


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What quantized ops a model holds.

    Attributes:
        nbits: MatMulNBits nodes by (bits, accuracy level).
        int8_ops: Nodes of the :data:`INT8_OPS` by op type.
    """

    nbits: tuple[tuple[int, int, int], ...] = ()
    int8_ops: tuple[tuple[str, int], ...] = ()

    @property
    def quantized(self) -> bool:
        return bool(self.nbits or self.int8_ops)

    @property
    def kind(self) -> str:
        """``float``, ``int4``, ``int8``, or several joined with ``+`` (``int4+int8``)."""
        kinds = {f"int{bits}" for bits, _, _ in self.nbits}
        if self.int8_ops:
            kinds.add("int8")
        return "+".join(sorted(kinds, key=lambda k: int(k[3:]))) or "float"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "matmul_nbits": [
                {"bits": bits, "accuracy_level": level, "nodes": count} for bits, level, count in self.nbits
            ],
            "int8_ops": dict(self.int8_ops),
        }


def quantization_of(path: str) -> Quantization:
    """The quantized ops of the model at ``path`` (subgraphs included), read without its tensors."""
    import onnx

    from onnx_conv2matmul._graphs import proto_graphs

    model = onnx.load(path, load_external_data=False)
    nbits: Counter[tuple[int, int]] = Counter()
    int8: Counter[str] = Counter()
    for node in (n for g in proto_graphs(model.graph) for n in g.node):
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            attrs = {a.name: a.i for a in node.attribute if a.name in ("bits", "accuracy_level")}
            nbits[(int(attrs.get("bits", 4)), int(attrs.get("accuracy_level", 0)))] += 1
        elif node.op_type in INT8_OPS:
            int8[node.op_type] += 1
    return Quantization(
        tuple((bits, level, count) for (bits, level), count in sorted(nbits.items())),
        tuple(sorted(int8.items())),
    )


@dataclasses.dataclass(frozen=True)
class BenchReport(CommandReport):
    """Models timed side by side, with their quantization, and warnings (the ``bench`` command's
    report; a warning does not fail it)."""

    COMMAND: ClassVar[Command] = Command.BENCH
    timing: TimingReport
    quantization: tuple[Quantization, ...]
    warnings: tuple[str, ...]

    @property
    def return_code(self) -> int:
        return int(ExitCode.OK)

    @property
    def failure(self) -> None:
        return None

    @property
    def inputs(self) -> list[str]:
        return [model.path for model in self.timing.models]

    def body(self) -> dict[str, Any]:
        timing = self.timing.to_dict()
        for model, quantization in zip(timing["models"], self.quantization, strict=True):
            model["quantization"] = quantization.to_dict()
        return {**timing, "warnings": list(self.warnings)}


def bench_models(
    paths: Sequence[str | os.PathLike[str]],
    lengths: Sequence[int] | None = None,
    *,
    baseline: int = 0,
    options: TimingOptions | None = None,
    clock: Clock | None = None,
    session_factory: SessionFactory | None = None,
) -> BenchReport:
    """Time ``paths`` side by side against ``paths[baseline]`` (the first by default).

    ``lengths`` overrides ``options.lengths``. A warning names every quantized model (MatMulNBits
    or int8 ops) that is slower than a float baseline at some length, and every model whose inputs
    differ from the baseline's (its ratios compare different work).

    Raises:
        InputError, ModelLoadError, ModelRunError: as
            :func:`onnx_conv2matmul.speed.timing.time_models`.
    """
    options = options or TimingOptions()
    if lengths is not None:
        options = dataclasses.replace(options, lengths=tuple(lengths))
    names = [os.fspath(p) for p in paths]
    if options.synthesis.feeds is None and options.synthesis.found is None:
        from onnx_conv2matmul.verify.check import discover_inputs

        # The input values and sizes the baseline takes, found as quantize finds them (an image
        # height the graph fixes without naming it: PP-OCRv4 rec's x[2] = 48).
        options = dataclasses.replace(options, synthesis=discover_inputs(names[baseline], options.synthesis))
    quantization = tuple(quantization_of(p) for p in names)
    report = time_models(names, options, baseline=baseline, clock=clock, session_factory=session_factory)
    warnings = []
    base = report.models[report.baseline]
    for which, model in enumerate(report.models):
        if which == report.baseline:
            continue
        if model.inputs != base.inputs:
            warnings.append(
                f"{model.label} has other inputs than {base.label} ({model.inputs} vs {base.inputs}):"
                " its ratios compare different work"
            )
        if quantization[which].quantized and not quantization[report.baseline].quantized:
            slower = [lat for lat in model.latencies if lat.ratio is not None and lat.ratio > 1]
            if slower:
                figures = ", ".join(f"{lat.ratio:.2f}x at length {lat.length}" for lat in slower)
                kind = quantization[which].kind
                warnings.append(f"{model.label} ({kind}) is slower than {base.label}: {figures}")
    return BenchReport(report, quantization, tuple(warnings))
