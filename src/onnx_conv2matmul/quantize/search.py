"""Find the smallest quantized model that meets an accuracy target.

The target is a minimum cosine similarity to fp32 for every sample (a batch row of a feed)
of every float output, or the user's own score (:mod:`onnx_conv2matmul.quantize.metric`)
with the largest drop allowed, or both. The search, on a rewritten fp32 model and a list of
input feeds:

1. **Reference and activations.** The fp32 model runs once per feed with the input A of
   every quantizable MatMul added as an output: its outputs are the reference (kept on
   disk, see :mod:`onnx_conv2matmul.quantize.reference`), and each MatMul gets ``h_k``, the
   mean square of its input's channel ``k``, summed as the feeds arrive.
2. **Sensitivity.** Every quantizable MatMul weight ``W [K, N]`` is quantized with every
   setting of the ladder by onnxruntime's own block quantizer (the one MatMulNBits
   quantization uses) and dequantized in numpy; its error is the output error energy
   that the activations would see, relative to the output's:
   ``sum_k h_k |W_k - Q(W)_k|^2 / sum_k h_k |W_k|^2``. The other weights (see
   :mod:`onnx_conv2matmul.quantize.other_weights`) get their relative int8 error, the largest of
   them standing for all. Both are measured once, whatever the target.
3. **Allocation.** For a trade-off ``l`` (bytes per unit of error) each MatMul takes
   the setting with the least ``bytes + l * error`` (float: its fp32 bytes, error 0), and
   the other weights the cheaper of int8 and float likewise: the smallest model for its
   predicted error, if the errors of the nodes add up. ``l = 0`` gives every node its
   smallest setting; the model grows with ``l``, up to all float. The trade-offs tried
   are those at which some node's choice changes, in order.
4. **Search.** The smallest model (``l = 0``) is evaluated first; then each step takes
   the loss (``1 - cosine`` over ``1 - minimum``, the score's drop over the largest drop
   allowed: 1 is the limit) as a straight line in the total predicted error through the
   last failing and passing evaluations and aims a little inside where it meets the limit
   (after two failures in a row, it bisects). Each step is a full-model evaluation: the
   model is built, saved and run feed by feed, each feed compared with the reference as
   it comes; the first feed below the minimum ends it (the feeds run in order of their
   cosine in earlier evaluations, worst first, so a failing candidate is found out
   early); the score, when asked for, is taken last. At most ``max_evaluations``
   evaluations; the last one is kept for all-float when nothing passed, which proves the
   target unreachable when it fails too. Given a ``ceiling`` (the size of a model that meets
   the target already: ``--auto``'s default run), a configuration predicted bigger is never
   built: the search looks below it alone, and says so when nothing there passes
   (:class:`NothingSmaller`).

Everything is deterministic: the feeds, the order of nodes and trade-offs, and the evaluations
(one onnxruntime session at a time, graph optimizations off), provided the user's function is.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul.errors import ModelRunError, TargetUnreachable
from onnx_conv2matmul.files.paths import model_file_bytes
from onnx_conv2matmul.quantize import ranking
from onnx_conv2matmul.quantize.blockwise import BlockCache
from onnx_conv2matmul.quantize.blockwise import block_dequantize as block_dequantize
from onnx_conv2matmul.quantize.blockwise import block_quantize as block_quantize
from onnx_conv2matmul.quantize.options import FLOAT as FLOAT
from onnx_conv2matmul.quantize.options import AutoOptions
from onnx_conv2matmul.quantize.options import Setting as Setting
from onnx_conv2matmul.quantize.reference import FeedSet, Reference
from onnx_conv2matmul.quantize.search_options import OTHER_INT8
from onnx_conv2matmul.quantize.search_result import AutoConfig as AutoConfig
from onnx_conv2matmul.quantize.search_result import AutoResult as AutoResult
from onnx_conv2matmul.quantize.search_result import Evaluation as Evaluation
from onnx_conv2matmul.quantize.search_result import NodeChoice as NodeChoice
from onnx_conv2matmul.quantize.search_result import apply as apply
from onnx_conv2matmul.quantize.search_runs import ACTIVATION_BYTES as ACTIVATION_BYTES
from onnx_conv2matmul.quantize.search_runs import Prepared as Prepared
from onnx_conv2matmul.quantize.search_runs import (
    _add_outputs,
    _candidate,
    _evaluate,
    _Measured,
    _reference,
    _remove_candidate,
    _score_float,
    _Target,
    _unreachable,
)
from onnx_conv2matmul.quantize.sensitivity import (
    MatMulNode,
    _breakpoints,
    _other_weights_error,
    _quantizable,
    _sensitivities,
    _weight_bytes,
)

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.plan import Run
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.speed_objective import SpeedFilter

# --------------------------------------------------------------------------- #
# The search
# --------------------------------------------------------------------------- #


ProgressCallback = Callable[[str], None]


def prepare(
    model: ir.Model, options: AutoOptions, workdir: str, progress: ProgressCallback | None = None
) -> Prepared:
    """Save ``model`` (rewritten, fp32; not changed) into ``workdir`` for :func:`search`.

    Two models share one data file: the fp32 model, which every candidate is built from, and
    one whose outputs include each quantizable MatMul's input. onnxruntime keeps every graph
    output of a run alive to its end, so only the runs that measure the inputs use the second.
    """
    from onnx_conv2matmul.files import output as _output

    say = progress or (lambda _text: None)
    fp32_path = os.path.join(workdir, "fp32.onnx")
    activations_path = os.path.join(workdir, "fp32-activations.onnx")
    nodes = _quantizable(model, options)
    output_names = [v.name or "" for v in model.graph.outputs]
    say("Saving the fp32 model for the search")
    _output.save(model, fp32_path, "fp32.onnx.data")
    copy = ir.load(fp32_path)  # its tensors read the data file just written, where they lie
    added = _add_outputs(copy, sorted({n.a_name for n in nodes if n.a_name is not None}))
    ir.save(copy, activations_path)  # a new .onnx only: the tensors stay references to that file
    del copy
    return Prepared(fp32_path, activations_path, nodes, output_names, added)


def search(
    model: ir.Model | Prepared,
    feeds: Sequence[Mapping[str, np.ndarray]] | FeedSet,
    options: AutoOptions,
    workdir: str,
    *,
    deterministic: bool = False,
    progress: ProgressCallback | None = None,
    original_score: float | None = None,
    memory: int | None = None,
    speed_filter: SpeedFilter | None = None,
    check: Any = None,
    losses: tuple[Any, dict[Any, float]] | None = None,
    ceiling: int | None = None,
) -> AutoResult:
    """Find the smallest configuration of ``model`` (rewritten, fp32) that meets the options' target.

    ``model`` is not changed; it is saved into ``workdir`` (which the caller removes; or it
    was, by :func:`prepare`), and every evaluated model and the reference outputs are written
    there in turn; the
    result's ``reference`` reads them. With ``options.metric``, ``original_score`` is the
    original model's score (measured on ``model`` when None). ``memory`` is the check's budget
    (``VerifyOptions.memory``): the activations of a feed whose activations would take more
    than half of it are not measured (the smaller feeds' stand for it). ``speed_filter``, before
    any error is measured, extends the ladder with the block sizes the kernel choice costed and
    keeps from each node the settings slower than float on this CPU (see
    :class:`onnx_conv2matmul.quantize.speed_objective.SpeedFilter`): they are never measured nor
    chosen. ``losses``: what identifies ``model`` (its source and rewrite) and the losses alone
    measured for it so far, by this quantize run's earlier searches: a weight's loss at a setting
    on the same feeds is read there, not measured again (and what is measured is kept there).
    With ``speed_filter``, the search also stops once a step shrinks the passing model by less than
    :data:`MIN_STEP`, or the step left could not shrink it by as much (speed, not the last bytes,
    is what it then serves). ``check`` (the accuracy check's ``VerifyOptions``): every
    evaluation also keeps the rows that check would give, and the result's ``checked`` holds the
    passing model's, with its digest, for the check of the same model (see
    :meth:`onnx_conv2matmul.quantize.reference.Reference.check`). ``ceiling``: bytes of a model
    that meets the target already; configurations predicted bigger (their weights, and the rest
    of the fp32 file) are not evaluated.

    Raises:
        TargetUnreachable: the all-float model does not meet the target either.
        ValidationError: the user's function fails or returns no number.
    """
    if options.min_cosine is None and options.metric is None:
        raise ValueError("the search needs a target: a minimum cosine similarity, a metric, or both")
    started = time.perf_counter()
    say = progress or (lambda _text: None)
    feed_set = feeds if isinstance(feeds, FeedSet) else _given(feeds)
    if not feed_set.feeds:
        raise ValueError("the search needs at least one input feed")
    prepared = model if isinstance(model, Prepared) else prepare(model, options, workdir, say)
    fp32_path, nodes, output_names = prepared.path, prepared.nodes, prepared.output_names
    say("Measuring activations")
    reference = Reference(workdir, output_names, feed_set)
    try:
        _reference(prepared, reference, deterministic, memory)
    except ModelRunError:
        if feed_set.replan is None:
            raise
        # A planned run the model cannot run at: plan as the check does (running the model),
        # with spares in place of what fails, and measure again.
        say("Synthesising inputs that the model runs at")
        feed_set = feed_set.replan()
        reference = Reference(workdir, output_names, feed_set)
        _reference(prepared, reference, deterministic, memory)
    blocks = BlockCache(os.path.join(workdir, "quantized"))
    if options.metric is not None and original_score is None:
        say("Scoring the fp32 model")
        original_score = _score_float(fp32_path, workdir, options.metric)
    target = _Target(options, original_score, check)
    say("Measuring each weight's sensitivity")
    sens_started = time.perf_counter()
    model = prepared.load()  # the weights read from the copy, memory-mapped
    ladder, ladders = options.ladder, None
    if speed_filter is not None:
        ladder = speed_filter.ladder(ladder)
        ladders = speed_filter.allowed([node.name for node in nodes], ladder)
    _sensitivities(model, nodes, ladder, reference.activations, ladders)
    others = MatMulNode("(other weights)", None, 0, 0, 0)
    if options.other_weights is None:
        measured_others = _other_weights_error(model)
        if measured_others is not None:
            other_error, kept_bytes, int8_bytes = measured_others
            others.float_bytes = kept_bytes
            others.options[OTHER_INT8] = (other_error, int8_bytes)
    criterion = ranking.criterion(options, feed_set, len(nodes))
    if criterion == "measured":
        say("Measuring each weight's sensitivity on the inputs")
        ranking.measure_alone(
            fp32_path, nodes, others, options, reference, workdir, deterministic, blocks, losses
        )
    elif criterion != "predicted":
        ranking.rank_by(criterion, model, nodes, reference)
    sensitivity_seconds = time.perf_counter() - sens_started
    items = [*nodes, others]
    tradeoffs = [0.0, *_breakpoints(items), math.inf]

    def config_at(index: int) -> AutoConfig:
        """Index 0: every node at its smallest setting; the last: every node in float."""
        tradeoff = tradeoffs[index]
        chosen = {node.name: node.choose(tradeoff)[0] for node in nodes}
        if options.other_weights is not None:
            int8_others = options.other_weights
        else:
            int8_others = others.choose(tradeoff)[0] == OTHER_INT8
        return AutoConfig(chosen, int8_others, options.accuracy_level)

    evaluations: list[Evaluation] = []
    cache: dict[str, tuple[bool, _Measured]] = {}
    seen: dict[int, float] = {}  # each feed's cosine in the last evaluation that ran it

    def evaluate(index: int) -> tuple[bool, _Measured]:
        config = config_at(index)
        key = repr((sorted((n, repr(s)) for n, s in config.nodes.items()), config.other_weights))
        if key in cache:
            return cache[key]
        say(f"Evaluating configuration {len(evaluations) + 1} of at most {options.max_evaluations}")
        t0 = time.perf_counter()
        # Worst first: a feed that failed or came close before is the likeliest to fail now.
        order = sorted(range(len(feed_set.feeds)), key=lambda i: (seen.get(i, math.inf), i))
        measured = _evaluate(fp32_path, config, reference, order, workdir, deterministic, target, blocks)
        seen.update(measured.cosines)
        passed = target.passed(measured)
        evaluations.append(
            Evaluation(
                tradeoffs[index],
                bytes_at(index),
                measured.cosine,
                passed,
                time.perf_counter() - t0,
                measured.note,
                measured.feeds_run,
                measured.score,
                measured.drop,
            )
        )
        cache[key] = (passed, measured)
        return passed, measured

    def bytes_at(index: int) -> int:
        config = config_at(index)
        return _weight_bytes(nodes, config) + (
            others.options[OTHER_INT8][1] if config.other_weights and others.options else others.float_bytes
        )

    def small_step(fail: int, good: int, before: int) -> bool:
        """With speed in the objective: the last step shrank the passing model (from index
        ``before``) by less than :data:`MIN_STEP`, or the smallest model left to try (just above
        the last failure) is within it of the passing one's size: not worth another evaluation."""
        if speed_filter is None:
            return False
        limit = bytes_at(good) * (1 - MIN_STEP)
        return bytes_at(fail + 1) >= limit or bytes_at(before) * (1 - MIN_STEP) <= bytes_at(good)

    def error_at(index: int) -> float:
        """The predicted error of the configuration at ``index`` (non-increasing in it)."""
        tradeoff = tradeoffs[index]
        total = sum(node.choose(tradeoff)[1] for node in nodes)
        return total + (others.choose(tradeoff)[1] if options.other_weights is None else 0.0)

    # Find the smallest index that passes: index 0 first, then steps that aim at the
    # predicted error that the measured losses say meets the limit (see _next_index);
    # the all-float end is assumed to pass and evaluated only when nothing else did.
    fail, good = 0, len(tradeoffs) - 1
    below = False
    if ceiling is not None:  # the first configuration whose file is bigger: not built
        # What the predicted bytes leave out (the tensors not searched, the graph) is about the
        # same in every configuration: the smallest one's file, built and saved (not run), tells
        # it; within CEILING_SLACK (the names and zero points each setting adds) a configuration
        # may still be smaller.
        smallest = _candidate(fp32_path, config_at(0), workdir, blocks)
        rest = model_file_bytes(smallest) - bytes_at(0)
        _remove_candidate(smallest)
        limit = ceiling * (1 + CEILING_SLACK)
        good = next((i for i in range(len(tradeoffs)) if bytes_at(i) + rest > limit), good)
        below = bytes_at(good) + rest > limit
    if below and good == 0:
        raise NothingSmaller(f"every configuration takes more than {ceiling} bytes")
    reached: _Measured | None = None
    passed, measured = evaluate(0)
    fail_loss, moved = target.loss(measured), ""
    if passed:
        good, reached = 0, measured
    else:
        while good - fail > 1 and len(evaluations) < options.max_evaluations - (
            1 if reached is None and not below else 0  # one kept for the all-float end
        ):
            mid = _next_index(
                fail,
                good,
                fail_loss,
                None if reached is None else target.loss(reached),
                error_at,
                bisect=moved == "fail twice",
            )
            passed, measured = evaluate(mid)
            if passed:
                before, good, reached = good, mid, measured
                moved = "good"
                if small_step(fail, good, before):
                    break
            else:
                fail, fail_loss = mid, target.loss(measured)
                moved = "fail twice" if moved.startswith("fail") else "fail"
        if reached is None and below:
            raise NothingSmaller(f"{len(evaluations)} smaller configurations evaluated, none met it")
        if reached is None:
            good = len(tradeoffs) - 1
            passed, measured = evaluate(good)
            if not passed:
                raise TargetUnreachable(_unreachable(target, measured, len(feed_set.feeds)))
            reached = measured
    config = config_at(good)
    choices = []
    for node in nodes:
        setting, error, size = node.choose(tradeoffs[good])
        choices.append(NodeChoice(node.name, node.k, node.n, setting, error, size))
    return AutoResult(
        min_cosine=options.min_cosine,
        config=config,
        reached_cosine=reached.cosine,
        choices=choices,
        other_weights_error=others.options[OTHER_INT8][0] if others.options else None,
        evaluations=evaluations,
        feeds=len(feed_set.feeds),
        sensitivity_seconds=sensitivity_seconds,
        seconds=time.perf_counter() - started,
        metric=options.metric,
        original_score=original_score,
        reached_score=reached.score,
        reference=reference,
        cache=blocks,
        checked=_checked(reached, len(feed_set.feeds)),
    )


def _checked(reached: _Measured, feeds: int) -> tuple[str, list[Any]] | None:
    """The passing model's digest and the check's rows of every feed in order (None: not kept,
    or not every feed ran)."""
    if not reached.digest or len(reached.rows) != feeds:
        return None
    return reached.digest, [row for index in range(feeds) for row in reached.rows[index]]


MIN_STEP = 0.02
"""With a speed filter, the search stops once a passing step shrank the model by less than this
share of its bytes, or no model left to try is smaller than the passing one by as much."""
CEILING_SLACK = 0.02
"""A configuration predicted up to this share bigger than the search's ceiling is still evaluated:
its file may be smaller than predicted (on a one-MatMul model, int8 symmetric was predicted
1.5% bigger than the same setting's file)."""

# The step aims at this fraction of the predicted error the straight line allows, so that
# it rather passes (a usable result) than fails by a hair.
_AIM = 0.8


class NothingSmaller(TargetUnreachable):
    """The search's ``ceiling``: no configuration smaller than it meets the target (the model
    that set it is the smallest found)."""


def _next_index(
    fail: int,
    good: int,
    fail_loss: float,
    good_loss: float | None,
    error_at: Callable[[int], float],
    *,
    bisect: bool,
) -> int:
    """The next configuration to evaluate, strictly between ``fail`` and ``good``.

    The loss (1 is the limit, see :meth:`_Target.loss`) is taken as a straight line in the
    predicted error, through the failing and the passing evaluation (through 0 for the
    all-float end, not measured): the step aims at :data:`_AIM` of the error where that
    line meets the limit, and takes the index whose predicted error is nearest (errors
    fall as the index grows). After two failures in a row it bisects the indices instead,
    so the bracket always shrinks.
    """
    if bisect or not math.isfinite(fail_loss) or (good_loss is not None and not math.isfinite(good_loss)):
        return (fail + good) // 2
    e_fail, e_good = error_at(fail), error_at(good)
    loss_good = 0.0 if good_loss is None else good_loss
    if e_fail <= e_good or fail_loss <= loss_good:
        return (fail + good) // 2
    slope = (fail_loss - loss_good) / (e_fail - e_good)
    target = e_good + _AIM * max(0.0, 1.0 - loss_good) / slope
    lo, hi = fail + 1, good - 1
    while lo < hi:  # the first index whose error is at most the target
        mid = (lo + hi) // 2
        if error_at(mid) > target:
            lo = mid + 1
        else:
            hi = mid
    if lo - 1 > fail and abs(error_at(lo - 1) - target) < abs(error_at(lo) - target):
        return lo - 1
    return lo


def _given(feeds: Sequence[Mapping[str, np.ndarray]]) -> FeedSet:
    """Feeds given as they are: numbered from 1, as the check numbers real inputs."""
    how = {name: "from the input files" for name in (feeds[0] if feeds else {})}
    rule = "real inputs: one run per file, each row's length is the file's number from 1"
    return FeedSet(list(feeds), list(range(1, len(feeds) + 1)), rule, [], how)


def synthesised_feeds(path: str, options: Any) -> list[Mapping[str, np.ndarray]]:
    """The inputs ``verify`` feeds the model at ``path`` with ``options`` (a VerifyOptions).

    One feed per run of the check, exactly as the accuracy check makes them (the same
    dims, lengths and memory budget).

    Raises:
        ModelRunError: the model cannot be loaded or run on them.
        InputError: the check does not fit the memory budget.
        NothingSmaller: with ``ceiling``, no configuration below it meets the target.
    """
    from onnx_conv2matmul.verify.check import planned_feeds

    return planned_feeds(path, options)


def run_search(run: Run, workdir: str, model: ir.Model | Prepared, speed_filter: Any = None) -> None:
    """Run the search for ``run.auto`` on the inputs the accuracy check uses (given or
    synthesised), in ``workdir`` (a scratch directory beside the output, under its guard: see
    :meth:`onnx_conv2matmul.files.output.Output.scratch`); its result goes to ``run.report.auto``."""
    from onnx_conv2matmul.quantize.reference import feed_set

    plan = run.plan
    assert run.auto is not None
    if plan.verify.feeds is None:
        plan.progress.phase("Synthesising inputs")
    feeds = feed_set(plan.src, plan.verify)
    memos = plan.request.memos
    run.report.auto = search(
        model,
        feeds,
        run.auto,
        workdir,
        deterministic=plan.verify.deterministic,
        progress=plan.progress.phase,
        original_score=run.original_score,
        memory=plan.verify.memory,
        speed_filter=speed_filter,
        check=plan.verify,
        losses=None if memos is None else ((plan.src, repr(plan.convert)), memos.losses),
        ceiling=plan.request.larger_than,
    )


def drop_reference(report: QuantizeReport) -> None:
    """The search's reference files go with its scratch directory: the report keeps none."""
    if report.auto is not None:
        report.auto.reference = report.auto.cache = None
