"""``--int8-dynamic`` as one pass: the original measured once, int8 candidates made with
onnxruntime's ``quantize_dynamic`` and checked against it, and the first that meets the criterion
kept.

1. Every node onnxruntime takes, weights per channel (one scale per output channel). On three
   trained models where per-tensor scales missed the 0.99 floor, per channel met it: ddddocr's
   OCR (an LSTM and a MatMul) 0.975 -> 0.9998, FSMN VAD 0.988 -> 0.994, openWakeWord's "hey
   jarvis"; for 1-2% more bytes (the scales).
2. Should that miss, every node with per-tensor scales (g2p-id's bidirectional LSTM measured
   0.978 per tensor and 0.874 per channel).
3. Should both miss, a step back by measured error: the nodes quantized (at most
   :data:`MAX_UNITS` groups of them, consecutive in the graph) are each made int8 alone and
   checked, and those whose losses add up to at most :data:`KEEP_SHARE` of the criterion's limit
   are made int8 together, the least costly first; a miss leaves the costliest of them in float
   too, at most :data:`MAX_TRIES` times.

When no node can be int8 within the criterion, the run refuses (exit 2) and says why: int8
dynamic quantization does not take that model, MatMulNBits may.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from onnx_conv2matmul._graphs import walk_graphs
from onnx_conv2matmul.errors import Hint, ModeRefused, first_line
from onnx_conv2matmul.files.paths import folder_bytes

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.check import Checked
    from onnx_conv2matmul.quantize.plan import Run
    from onnx_conv2matmul.quantize.reference import Reference

MAX_UNITS = 8
"""The step back measures at most this many groups of nodes, each made int8 alone."""
KEEP_SHARE = 0.8
"""The step back keeps the nodes whose measured losses add up to at most this share of the limit."""
MAX_TRIES = 3
"""Candidates the step back makes before it gives up."""

CHECKED_BEFORE = (
    "the result's outputs are those of its check when it was made (the same file): it was not run again"
)
"""The accuracy check's warning: the rows of the candidate's check stand for the result's."""

Make = Callable[[str, bool, Sequence[str] | None], str]
"""Quantize the rewritten model into a folder: ``(folder, per_channel, nodes or None: all)``, the
path of the ``.onnx`` written."""


@dataclasses.dataclass
class Chosen:
    """A candidate made: its path, its check, and the reference it was checked against."""

    path: str
    checked: Checked
    reference: Reference


def quantized_nodes(fp32: ir.Model, quantized_path: str, op_types: Sequence[str]) -> list[str]:
    """The names of the nodes of ``fp32`` that ``quantize_dynamic`` replaced in the model at
    ``quantized_path``, in graph order (every scope)."""
    import onnx

    proto = onnx.load(quantized_path, load_external_data=False)
    left = {n.name for g, _ in walk_graphs(ir.serde.deserialize_model(proto).graph) for n in g}
    wanted = set(op_types)
    return [
        n.name
        for g, _ in walk_graphs(fp32.graph)
        for n in g
        if n.op_type in wanted and n.name and n.name not in left
    ]


def groups_of(names: Sequence[str], count: int = MAX_UNITS) -> list[list[str]]:
    """``names`` in at most ``count`` groups of consecutive names, as even as can be."""
    size, extra = divmod(len(names), count)
    groups, start = [], 0
    for index in range(min(count, len(names))):
        end = start + size + (1 if index < extra else 0)
        groups.append(list(names[start:end]))
        start = end
    return groups


class Int8Pass:
    """One ``--int8-dynamic`` run's candidates against the original measured once."""

    def __init__(self, run: Run, fp32: ir.Model, folder: str, make: Make, op_types: Sequence[str]) -> None:
        self.run, self.fp32, self.folder, self.make = run, fp32, folder, make
        self.op_types = list(op_types)
        self.floor = run.plan.verify.min_cosine
        self.candidates: list[dict[str, Any]] = []
        self.decision: dict[str, Any] | None = None
        self.reference: Reference | None = None
        self.names: list[str] = []
        """The nodes the first candidate quantized (every node ``quantize_dynamic`` takes)."""
        self.written = 0
        """Bytes written: the reference's files and every candidate made (those removed too)."""

    def choose(self) -> Chosen:
        """The first candidate that meets the criterion (see the module's documentation).

        Raises:
            ModeRefused: no node can be int8 within the criterion.
        """
        from onnx_conv2matmul.quantize import measure as _measure

        plan = self.run.plan
        plan.progress.phase("Measuring the original")
        folder = self._folder("reference")
        self.reference = _measure.measure(plan, folder, None, plan.progress.phase).reference
        self.written += folder_bytes(folder)
        plan.progress.phase("Quantizing (int8 dynamic, per channel)")
        first = self._candidate("int8 per channel", True, None)
        if first.checked.passed:
            return first
        plan.progress.phase("Quantizing (int8 dynamic, per tensor)")
        second = self._candidate("int8 per tensor", False, None)
        if second.checked.passed:
            return second
        per_channel = first.checked.loss(self._floor()) <= second.checked.loss(self._floor())
        return self._step_back(self.names, per_channel, (first.checked, second.checked))

    def _floor(self) -> float:
        assert self.floor is not None
        return self.floor

    def _folder(self, name: str) -> str:
        path = os.path.join(self.folder, name)
        os.makedirs(path, exist_ok=True)
        return path

    def _candidate(self, label: str, per_channel: bool, nodes: Sequence[str] | None) -> Chosen:
        from onnx_conv2matmul.quantize.check import check
        from onnx_conv2matmul.quantize.measure import session_options

        assert self.reference is not None
        folder = self._folder(f"candidate-{len(self.candidates)}")
        path = self.make(folder, per_channel, nodes)
        self.written += folder_bytes(folder)
        if nodes is None and not self.names:
            self.names = quantized_nodes(self.fp32, path, self.op_types)
        import onnxruntime as ort

        try:
            session = ort.InferenceSession(
                path, session_options(self.run.plan.verify), providers=["CPUExecutionProvider"]
            )
        except Exception as err:  # a candidate that does not load fails, and says why
            from onnx_conv2matmul.quantize.check import Checked

            text = first_line(err)
            checked = Checked(
                [],
                passed=False,
                worst_cosine=None,
                failure=f"onnxruntime cannot load it: {text}",
                seconds=0.0,
            )
        else:
            try:
                checked = check(session, self.reference, self.run.plan.verify)
            finally:
                del session
        count = len(nodes) if nodes is not None else len(self.names)
        self.candidates.append(
            {
                "candidate": label,
                "settings": {"int8 per channel" if per_channel else "int8 per tensor": count},
                "worst_cosine": checked.worst_cosine,
                "labels": [t.to_dict() for t in checked.labels],
                "passed": checked.passed,
                "seconds": round(checked.seconds, 3),
            }
        )
        if not checked.passed:
            shutil.rmtree(folder, ignore_errors=True)
        return Chosen(path, checked, self.reference)

    def _step_back(self, names: list[str], per_channel: bool, whole: tuple[Checked, Checked]) -> Chosen:
        floor = self._floor()
        mode = "per channel" if per_channel else "per tensor"
        if len(names) < 2:
            self._refuse(names, whole, "")
        groups = groups_of(names)
        progress = self.run.plan.progress
        losses = []
        for index, group in enumerate(groups):
            progress.phase(f"Measuring each node's loss ({index + 1} of {len(groups)})")
            alone = self._candidate(f"int8 {mode}: {_group_text(group)} alone", per_channel, group)
            losses.append(alone.checked.loss(floor))
        kept: list[int] = []
        total = 0.0
        for index in sorted(range(len(groups)), key=lambda i: losses[i]):
            if total + losses[index] <= KEEP_SHARE:
                kept.append(index)
                total += losses[index]
        self.decision = {
            "mode": mode,
            "measured": [
                {"nodes": group, "loss": _rounded(loss)} for group, loss in zip(groups, losses, strict=True)
            ],
            "keep_share": KEEP_SHARE,
            "kept": [],
        }
        for _ in range(MAX_TRIES):
            if not kept:
                break
            nodes = [name for index in sorted(kept) for name in groups[index]]
            progress.phase(f"Quantizing (int8 dynamic, {len(nodes)} of {len(names)} nodes)")
            chosen = self._candidate(f"int8 {mode}, {len(nodes)} of {len(names)} nodes", per_channel, nodes)
            if chosen.checked.passed:
                self.decision["kept"] = nodes
                return chosen
            kept.remove(max(kept, key=lambda i: losses[i]))
        self._refuse(
            names,
            whole,
            f"; no set of them met it: each group alone cost {_losses_text(losses)} of the limit",
        )
        raise AssertionError("unreachable")

    def _refuse(self, names: Sequence[str], whole: tuple[Checked, Checked], more: str) -> None:
        def text(checked: Checked) -> str:
            if checked.worst_cosine is not None and not checked.labels:
                return f"worst cosine {checked.worst_cosine:.4f}"
            return checked.failure or "below it"

        if not names:
            which = "no node quantized (the rewrite alone)"
        elif len(names) == 1:
            which = f"its one quantizable node ({names[0]})"
        else:
            which = f"its {len(names)} quantizable nodes"
        raise ModeRefused(
            f"int8 dynamic quantization misses the accuracy criterion on this model with {which}:"
            f" {text(whole[0])} per channel, {text(whole[1])} per tensor{more}",
            hint=Hint.NOT_INT8_DYNAMIC,
        )


def _group_text(group: Sequence[str]) -> str:
    return group[0] if len(group) == 1 else f"{group[0]} and {len(group) - 1} after it"


def _rounded(loss: float) -> float | None:
    return None if loss == float("inf") else round(loss, 4)


def _losses_text(losses: Sequence[float]) -> str:
    return ", ".join("unmeasured" if loss == float("inf") else f"{loss:.2f}" for loss in sorted(losses))
