"""The step back after a held-out miss (see :func:`onnx_conv2matmul.quantize.workflow.quantize_file`):
with ``--inputs``, a result that met the criterion on the samples it was chosen on and missed it on
the held-out ones is chosen again, each choice asked for a stricter minimum cosine on the samples
it sees (:func:`step_back_cosine`), at most :data:`MAX_STEP_BACKS` times; the report keeps each
result that missed (``accuracy.held_out.steps``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnx_conv2matmul.files.progress import Progress
    from onnx_conv2matmul.quantize.report import QuantizeReport

MAX_STEP_BACKS = 2
"""Runs made again after a held-out miss, each choosing with a stricter minimum cosine."""
STEP_BACK_SHARE = 0.9
"""A step back aims the held-out samples' loss at this share of one that passes (a margin)."""
MIN_STEP_BACK_LOSS = 1e-6
"""A step back that would allow less cosine loss than this asks for float: the run fails instead."""


def step_back_cosine(report: QuantizeReport) -> float | None:
    """The minimum cosine the next run's choices must meet on the samples they see, after the
    result met the criterion there and missed it on the held-out ones; None: no step back (the
    held-out samples passed or were not checked, :data:`MAX_STEP_BACKS` were made, or only float
    would do).

    The held-out samples' loss (one minus their worst cosine) is aimed at a share
    (:data:`STEP_BACK_SHARE`) of one that would have passed: the criterion's, or, when their labels
    moved, the loss at which they moved. The samples the run chooses on are asked for that aim
    times the ratio of their loss to the held-out samples' in the result that missed, and at least
    half the loss allowed before."""
    held = report.accuracy.get("held_out") or {}
    criterion = report.accuracy.get("min_cosine")
    if held.get("passed") is not False or criterion is None or len(held.get("steps") or []) >= MAX_STEP_BACKS:
        return None
    verification = report.verification
    chosen = verification.worst_cosine if verification is not None else None
    asked = held.get("chosen_with_min_cosine") or criterion
    allowed = (1.0 - asked) / 2
    worst = held.get("worst_cosine")
    if worst is not None and chosen is not None and worst < 1.0:
        aim = 1.0 - criterion
        if any(not t["passed"] for t in held.get("labels") or []):
            aim = min(aim, 1.0 - worst)
        allowed = min(allowed, STEP_BACK_SHARE * aim * (1.0 - chosen) / (1.0 - worst))
    if allowed <= MIN_STEP_BACK_LOSS:
        return None
    return round(1.0 - float(allowed), 8)


def record_step(report: QuantizeReport, missed: QuantizeReport) -> None:
    """The held-out miss of ``missed`` as a step of ``report``'s, and a warning that says so."""
    held, before = report.accuracy.get("held_out"), missed.accuracy.get("held_out") or {}
    if not held:
        return
    step = {
        "chosen_with_min_cosine": before.get("chosen_with_min_cosine") or missed.accuracy.get("min_cosine"),
        "worst_cosine": before.get("worst_cosine"),
        "labels": before.get("labels") or [],
        "note": before.get("note"),
    }
    held["steps"] = [*(before.get("steps") or []), step]
    if report.passed:
        report.warnings.append(
            f"the result chosen with a minimum cosine of {step['chosen_with_min_cosine']:g}"
            f" {before.get('note')}: the run stepped back and chose with"
            f" {held['chosen_with_min_cosine']:g} on those samples, which the held-out ones meet"
        )


class KeptOpen:
    """A progress whose ``close`` waits for the last attempt of a run (the step backs reuse it)."""

    def __init__(self, inner: Progress) -> None:
        self.inner = inner

    def phase(self, name: str) -> None:
        self.inner.phase(name)

    def advance(self, done: int, total: int) -> None:
        self.inner.advance(done, total)

    def close(self) -> None:
        pass
