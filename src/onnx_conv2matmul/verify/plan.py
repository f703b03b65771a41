"""The runs of a check: the value of every dim in each run, within a memory budget.

A check holds, at once, the reference outputs of every run (the candidate runs after the
original, so that only one model is loaded at a time) and the inputs and outputs of the
run in progress: at most ``sum(inputs + outputs) + max(outputs)`` over the runs. The
budget (``VerifyOptions.memory``) bounds that sum, so it does not grow with the number of
dims, lengths or outputs.

Each run's bytes are estimated before it runs (:mod:`~onnx_conv2matmul.verify.sizes`: the
inputs from their shapes, the outputs from their declared shapes or measured growth).

Default lengths are fitted to the budget: the runs are taken from the smallest to the
largest, each gets an equal share of what is left (one share kept for the candidate's
outputs), and a run that does not fit its share is shortened, first in its other
sequence dims (a joint's ``tokens`` before its ``time``), then in its main one. Lengths
given and real inputs are used as they are: a check they make too large is refused.
"""

# pragma: no mutate start
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.errors import Hint, InputError
from onnx_conv2matmul.verify.options import (
    DEFAULT_LENGTHS,
    IMAGE_LENGTHS,
    IMAGE_SPARE_LENGTHS,
    LONG_LENGTH,
    SPARE_LENGTHS,
    VerifyOptions,
    format_size,
)
from onnx_conv2matmul.verify.roles import InputSpec, Role, Roles
from onnx_conv2matmul.verify.sizes import OutputSizes, input_bytes

MIN_FIT_LENGTH = 8
"""A default run is not shortened below this length (32 for images): it is left out."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of both models.

    Attributes:
        length: The row's length: the main sequence dim's value; the feed's number (from
            1) for real inputs; 0 when no dim takes a length.
        dims: The value of every symbolic dim of the inputs.
        inputs: The inputs' bytes.
        outputs: The outputs' bytes of one model (estimated before the run).
        share: The part of the budget it was fitted to (0 when not fitted).
        long: The long run of a speech encoder.
    """

    length: int
    dims: Mapping[str, int]
    inputs: int
    outputs: int
    share: int = 0
    long: bool = False
    rows: tuple[int, int] | None = None
    """Real inputs fed in chunks: the rows (samples) ``start, stop`` of the feed."""
    cut: frozenset[tuple[str, int]] = frozenset()
    """The inputs cut into ``rows``, each with its axis (see :mod:`onnx_conv2matmul.verify.stream`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "dims": dict(self.dims),
            "input_bytes": self.inputs,
            "output_bytes": self.outputs,
            "rows": None if self.rows is None else list(self.rows),
        }


def held(runs: Sequence[Run]) -> int:
    """What a check of these runs holds at most: every run's inputs and reference outputs,
    and the candidate's outputs of one run."""
    return sum(r.inputs + r.outputs for r in runs) + max((r.outputs for r in runs), default=0)


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class LengthPlan:
    """The runs of a check.

    Attributes:
        runs: The runs, in the order they are made.
        spares: Tried in order, one for each default run the original model cannot run
            at (fitted to that run's share); empty when the options give the lengths.
        rule: How the lengths were chosen, for the report.
        roles: The dims and what each takes.
        budget: The memory budget, bytes.
        left_out: Default lengths that do not fit the budget even shortened, with why.
    """

    runs: tuple[Run, ...]
    spares: tuple[int, ...]
    rule: str
    roles: Roles
    budget: int
    left_out: tuple[tuple[int, str], ...] = ()
    step: int = 1
    spill: bool = False
    """The reference outputs of every run do not fit the budget together: they go to disk."""

    @property
    def wanted(self) -> tuple[int, ...]:
        return tuple(r.length for r in self.runs)


class Planner:
    """Makes runs for a model: its inputs, dims and output sizes, and the options."""

    def __init__(
        self, specs: Sequence[InputSpec], roles: Roles, sizes: OutputSizes, options: VerifyOptions
    ) -> None:
        self.specs, self.roles, self.sizes, self.options = specs, roles, sizes, options
        self.step = 1

    def run(self, length: int, values: Mapping[str, int], *, share: int = 0, long: bool = False) -> Run:
        primary = self.roles.primary
        label = values[primary] if primary is not None and primary in values else length
        return Run(
            label,
            dict(values),
            input_bytes(self.specs, self.roles, values),
            self.sizes.bytes(values),
            share,
            long,
        )

    def uniform(self, length: int, *, batch: int | None = None) -> dict[str, int]:
        return self.roles.values(length, self.options, batch=batch)

    def fit(self, length: int, share: int, *, long: bool = False) -> Run | None:
        """The run at ``length`` (batch 1 when ``long``), shortened to fit ``share``; None
        when it does not fit even at the shortest length."""
        values = self.uniform(length, batch=1 if long else None)
        first = self.run(length, values, share=share, long=long)
        if first.inputs + first.outputs <= share or self.roles.primary is None:
            return first if first.inputs + first.outputs <= share else None
        primary = self.roles.primary
        others = [k for k in self.roles.sequence if k != primary]

        def with_values(main: int, rest: int) -> Run:
            moved = dict(values)
            moved[primary] = main
            moved.update((k, rest) for k in others)
            return self.run(length, moved, share=share, long=long)

        def fits(run: Run) -> bool:
            return run.inputs + run.outputs <= share

        if others:
            rest = self._largest(length, self.step, lambda n: fits(with_values(length, n)))
            if rest is not None:
                return with_values(length, rest)
        lowest = max(MIN_FIT_LENGTH, self.step) if self.step > 1 else MIN_FIT_LENGTH
        main = self._largest(length, min(lowest, length), lambda n: fits(with_values(n, self.step)))
        return None if main is None else with_values(main, min(self.step, main))

    def _largest(self, top: int, bottom: int, fits: Callable[[int], bool]) -> int | None:
        """The largest multiple of the step in [bottom, top] that fits (fitting is monotone)."""
        low, high = -(-bottom // self.step), top // self.step
        if high < low or not fits(low * self.step):
            return None
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle * self.step):
                low = middle
            else:
                high = middle - 1
        return low * self.step


def plan_lengths(
    specs: Sequence[InputSpec], options: VerifyOptions, roles: Roles, sizes: OutputSizes
) -> LengthPlan:
    """The runs of a check (see the module's documentation).

    Default lengths are :data:`DEFAULT_LENGTHS`, or :data:`IMAGE_LENGTHS` (multiples of 32)
    when an input of rank 4 or more has two or more sequence dims, with spares; a speech
    encoder (see :class:`onnx_conv2matmul.verify.roles.Roles`) also gets a run of
    :data:`LONG_LENGTH` at batch 1.

    Raises:
        InputError: lengths given or real inputs whose check does not fit the budget, or a
            model whose shortest default run does not fit it (with the hint to raise it).
    """
    planner = Planner(specs, roles, sizes, options)
    budget = options.memory
    if options.feeds is not None:
        runs = [run for i, feed in enumerate(options.feeds) for run in _feed_runs(planner, i + 1, feed)]
        rule = "real inputs: one run per file, each row's length is the file's number from 1"
        if len(runs) > len(options.feeds):
            rule += f"; their samples fed in {len(runs)} chunks within the memory budget"
        spill = held(runs) > budget
        if spill:
            rule += "; the reference outputs kept on disk"
        return LengthPlan(tuple(runs), (), rule, roles, budget, spill=spill)
    if not roles.sequence:
        run = planner.run(0, planner.uniform(0))
        _refuse_above([run], budget, "the check")
        rule = "no symbolic dim takes a length: one run"
        return LengthPlan((run,), (), rule, roles, budget)
    if options.lengths is not None:
        runs = [planner.run(n, planner.uniform(n)) for n in options.lengths]
        _refuse_above(runs, budget, "the lengths given")
        return LengthPlan(tuple(runs), (), "given", roles, budget)
    image = image_input(specs, roles)
    wanted: tuple[int, ...]
    spares: tuple[int, ...]
    if image is not None:
        planner.step = 32
        rule = f"default for image inputs: multiples of 32, as {image!r} has a symbolic height and width"
        wanted, spares = IMAGE_LENGTHS, IMAGE_SPARE_LENGTHS
    else:
        rule, wanted, spares = "default", DEFAULT_LENGTHS, SPARE_LENGTHS
    targets = [(n, False) for n in wanted]
    if roles.speech and image is None:
        targets.append((LONG_LENGTH, True))
        rule += f"; a long run of {LONG_LENGTH} (speech encoder, batch 1)"
    runs, left_out = _fit_all(planner, targets, budget)
    if not runs:
        smallest = planner.run(wanted[0], planner.uniform(MIN_FIT_LENGTH))
        raise InputError(
            f"the check does not fit in the memory budget of {format_size(budget)}: a run at the"
            f" shortest length ({_dims_text(smallest.dims)}) needs about"
            f" {format_size(held([smallest]))}",
            hint=Hint.VERIFY_BUDGET,
        )
    if any(run.dims != planner.uniform(run.length, batch=1 if run.long else None) for run in runs):
        rule += "; shortened to fit the memory budget"
    return LengthPlan(tuple(runs), spares, rule, roles, budget, tuple(left_out), planner.step)


def _fit_all(
    planner: Planner, targets: Sequence[tuple[int, bool]], budget: int
) -> tuple[list[Run], list[tuple[int, str]]]:
    """The runs fitted from the smallest to the largest, each to an equal share of what is left."""
    full = [planner.run(n, planner.uniform(n, batch=1 if long else None), long=long) for n, long in targets]
    order = sorted(range(len(targets)), key=lambda i: full[i].inputs + full[i].outputs)
    remaining = budget
    fitted: dict[int, Run] = {}
    left_out: list[tuple[int, str]] = []
    for position, index in enumerate(order):
        share = remaining // (len(order) - position + 1)
        length, long = targets[index]
        run = planner.fit(length, share, long=long)
        if run is None:
            need = full[index].inputs + full[index].outputs
            left_out.append(
                (length, f"needs about {format_size(need)}, above its share of the memory budget")
            )
            continue
        remaining -= run.inputs + run.outputs
        fitted[index] = run
    runs: list[Run] = []
    for index in sorted(fitted):
        if all(fitted[index].dims != r.dims for r in runs):
            runs.append(fitted[index])
    return runs, left_out


def feed_dims(feed: Mapping[str, np.ndarray], roles: Roles, specs: Sequence[InputSpec]) -> dict[str, int]:
    """The dim values of one set of real inputs, read from its arrays."""
    values: dict[str, int] = {}
    for spec in specs:
        for axis, size in zip(roles.axes[spec.name], np.shape(feed[spec.name]), strict=False):
            if isinstance(axis, str):
                values[axis] = max(values.get(axis, 0), int(size))
    return values


def _feed_runs(planner: Planner, number: int, feed: Mapping[str, np.ndarray]) -> list[Run]:
    """The runs of one set of real inputs, its length the feed's number: one, or one per
    chunk of its samples (see :mod:`onnx_conv2matmul.verify.stream`).

    Raises:
        InputError: one sample of it does not fit the memory budget.
    """
    from onnx_conv2matmul.verify.options import feed_source
    from onnx_conv2matmul.verify.stream import chunk_rows, cut_inputs, one_at_a_time, spec_rows

    values = feed_dims(feed, planner.roles, planner.specs)
    nbytes = {s.name: int(feed[s.name].nbytes) for s in planner.specs}
    inputs = sum(nbytes.values())
    outputs = planner.sizes.bytes(values) + math.ceil(planner.sizes.per_input_byte * inputs)
    cut = cut_inputs(planner.specs, feed)
    rows = spec_rows(planner.specs, feed)
    budget = planner.options.memory
    where = f"inputs {feed_source(feed, number - 1)}"
    if not cut:
        if inputs + 2 * outputs > budget:
            _refuse_sample(where, inputs + 2 * outputs, budget, "its inputs and both models' outputs")
        return [Run(number, values, inputs, outputs)]
    single = one_at_a_time(planner.specs, cut)
    one = {k: 1 if k in planner.roles.keys(Role.BATCH) else v for k, v in values.items()}
    fixed = sum(n for name, n in nbytes.items() if name not in cut)
    per_row_in = sum(n for name, n in nbytes.items() if name in cut) / rows
    per_row_out = planner.sizes.bytes(one) + planner.sizes.per_input_byte * per_row_in
    per_row = math.ceil(per_row_in + per_row_out)
    size = chunk_rows(rows, per_row, fixed, budget, single=single)
    if size is None:
        _refuse_sample(where, fixed + 2 * per_row, budget, "one sample's inputs and both models' outputs")
        raise AssertionError  # pragma: no cover - refused above
    runs = []
    for start in range(0, rows, size):
        stop = min(rows, start + size)
        batch = planner.roles.keys(Role.BATCH)
        chunk_values = {k: stop - start if k in batch else v for k, v in values.items()}
        runs.append(
            Run(
                number,
                chunk_values,
                fixed + math.ceil(per_row_in * (stop - start)),
                math.ceil(per_row_out * (stop - start)),
                rows=(start, stop),
                cut=frozenset(cut.items()),
            )
        )
    return runs


def _refuse_sample(where: str, need: int, budget: int, what: str) -> None:
    raise InputError(
        f"{where}: {what} need about {format_size(need)}, above the memory budget of"
        f" {format_size(budget)}; the samples of a file are fed in chunks, but one does not fit",
        hint=Hint.VERIFY_BUDGET,
    )


def _refuse_above(runs: Sequence[Run], budget: int, what: str) -> None:
    need = held(runs)
    if need > budget:
        worst = max(runs, key=lambda r: r.inputs + r.outputs)
        raise InputError(
            f"{what} need about {format_size(need)} of inputs and outputs at once, above the memory"
            f" budget of {format_size(budget)} (the largest run, {_dims_text(worst.dims)}:"
            f" {format_size(worst.inputs + worst.outputs)})",
            hint=Hint.VERIFY_BUDGET,
        )


def _dims_text(dims: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in dims.items()) or "no symbolic dims"


def image_input(specs: Sequence[InputSpec], roles: Roles) -> str | None:
    """The first input of rank >= 4 with two or more sequence dims, if any."""
    sequence = set(roles.keys(Role.SEQUENCE))
    for spec in specs:
        axes = roles.axes[spec.name]
        if len(axes) >= 4 and sum(1 for a in axes if isinstance(a, str) and a in sequence) >= 2:
            return spec.name
    return None


def probe_values(
    roles: Roles, options: VerifyOptions, length: int
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """The dim values of the runs that measure the outputs: a base run (batch 1, every
    sequence dim at ``length``) and, per dim that varies, the base with that dim doubled."""
    base = roles.values(length, options, batch=1)
    varied = {}
    for dim in roles.dims:
        if dim.role is not Role.FIXED:
            moved = dict(base)
            moved[dim.key] = base[dim.key] * 2
            varied[dim.key] = moved
    return base, varied


# pragma: no mutate end
