"""One quantize run's plan: what the caller gave, resolved once into the settings every step reads.

:class:`Request` holds what :func:`onnx_conv2matmul.api.quantize_file` was given, as given (None
for what was left to the default); :func:`resolve` turns it into a :class:`QuantizePlan`, deciding
once the defaults (the rewrite's options, the accuracy floor), how ``auto``, ``metric`` and
``verify``'s criterion combine, and the report's ``accuracy`` object; it refuses, before any work,
what this run cannot apply. The workflow passes the plan down instead of a dozen arguments.

The plan is frozen; what a pass finds on the way lives in a :class:`Run`, and :class:`PhaseTimer`
splits the run's seconds by phase (the report's ``seconds_by_phase``).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files.load import check_paths
from onnx_conv2matmul.files.progress import NullProgress, Progress
from onnx_conv2matmul.quantize.options import search_below_by_default
from onnx_conv2matmul.quantize.search_options import AutoOptions
from onnx_conv2matmul.quantize.settings import QuantizeOptions
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.verify.check import VerifyOptions, discover_inputs

if TYPE_CHECKING:
    from onnx_conv2matmul.files import output as _output
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.quantize.reference import Reference
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.transposes import TransposeOptions
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.verify.check import OutputComparison


# --------------------------------------------------------------------------- #
# Where the time of a quantize run goes: each progress step belongs to one phase (load, rewrite,
# kernel choice, quantize, search, save, check, timing, publish), and :class:`PhaseTimer` adds up the
# seconds of each as the steps are announced. The report's ``seconds_by_phase`` comes from it, and
# the command line's progress bar shows the phase in front of the step (:func:`phase_of`).
# --------------------------------------------------------------------------- #

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("load", ("Loading", "Checking the input")),
    ("rewrite", ("Rewriting",)),
    (
        "kernel choice",
        (
            "Kernel choice",
            "Quantizing with block",
            "Measuring the candidates' accuracy",
            "Slower than the original",
        ),
    ),
    ("measure", ("Measuring the original",)),
    (
        "search",
        (
            "Below the accuracy criterion",
            "Searching",
            "Saving the fp32 model for the search",
            "Measuring activations",
            "Measuring each weight",
            "Evaluating configuration",
            "Synthesising inputs",
            "Scoring the fp32 model",
        ),
    ),
    ("decide", ("Deciding",)),
    ("quantize", ("Quantizing",)),
    ("save", ("Saving",)),
    (
        "check",
        (
            "Checking the output",
            "Checking the candidate",
            "Checking the held-out",
            "Measuring accuracy",
            "Verifying",
            "Scoring",
        ),
    ),
    ("timing", ("Timing",)),
    ("publish", ("Publishing",)),
)
"""Each phase and the beginnings of its steps' names (the first phase that matches wins)."""


def phase_of(step: str) -> str:
    """The phase a progress step belongs to (``other`` when none is named for it)."""
    for phase, starts in PHASES:
        if step.startswith(starts):
            return phase
    return "other"


class PhaseTimer:
    """A :class:`Progress` that passes every step on to ``inner`` as it is, and adds up each
    phase's seconds (``clock``: seconds, monotonic)."""

    def __init__(self, inner: Progress | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner: Progress = inner or NullProgress()
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._since = clock()

    def phase(self, name: str) -> None:
        self._stop()
        self._current = phase_of(name)
        self.inner.phase(name)

    def advance(self, done: int, total: int) -> None:
        self.inner.advance(done, total)

    def close(self) -> None:
        self._stop()
        self._current = None
        self.inner.close()

    def _stop(self) -> None:
        now = self.clock()
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + now - self._since
        self._since = now

    def by_phase(self) -> dict[str, float]:
        """Seconds per phase so far, in the order of :data:`PHASES` (``other`` last)."""
        self._stop()
        order = [phase for phase, _ in PHASES] + ["other"]
        return {phase: round(self.seconds[phase], 3) for phase in order if phase in self.seconds}


DEFAULT_MIN_COSINE = 0.99
"""The accuracy floor of ``quantize`` when no criterion is given: the worst sample's cosine
similarity to the fp32 model, on every float output of every feed."""

SYNTHESISED_CAVEAT = (
    "accuracy measured on synthesised inputs, which can overstate it (a trained model can"
    " score well on random inputs and badly on real ones): real inputs of the model give the true figure"
)


@dataclasses.dataclass
class Memos:
    """What one quantize's attempts (layouts, ``--auto``'s two runs, a step back) learn once and share."""

    losses: dict[Any, float] = dataclasses.field(default_factory=dict)
    """Each weight's loss alone on the inputs (see :func:`onnx_conv2matmul.quantize.search.search`)."""
    missed: dict[Any, float] = dataclasses.field(default_factory=dict)
    """The Transposes' trade's layouts whose models missed a cosine criterion, each with the loosest
    it missed: a step back only asks a stricter one (:func:`~.transposes.decide`)."""
    found: dict[Any, VerifyOptions] = dataclasses.field(default_factory=dict)
    """The check's input sizes and values, by the options they were looked for with (:func:`_discovered`)."""
    failed: dict[Any, tuple[float, Any]] = dataclasses.field(default_factory=dict)
    """The uniform candidates' checks that missed, each with its cosine (:func:`~.onepass._failed_before`)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What the caller of a quantize run gave (see :func:`onnx_conv2matmul.api.quantize_file`);
    None leaves the choice to :func:`resolve`."""

    quantize: QuantizeOptions | None = None
    int8: bool = False
    auto: AutoOptions | None = None
    convert: ConvertOptions | None = None
    verify: VerifyOptions | None = None
    run_checker: bool = True
    progress: Progress | None = None
    speed: SpeedOptions | None = None
    metric: MetricTarget | None = None
    search_below: bool | None = None
    transposes: TransposeOptions | None = None
    smallest: bool = False
    """The smallest model is wanted (``--prefer size``), see :func:`wants_smallest`."""
    candidate: bool = False
    """This run makes one candidate of another (``--auto`` weighed against the default run, or a
    layout of the Transposes' trade): the default run stops after the one pass, without the
    search below it, and ``auto`` is not weighed again."""
    shared: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The original's measurement shared by the runs of one Transposes' trade (a
    :class:`onnx_conv2matmul.quantize.onepass.Shared`): measured by the first, read by the second."""
    nested: bool = False
    """This run makes one model of another run's (a layout of the Transposes' trade): only the
    outermost run steps back after a held-out miss."""
    one_pass_missed: bool = False
    """The one pass of this very run already missed the criterion (a layout of the Transposes'
    trade made as a candidate first): the search below it runs straight away."""
    memos: Memos | None = dataclasses.field(default=None, compare=False, repr=False)
    """What the attempts of one quantize learn and share (see :class:`Memos`): made by the
    outermost run."""
    larger_than: int | None = None
    """A candidate's model of more bytes than this is neither checked, timed nor written: the
    default run's model that ``--auto``'s search must beat (see
    :func:`onnx_conv2matmul.quantize.workflow.quantize_file`); None: no bound."""
    step_back: float | None = None
    """After a held-out miss: the minimum cosine every choice of the run must meet on the samples
    it is made on, above the criterion's (the held-out samples are still judged by the criterion);
    None: the criterion's own (see :func:`onnx_conv2matmul.quantize.workflow.quantize_file`)."""

    def with_memos(self) -> Request:
        """This request with the memos every attempt of one quantize shares: the outermost run's
        (made empty where there are none yet)."""
        return self if self.memos is not None else dataclasses.replace(self, memos=Memos())

    def again(
        self,
        convert: ConvertOptions,
        *,
        speed: SpeedOptions | None = None,
        shared: Any = None,
        search: bool | None = None,
    ) -> Request:
        """The same request for another rewrite (the Transposes' trade makes the model both ways),
        without progress or a trade of its own; timed only with ``speed``; ``shared``: the
        original's measurement, made once for both. ``search``: None searches below the
        criterion as this request does; False makes a candidate (the one pass, no search);
        True searches straight away (the candidate's one pass missed)."""
        return dataclasses.replace(
            self,
            convert=convert,
            speed=speed,
            progress=None,
            transposes=None,
            smallest=wants_smallest(self),
            shared=shared,
            nested=True,
            candidate=self.candidate or search is False,
            one_pass_missed=bool(search) and not self.candidate,  # a candidate never searches
        )


def wants_smallest(request: Request) -> bool:
    """Whether the request asks for the smallest model (``--prefer size``): the Transposes' trade
    keeps the smaller, and the search below the criterion is offered every precision, those that
    float beats on this CPU too (by default it is not: a model slower than float is no answer)."""
    prefer = request.transposes.prefer if request.transposes is not None else None
    return request.smallest or prefer == "size"


@dataclasses.dataclass(frozen=True)
class QuantizePlan:
    """A quantize run's resolved settings: every step reads them from here.

    Attributes:
        src: The input model's path.
        dst: The output's path (checked: not the input, its folder exists).
        request: What was given, for the runs made again with another rewrite.
        convert: The rewrite's options.
        quantize: The MatMulNBits settings asked for (the search or the kernel choice may
            replace them during the run).
        int8: onnxruntime's int8 dynamic quantization instead of MatMulNBits.
        verify: The accuracy check's inputs (looked for once) and criterion.
        auto: What the search looks for; None: no search.
        speed: What is timed and tried; None: nothing is timed.
        metric: The user's score and its largest drop; None: the cosine alone.
        search_below: Whether a result below the criterion makes the search run.
        transposes: The trade of the Transposes a rewrite adds; None: decided by ``convert``.
        run_checker: Whether the ONNX checker runs on the input and the output.
        progress: Where each step is announced (and timed by phase).
        criterion: The report's ``accuracy`` object before any measurement.
        held_out: The check of the result on the samples of the user's inputs that every choice
            of the run was made without (``verify`` holds the others); None: not split.
    """

    src: str
    dst: str
    request: Request
    convert: ConvertOptions
    quantize: QuantizeOptions
    int8: bool
    verify: VerifyOptions
    auto: AutoOptions | None
    speed: SpeedOptions | None
    metric: MetricTarget | None
    search_below: bool
    transposes: TransposeOptions | None
    run_checker: bool
    progress: PhaseTimer
    criterion: Mapping[str, Any]
    held_out: VerifyOptions | None = None

    @property
    def timed_by_trade(self) -> bool:
        """Whether this run makes one layout of the Transposes' trade
        (:mod:`~onnx_conv2matmul.quantize.transposes`) and so times nothing of its own once the
        kernel costs chose its settings: no latency line and no speed step over accuracy levels.
        The trade times both layouts against the original, interleaved, its margin decides, and
        that timing becomes the kept layout's latency line."""
        return self.request.shared is not None

    @property
    def chooses(self) -> bool:
        """Whether the run chooses its settings against the criterion (``auto``, the one pass and
        the search below it, or ``--int8-dynamic``'s candidates): only then can a stricter aim give
        another model (the held-out step back, :func:`~.run_report.step_back_cosine`)."""
        return self.auto is not None or self.int8 or self.search_below


def _discovered(src: str, verify: VerifyOptions, memo: dict[Any, VerifyOptions] | None) -> VerifyOptions:
    """:func:`~onnx_conv2matmul.verify.check.discover_inputs`, looked for once per quantize: the
    runs it makes (a layout of the Transposes' trade, ``--auto``'s default run and search, a step
    back) read what the first found for the same options from ``memo`` instead of probing the
    model again (PP-OCRv4 rec under ``--auto --inputs``: five plans, 75 probe runs, 1.1 s)."""
    if memo is None or verify.feeds is not None or verify.found is not None:
        return discover_inputs(src, verify)  # returned as it is, or no memo
    key = (src, repr(verify))
    if key not in memo:
        memo[key] = discover_inputs(src, verify)
    return memo[key]


def resolve(
    input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], request: Request
) -> QuantizePlan:
    """The plan of a run of ``request`` from ``input_path`` to ``output_path``.

    The output must meet a criterion: ``verify.min_cosine``, and ``metric`` (the score may drop by
    at most its ``max_drop``); with neither, the floor :data:`DEFAULT_MIN_COSINE`
    (``verify.report_only`` asks for no cosine criterion). ``auto`` takes the metric and the cosine
    given, or the floor when neither is. ``search_below`` defaults as
    :func:`~onnx_conv2matmul.quantize.options.search_below_by_default` says (no quantize options,
    no ``auto``, not int8).

    Raises:
        InputError: ``auto`` with int8, bad paths, or an algorithm that cannot run here.
    """
    auto, metric, verify = request.auto, request.metric, request.verify or VerifyOptions()
    below = search_below_by_default(
        settings_given=request.quantize is not None, auto=auto is not None, int8_dynamic=request.int8
    )
    if auto is not None:
        if request.int8:
            raise InputError("the search chooses MatMulNBits settings, not int8 dynamic quantization")
        if metric is not None and auto.metric is None:
            auto = dataclasses.replace(auto, metric=metric)
        metric = auto.metric
        if auto.min_cosine is None and verify.min_cosine is not None:
            auto = dataclasses.replace(auto, min_cosine=verify.min_cosine)
    given_cosine = verify.min_cosine is not None or (auto is not None and auto.min_cosine is not None)
    if auto is not None and auto.min_cosine is None and metric is None:
        auto = dataclasses.replace(auto, min_cosine=DEFAULT_MIN_COSINE)
    if auto is not None:
        if auto.min_cosine is not None:
            verify = dataclasses.replace(verify, min_cosine=auto.min_cosine, report_only=False)
        else:
            verify = dataclasses.replace(verify, report_only=True)
    elif verify.min_cosine is None and not verify.report_only:
        if metric is None:
            verify = dataclasses.replace(verify, min_cosine=DEFAULT_MIN_COSINE)
        else:
            verify = dataclasses.replace(verify, report_only=True)
    criterion = _criterion(verify, metric, given=given_cosine)
    progress = PhaseTimer(request.progress or NullProgress())
    src = os.fspath(input_path)
    dst = check_paths(src, os.fspath(output_path), inplace=False)
    quantize = request.quantize or QuantizeOptions()
    if not request.int8:
        from onnx_conv2matmul.quantize.weight_only import check_available

        check_available(quantize.algorithm, has_calibration=bool(verify.feeds))
    if verify.feeds is None and verify.min_cosine is not None:
        from onnx_conv2matmul.verify.discover import read_graph
        from onnx_conv2matmul.verify.labels import output_tasks, refuse_synthesised

        refuse_synthesised(output_tasks(read_graph(src), verify.labels), verify)
    # Once: the check, the search and the latency step all feed these sizes and values.
    memo = None if request.memos is None else request.memos.found
    verify = _discovered(src, verify, memo)
    held_out = None
    if verify.feeds is not None:
        # The latency step still synthesises its inputs: at the sizes the model takes.
        found = _discovered(src, dataclasses.replace(verify, feeds=None), memo)
        verify = dataclasses.replace(verify, axes=found.axes)
        verify, held_out = _hold_out(src, verify, criterion)
        if request.step_back is not None and held_out is not None:
            # A step back: the choices aim above the criterion on the samples they see, so that
            # the result meets it on those they do not.
            verify = dataclasses.replace(verify, min_cosine=request.step_back)
            if auto is not None and auto.min_cosine is not None:
                auto = dataclasses.replace(auto, min_cosine=request.step_back)
            criterion["held_out"]["chosen_with_min_cosine"] = request.step_back
    return QuantizePlan(
        src=src,
        dst=dst,
        request=request,
        convert=request.convert or ConvertOptions(extended=True, allow_non_unit_dilation=True),
        quantize=quantize,
        int8=request.int8,
        verify=verify,
        auto=auto,
        speed=request.speed,
        metric=metric,
        search_below=below if request.search_below is None else request.search_below,
        transposes=request.transposes,
        run_checker=request.run_checker,
        progress=progress,
        criterion=criterion,
        held_out=held_out,
    )


def _hold_out(
    src: str, verify: VerifyOptions, criterion: dict[str, Any]
) -> tuple[VerifyOptions, VerifyOptions | None]:
    """With a minimum cosine on the user's inputs: the options the run chooses on (70% of the
    samples) and those that confirm the result (the other 30%, see
    :func:`onnx_conv2matmul.verify.given.split_feeds`), recorded in ``criterion['held_out']``;
    too few samples to split: all of them, and a note that says so."""
    if verify.feeds is None or verify.min_cosine is None or verify.report_only:
        return verify, None
    from onnx_conv2matmul.verify.discover import graph_specs, read_graph
    from onnx_conv2matmul.verify.given import MIN_SPLIT, split_feeds

    model = read_graph(src)
    split = split_feeds(verify.feeds, graph_specs(model) if model is not None else None)
    entry = {
        **split.to_dict(),
        "passed": None,
        "worst_cosine": None,
        "labels": [],
        "note": None,
        "chosen_with_min_cosine": None,
        "steps": [],
    }
    criterion["held_out"] = entry
    if not split.held:
        entry["note"] = (
            f"{split.chosen_samples} samples are too few to hold some out ({MIN_SPLIT} needed): the"
            " result is checked on the inputs it was chosen on"
        )
        return verify, None
    held = dataclasses.replace(verify, feeds=tuple(split.held))
    return dataclasses.replace(verify, feeds=tuple(split.chosen_on)), held


def _criterion(verify: VerifyOptions, metric: MetricTarget | None, *, given: bool) -> dict[str, Any]:
    """The report's ``accuracy`` object before any measurement: what the output must meet."""
    if verify.report_only:
        cosine_kind = None
    elif verify.min_cosine is None:
        cosine_kind = "exact"
    else:
        cosine_kind = "given" if given else "default floor"
    return {
        "min_cosine": None if verify.report_only else verify.min_cosine,
        "min_cosine_source": cosine_kind,
        "per_sample": True,
        "inputs": "synthesised" if verify.feeds is None else "files",
        "caveat": SYNTHESISED_CAVEAT if verify.feeds is None else None,
        "metric": None if metric is None else {**metric.to_dict(), "original_score": None, "score": None},
        "fallback": None,
    }


# --------------------------------------------------------------------------- #
# One pass of a plan into an output: the state the workflow's steps share. The plan is frozen;
# what a pass finds on the way (the kernel choice, the search's settings, the original's score)
# lives in a Run.
# --------------------------------------------------------------------------- #


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
    checked: tuple[Reference, list[OutputComparison]] | None = None
    """The reference and the rows of the staged result's check when it was made (``--int8-dynamic``):
    the final check reports them instead of running it again."""

    def __post_init__(self) -> None:
        self.quantize = self.plan.quantize
        self.auto = self.plan.auto
