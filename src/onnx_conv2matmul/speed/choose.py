"""Choose a quantized model's MatMulNBits kernel settings by measuring them on this CPU.

The candidates come from one quantized model (:func:`level_candidates`): the same weights with
another ``accuracy_level`` on every ``MatMulNBits`` node, an attribute only, so no candidate is
quantized again and each is a small ``.onnx`` beside the model that shares its external data.
Level 0 (the attribute left out) computes in float; level 4 quantizes the activations to int8
per block and runs integer dot products, which is faster where the CPU has them (AVX-512 VNNI,
AVX-VNNI, ARM dot products) and a little less accurate. Candidates of another block size are
models quantized again (the caller quantizes, :func:`level_candidates` takes each one's levels):
on an AMD EPYC (AVX-512 VNNI) block 128 ran the Parakeet-sized encoder at 0.73-0.87x the latency of
block 64, both at level 4.

:func:`choose_kernel` checks each candidate's accuracy against the original model first (a
level that quantizes activations must still meet the target), times the original and the
candidates that meet it side by side (:mod:`onnx_conv2matmul.speed.timing`), and keeps the
fastest: the lowest geometric mean over the lengths of its latency relative to the original. A
candidate later in the list wins over an earlier one only when it is faster by more than
``min_gain``, so that noise does not trade accuracy for nothing. The record says what each
candidate measured and why the winner won.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from onnx_conv2matmul.speed.timing import (
    Clock,
    Latency,
    ModelTiming,
    SessionFactory,
    TimingOptions,
    TimingReport,
    time_models,
)
from onnx_conv2matmul.verify.options import VerifyOptions

DEFAULT_LEVELS = (0, 4)
"""The accuracy levels tried: the float kernel and the int8 one (levels 1-3 run as level 0 on
x86 CPUs)."""
DEFAULT_MIN_GAIN = 0.02
"""A candidate must be this much faster (geometric mean of latency ratios) than the one it
replaces."""
COSINE_SLACK = 0.1
"""Without an accuracy target, a candidate is acceptable when its ``1 - cosine`` is at most this
much (relatively) above the first candidate's."""

DEFAULT_MARGIN = 0.05
"""How much the settings offered to the search may slow the model's MatMuls, all layers together
(each at its slowest setting offered), as a share of their time in float."""

DEFAULT_BLOCK_SIZES = (64, 128, 256)
"""The block sizes tried when the block size is not pinned. Larger blocks ran faster on an AMD EPYC
(AVX-512 VNNI) at level 4: the MatMulNBits of the Parakeet-sized encoder took 0.83x the time at 256
as at 128, which took 0.75x the time at 64; whether they keep the accuracy is checked like any
candidate's."""

AccuracyCheck = Callable[[str], tuple[float, str]]
"""The worst cosine similarity of a candidate's outputs against the original's (over outputs and
inputs), and a note when it could not be measured (then the cosine is -1)."""


@dataclasses.dataclass(frozen=True)
class SpeedOptions:
    """What ``quantize`` measures, and which kernel settings it tries.

    Attributes:
        timing: Lengths, rounds, warm-up and threads of every measurement.
        levels: The accuracy levels tried, most accurate first; one level pins it.
        block_sizes: The block sizes tried (each one a quantization of its own), most accurate
            first; one pins it.
        min_gain: How much faster a later candidate must be to win (see :func:`choose_kernel`).
        mode: ``shapes``: the settings are chosen from each kernel's cost at the model's weight
            shapes (:mod:`onnx_conv2matmul.speed.costs`), the model quantized once, and the result
            timed against the original once; ``full``: every candidate is quantized and the whole
            models are timed against each other (:func:`choose_kernel`).
        cache: Whether ``shapes`` reads the kernel costs measured before on this machine.
        margin: How much slower than float a setting the search offers a layer may be (see
            :mod:`onnx_conv2matmul.quantize.speed_objective`).
    """

    timing: TimingOptions = dataclasses.field(default_factory=TimingOptions)
    levels: tuple[int, ...] = DEFAULT_LEVELS
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    min_gain: float = DEFAULT_MIN_GAIN
    mode: str = "shapes"
    cache: bool = True
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        if not self.levels or any(not 0 <= level <= 4 for level in self.levels):
            raise ValueError(f"accuracy levels must be 0-4, at least one: {self.levels}")
        if not self.block_sizes or any(b < 16 or b & (b - 1) for b in self.block_sizes):
            raise ValueError(f"block sizes must be powers of 2 from 16, at least one: {self.block_sizes}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.mode not in ("shapes", "full"):
            raise ValueError(f"bench mode must be shapes or full, got {self.mode!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")

    @property
    def chooses(self) -> bool:
        """Whether there is more than one candidate to choose from."""
        return len(self.levels) * len(self.block_sizes) > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.timing.to_dict(),
            "accuracy_levels": list(self.levels),
            "block_sizes": list(self.block_sizes),
            "min_gain": self.min_gain,
            "mode": self.mode,
            "cache": self.cache,
            "margin": self.margin,
        }


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One kernel setting to try: its name, the model file that has it and the setting."""

    name: str
    path: str
    accuracy_level: int
    block_size: int | None = None
    """The block size the weights were quantized with, when candidates differ in it (each block
    size is a model quantized again)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "accuracy_level": self.accuracy_level, "block_size": self.block_size}


@dataclasses.dataclass(frozen=True)
class CandidateResult:
    """What one candidate measured.

    ``latencies`` are None when it was not timed (it missed the accuracy target while another
    met it); ``speed`` is the geometric mean over the lengths of its latency relative to the
    original (lower is faster).
    """

    candidate: Candidate
    cosine: float
    meets_target: bool
    note: str = ""
    latencies: tuple[Latency, ...] | None = None

    @property
    def speed(self) -> float | None:
        if not self.latencies:
            return None
        ratios = [latency.ratio for latency in self.latencies if latency.ratio is not None]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.to_dict(),
            "cosine": self.cosine,
            "meets_target": self.meets_target,
            "note": self.note,
            "speed": self.speed,
            "latencies": None if self.latencies is None else [lat.to_dict() for lat in self.latencies],
        }


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The candidates, what each measured, the winner and why it won.

    Attributes:
        candidates: One result per candidate, in the order tried.
        winner: Index of the chosen candidate.
        reason: Why it won, in a sentence.
        target: The accuracy rule the candidates were held to.
        original: The original model's latencies (None when nothing was timed).
        timing: The full timing report (None when nothing was timed).
        warnings: The winner is slower than the original at some length, or no candidate met
            the target.
    """

    candidates: tuple[CandidateResult, ...]
    winner: int
    reason: str
    target: str
    original: ModelTiming | None
    timing: TimingReport | None
    warnings: tuple[str, ...] = ()

    @property
    def chosen(self) -> CandidateResult:
        return self.candidates[self.winner]

    def to_dict(self) -> dict[str, Any]:
        return {
            "winner": self.chosen.candidate.name,
            "accuracy_level": self.chosen.candidate.accuracy_level,
            "reason": self.reason,
            "target": self.target,
            "candidates": [result.to_dict() for result in self.candidates],
            "original": None if self.original is None else self.original.to_dict(),
            "cpu": None if self.timing is None else self.timing.cpu,
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- #
# Candidates
# --------------------------------------------------------------------------- #


def set_accuracy_level(source: str, level: int, destination: str) -> int:
    """Write ``source`` to ``destination`` with ``accuracy_level`` ``level`` on every
    MatMulNBits node (subgraphs included; level 0 removes the attribute); returns how many nodes.

    The tensors are not read: ``destination`` names the same external data files, so it must
    sit in the same directory as ``source``.
    """
    import onnx

    from onnx_conv2matmul._graphs import proto_graphs

    if os.path.dirname(os.path.abspath(source)) != os.path.dirname(os.path.abspath(destination)):
        raise ValueError("a candidate shares its model's external data: it must sit beside the model")
    if not 0 <= level <= 4:
        raise ValueError(f"accuracy level must be 0-4, got {level}")
    model = onnx.load(source, load_external_data=False)
    count = 0
    for node in (n for g in proto_graphs(model.graph) for n in g.node):
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        count += 1
        kept = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if level:
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    onnx.save(model, destination)
    return count


def accuracy_levels(path: str) -> set[int]:
    """The accuracy levels the model's MatMulNBits nodes have (empty: no such node)."""
    import onnx

    from onnx_conv2matmul._graphs import proto_graphs

    model = onnx.load(path, load_external_data=False)
    levels = set()
    for node in (n for g in proto_graphs(model.graph) for n in g.node):
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
            levels.add(int(level))
    return levels


@contextlib.contextmanager
def level_candidates(
    quantized: str, levels: Sequence[int] = DEFAULT_LEVELS, *, block_size: int | None = None
) -> Iterator[list[Candidate]]:
    """The quantized model at each accuracy level, as files beside it, removed on exit.

    A level the model already has everywhere is the model itself (no file written).
    ``block_size``, when given, is the model's: it goes into the candidates' names and records.

    Raises:
        ValueError: no level, a level out of 0-4, or the model has no MatMulNBits node.
    """
    if not levels:
        raise ValueError("no accuracy level to try")
    present = accuracy_levels(quantized)
    if not present:
        raise ValueError(f"{quantized} has no MatMulNBits node: there is no kernel setting to choose")
    stem, ext = os.path.splitext(quantized)
    written: list[str] = []
    try:
        candidates = []
        for level in dict.fromkeys(levels):
            if present == {level}:
                path = quantized
            else:
                path = f"{stem}.level{level}{ext or '.onnx'}"
                written.append(path)
                set_accuracy_level(quantized, level, path)
            name = (
                f"accuracy level {level}"
                if block_size is None
                else f"block {block_size}, accuracy level {level}"
            )
            candidates.append(Candidate(name, path, level, block_size))
        yield candidates
    finally:
        for path in written:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


# --------------------------------------------------------------------------- #
# Accuracy
# --------------------------------------------------------------------------- #


def reference_accuracy(original: str, verify: VerifyOptions, *, session: Any = None) -> AccuracyCheck:
    """An accuracy check against ``original``: its outputs are computed once, here, on the
    runs the accuracy check plans (synthesised inputs, or ``verify``'s real ones), and each
    candidate is run on the same inputs and compared with them. ``session``: a checking session
    of ``original`` made already.

    Raises:
        ModelRunError, InputError: as :func:`onnx_conv2matmul.verify.check.verify_models` for
            the original.
    """
    from onnx_conv2matmul.errors import Conv2MatMulError
    from onnx_conv2matmul.verify import run as runs
    from onnx_conv2matmul.verify.check import Reference, run_samples
    from onnx_conv2matmul.verify.compare import compare_outputs

    options = dataclasses.replace(verify, report_only=True, min_cosine=None)
    reference = Reference(original, options, session=session)
    names = reference.names
    indices = list(options.output_indices) if options.output_indices else list(range(len(names)))

    def check(candidate: str) -> tuple[float, str]:
        worst = 1.0
        try:
            opened, _, cand_names = runs.open_model(candidate, "candidate", options, reference.specs)
            if cand_names != names:
                return -1.0, f"the candidate has other outputs: {cand_names} vs {names}"
            done = list(reference.done)  # candidate_runs empties the list it is given, not the arrays
            for run, ref_outputs, outputs in runs.candidate_runs(
                opened, reference.specs, done, options, reference.plan.roles
            ):
                samples = run_samples(run, options, reference.plan.roles)
                for index in indices:
                    name = names[index]
                    row = compare_outputs(
                        ref_outputs[index],
                        outputs[index],
                        options,
                        length=run.length,
                        name=name,
                        samples=samples,
                    )
                    if not row.passed:
                        return -1.0, f"output {name!r} at length {run.length}: {row.note}"
                    if row.worst_cosine is not None:  # the worst sample's, as the criterion states
                        worst = min(worst, row.worst_cosine)
        except Conv2MatMulError as err:
            return -1.0, str(err)
        return worst, ""

    return check


# --------------------------------------------------------------------------- #
# The choice
# --------------------------------------------------------------------------- #


def choose_kernel(
    original: str,
    candidates: Sequence[Candidate],
    accuracy: AccuracyCheck,
    *,
    min_cosine: float | None = None,
    timing: TimingOptions | None = None,
    min_gain: float = DEFAULT_MIN_GAIN,
    clock: Clock | None = None,
    session_factory: SessionFactory | None = None,
    time_one: bool = True,
) -> KernelChoice:
    """Keep the fastest candidate that meets the accuracy target (see the module's description).

    Args:
        original: The model the candidates were quantized from: the accuracy reference and the
            latency baseline.
        candidates: In order of preference when they are as fast: the most accurate first.
        accuracy: Measures a candidate (:func:`reference_accuracy`).
        min_cosine: The target; None: no lower than the first candidate's cosine, with
            :data:`COSINE_SLACK` on ``1 - cosine``.
        timing, clock, session_factory: As :func:`onnx_conv2matmul.speed.timing.time_models`.
        time_one: False: when at most one candidate meets the target, there is nothing to choose
            by speed and nothing is timed (a caller that times the result itself after).

    Raises:
        ValueError: no candidate, or ``min_gain`` out of [0, 1).
        ModelLoadError, ModelRunError: the original (or a candidate) cannot be timed.
    """
    if not candidates:
        raise ValueError("no candidate to choose from")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    measured = [accuracy(candidate.path) for candidate in candidates]
    if min_cosine is not None:
        floor, target = min_cosine, f"cosine similarity at least {min_cosine:g} against the original"
    else:
        first = measured[0][0]
        floor = 1 - (1 - first) * (1 + COSINE_SLACK) if first > -1 else math.inf
        target = (
            f"cosine similarity at least {floor:.6g}: no more than {COSINE_SLACK:.0%} further from 1"
            f" than {candidates[0].name}'s"
        )
    meets = [cosine >= floor for cosine, _ in measured]
    timed = [i for i, ok in enumerate(meets) if ok] or list(range(len(candidates)))
    report = None
    if time_one or sum(meets) > 1:
        report = time_models(
            [original, *(candidates[i].path for i in timed)],
            timing,
            baseline=0,
            labels=["original", *(candidates[i].name for i in timed)],
            clock=clock,
            session_factory=session_factory,
        )
    results = []
    for index, (candidate, (cosine, note)) in enumerate(zip(candidates, measured, strict=True)):
        latencies = None
        if report is not None and index in timed:
            latencies = report.models[1 + timed.index(index)].latencies
        results.append(CandidateResult(candidate, cosine, meets[index], note, latencies))
    winner, reason = _pick(results, min_gain)
    warnings = []
    if not any(meets):
        warnings.append(f"no candidate meets the accuracy target ({target}): the most accurate is kept")
    for latency in results[winner].latencies or ():
        if latency.measurably_slower:  # the table shows every ratio
            warnings.append(
                f"{results[winner].candidate.name} is slower than the original at length"
                f" {latency.length}: {latency.ratio:.2f}x its latency"
            )
    original_timing = None if report is None else report.models[0]
    return KernelChoice(tuple(results), winner, reason, target, original_timing, report, tuple(warnings))


def _pick(results: Sequence[CandidateResult], min_gain: float) -> tuple[int, str]:
    """The winner's index and why."""
    eligible = [i for i, r in enumerate(results) if r.meets_target]
    if not eligible:
        best = max(range(len(results)), key=lambda i: results[i].cosine)
        name = results[best].candidate.name
        return best, f"no candidate meets the accuracy target; {name} is the most accurate"
    best = eligible[0]
    for index in eligible[1:]:
        mine, theirs = results[index].speed, results[best].speed
        if mine is not None and theirs is not None and mine < theirs * (1 - min_gain):
            best = index
    speed = results[best].speed
    others = [
        f"{r.candidate.name} {r.speed:.3f}"
        for i, r in enumerate(results)
        if i != best and r.meets_target and r.speed is not None
    ]
    missed = [f"{r.candidate.name} (cosine {r.cosine:.5f})" for r in results if not r.meets_target]
    parts = [f"{results[best].candidate.name} meets the accuracy target"]
    if speed is not None:
        parts.append(f"and runs at {speed:.3f}x the original's latency (geometric mean over the lengths)")
    if others:
        parts.append(f"against {', '.join(others)}")
        if best == eligible[0]:
            parts.append(f"(a later candidate must be {min_gain:.0%} faster to win)")
    if missed:
        parts.append(f"; below the target: {', '.join(missed)}")
    return best, " ".join(parts).replace(" ;", ";")
