"""Criteria shaped like the output: the labels a classifier or a recognizer reads from its scores.

A cosine floor of 0.99 on class scores still lets labels move: a sample near a class boundary
flips with a small error, and a CTC recognizer's frames change characters. So where an output
holds class scores, a minimum cosine comes with a second criterion on it: the share of fp32's
labels the candidate keeps (:data:`MIN_AGREEMENT`, or the minimum cosine itself when lower).

This module is the one place that decides it:

- :func:`output_tasks` reads, once per check, which outputs hold class scores, from the graph:
  the output of a ``Softmax`` or ``LogSoftmax`` over its last axis (or of ``exp(x) / sum``, a
  softmax spelt out), the input of an ``ArgMax`` or ``TopK`` over its last axis, or an output of
  rank 2 or 3 named as logits. ``[samples, classes]`` gives one
  label per sample (:data:`LABELS`); more axes give a sequence of labels along the positions
  (:data:`FRAMES`, CTC and tagging heads), counted as they are read (:func:`read_labels`: repeats
  merged, the blank dropped), changes as the edits between fp32's reading and the candidate's:
  the share kept bounds how far an error rate against any truth can move. ``--criterion``
  overrides it.
- :func:`count` counts, per compared output, the labels and those that changed;
- :func:`task_results` judges the counts of a whole check, output by output (:class:`TaskResult`),
  with what the number of labels can promise (:func:`agreement_bound`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from onnx_conv2matmul.verify.options import VerifyOptions

LABELS = "labels"
"""One label per sample: an output ``[samples, classes]``."""
FRAMES = "frames"
"""One label per position: an output ``[..., positions, classes]`` (CTC, tagging)."""

MIN_AGREEMENT = 0.99
"""The share of fp32's labels a candidate keeps under a minimum cosine of 0.99 or more."""

BLANK_SHARE = 0.5
"""A label fp32 tops at least this share of an output's positions with is its blank (CTC) or
background (tagging): left out of what is read, as a CTC decoder leaves it out.

Why the reading and not the frames: fp32's confident frames (top class at least 0.9 likely) had
been counted one by one. On hama's phoneme recognizer and 20 held-out espeak-ng utterances, every
int4 model tried kept at least 99% of them while 13-17% of the phonemes read changed, and the
error rate against espeak-ng's own transcription moved by -0.7 to +5.6 points: most confident
frames are blanks, and the phonemes sit on the others."""

MAX_CLASSES = 100_000
"""An output wider than this is not read as class scores."""

CONFIDENCE = 0.95
"""The confidence of the lower bound the report gives for an agreement."""

_FLOATS = {1, 10, 11, 16}  # float, float16, double, bfloat16
_THROUGH = {"Identity", "Cast"}
_LOGITS = re.compile(r"logit", re.IGNORECASE)


def output_tasks(model: Any, mode: str = "auto") -> dict[str, str]:
    """The outputs of ``model`` (a ModelProto, weights not needed) that hold class scores, and
    whether per sample (:data:`LABELS`) or per position (:data:`FRAMES`).

    ``mode`` ``cosine``: none; ``labels``: every float output whose last axis can be classes;
    ``auto``: those the graph shows as class scores (see the module's text)."""
    if mode == "cosine" or model is None:
        return {}
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    producer: dict[str, Any] = {}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.output:
            producer[name] = node
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found: dict[str, str] = {}
    for output in graph.output:
        tensor = output.type.tensor_type
        if not output.type.HasField("tensor_type") or tensor.elem_type not in _FLOATS:
            continue
        dims = list(tensor.shape.dim) if tensor.HasField("shape") else None
        rank = len(dims) if dims is not None else None
        if rank == 0 or (
            dims and dims[-1].HasField("dim_value") and not 2 <= dims[-1].dim_value <= MAX_CLASSES
        ):
            continue
        if mode == "labels" or _scores(output.name, rank, opset, producer, consumers):
            found[output.name] = LABELS if rank is not None and rank <= 2 else FRAMES
    return found


def _scores(
    name: str, rank: int | None, opset: int, producer: dict[str, Any], consumers: dict[str, list[Any]]
) -> bool:
    """Whether the graph shows ``name`` as class scores over its last axis."""
    names = [name]
    node = producer.get(name)
    while node is not None and node.op_type in _THROUGH and node.input:
        names.append(node.input[0])
        node = producer.get(node.input[0])
    softmax = node is not None and node.op_type in ("Softmax", "LogSoftmax")
    if softmax and _last_axis(node, -1 if opset >= 13 else 1, rank):
        return True
    if node is not None and node.op_type == "Div" and node.input:
        numerator = producer.get(node.input[0])  # exp(x) / sum(exp(x)): a softmax spelt out
        if numerator is not None and numerator.op_type == "Exp":
            return True
    for value in names:
        for user in consumers.get(value, ()):
            if user.op_type == "ArgMax" and _last_axis(user, 0, rank):
                return True
            if user.op_type == "TopK" and _last_axis(user, -1, rank):
                return True
    # A name alone: class scores per sample or per position, not maps whose last axis is a width.
    return bool(_LOGITS.search(name)) and rank in (None, 2, 3)


def _last_axis(node: Any, default: int, rank: int | None) -> bool:
    axis = next((a.i for a in node.attribute if a.name == "axis"), default)
    if axis == -1:
        return True
    return rank is not None and axis == rank - 1


def count(ref: np.ndarray, out: np.ndarray, kind: str) -> tuple[int, int]:
    """``(labels, changed)`` of one output: for :data:`LABELS`, fp32's label per sample and those
    whose top class is another in ``out`` (a label whose scores are not finite in both counts as
    changed); for :data:`FRAMES`, the labels read (:func:`read_labels`) along the positions axis
    (the one before the classes; each index of the axes before it a sequence of its own), and
    the edits that turn fp32's reading into ``out``'s. Read in blocks of rows."""
    if ref.shape != out.shape or ref.ndim == 0 or ref.size == 0 or not 2 <= ref.shape[-1] <= MAX_CLASSES:
        return 0, 0
    if kind != LABELS and ref.ndim < 2:
        return 0, 0
    classes = ref.shape[-1]
    r, o = ref.reshape(-1, classes), out.reshape(-1, classes)
    top_r = np.empty(r.shape[0], np.int64)
    top_o = np.empty(r.shape[0], np.int64)
    step = max(1, 2**20 // classes)
    for start in range(0, r.shape[0], step):
        # In their own precision: a widening cast changes no order, and would copy every block.
        a, b = r[start : start + step], o[start : start + step]
        top_r[start : start + step] = np.where(np.isfinite(a).all(axis=1), np.argmax(a, axis=1), -1)
        top_o[start : start + step] = np.where(np.isfinite(b).all(axis=1), np.argmax(b, axis=1), -2)
    if kind == LABELS:
        return int(top_r.size), int((top_r != top_o).sum())
    finite = top_r >= 0
    seen = np.bincount(top_r[finite], minlength=classes) if finite.any() else np.zeros(classes, np.int64)
    blank = int(seen.argmax()) if seen.max(initial=0) >= BLANK_SHARE * max(1, int(finite.sum())) else None
    positions = ref.shape[-2]
    labels = changed = 0
    for start in range(0, top_r.size, positions):
        keep = finite[start : start + positions]  # positions fp32 gives no finite scores at: masked
        a = read_labels(top_r[start : start + positions][keep], blank)
        b = read_labels(top_o[start : start + positions][keep], blank)
        labels += max(a.size, b.size)
        changed += edits(a, b)
    return labels, changed


def read_labels(top: np.ndarray, blank: int | None) -> np.ndarray:
    """The labels a greedy CTC decoder reads from the top class of each position: runs of the same
    class merged into one, then ``blank`` dropped (None: nothing dropped)."""
    if top.size == 0:
        return top
    runs = top[np.r_[True, top[1:] != top[:-1]]]
    return runs if blank is None else runs[runs != blank]


def edits(a: np.ndarray, b: np.ndarray) -> int:
    """The Levenshtein distance between two label sequences (insertions, deletions and
    substitutions), a row of the table at a time."""
    if a.size == 0 or b.size == 0:
        return int(max(a.size, b.size))
    if a.size == b.size and np.array_equal(a, b):
        return 0
    index = np.arange(b.size + 1)
    row = index.copy()
    for i, label in enumerate(a, 1):
        current = np.empty_like(row)
        current[0] = i
        current[1:] = np.minimum(row[:-1] + (b != label), row[1:] + 1)
        row = np.minimum.accumulate(current - index) + index  # an insertion: one more than the left
    return int(row[-1])


def agreement_bound(labels: int, changed: int, confidence: float = CONFIDENCE) -> float:
    """The agreement that ``labels - changed`` kept of ``labels`` promises with ``confidence``:
    the one-sided Clopper-Pearson lower bound (0 for no label). Labels are taken as independent;
    the frames of one sample are not, so for them it says more than they promise."""
    kept = labels - changed
    if labels <= 0 or kept <= 0:
        return 0.0
    if changed == 0:
        return float((1.0 - confidence) ** (1.0 / labels))
    alpha = 1.0 - confidence
    low, high = 0.0, kept / labels
    for _ in range(60):  # P(at most `changed` changes | agreement p) = alpha, by bisection
        p = (low + high) / 2
        if _at_most(labels, changed, 1.0 - p) > alpha:
            high = p
        else:
            low = p
    return low


def _at_most(n: int, k: int, q: float) -> float:
    """P(Binomial(n, q) <= k)."""
    if q <= 0:
        return 1.0
    if q >= 1:
        return 1.0 if k >= n else 0.0
    log_q, log_p = math.log(q), math.log1p(-q)
    terms = [
        math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * log_q + (n - j) * log_p
        for j in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def labels_needed(floor: float, confidence: float = CONFIDENCE) -> int:
    """How many labels, none changed, promise an agreement of ``floor`` with ``confidence``."""
    if floor <= 0:
        return 0
    if floor >= 1:
        return 0  # no finite count promises it
    return math.ceil(math.log(1.0 - confidence) / math.log(floor))


def agreement_floor(min_cosine: float | None) -> float | None:
    """The share of labels to keep under a minimum cosine ``c``: ``min(MIN_AGREEMENT, max(0, c))``
    (a minimum cosine of -1 accepts anything); None without one (exactness is stricter)."""
    if min_cosine is None:
        return None
    return min(MIN_AGREEMENT, max(0.0, min_cosine))


def refuse_synthesised(tasks: Mapping[str, str], options: VerifyOptions) -> None:
    """Refuse, before any work, a check that would judge a classifier's labels on synthesised
    inputs: the labels of random inputs tell nothing of real ones (a file-type classifier kept
    every label of its synthesised sample and 97% of 400 real files' labels).

    Raises:
        InputError: an output holds one label per sample (:data:`LABELS`), the inputs are
            synthesised, and the minimum cosine asks labels to be kept (above 0).
    """
    floor = agreement_floor(options.min_cosine)
    if options.feeds is not None or options.report_only or not floor:
        return
    judged = [name for name, kind in tasks.items() if kind == LABELS]
    if judged:
        from onnx_conv2matmul.errors import Hint, InputError

        raise InputError(
            f"output {judged[0]!r} holds a classifier's scores, whose labels must keep {floor:.0%} of"
            " the original's: synthesised inputs cannot show that (their labels tell nothing of real"
            f" ones; {labels_needed(floor)} real samples, none changed, promise it)",
            hint=Hint.CLASSIFIER_INPUTS,
        )


class _Row(Protocol):
    """What :func:`task_results` reads of a check's row (``verify.compare.OutputComparison``)."""

    output: str
    task: str
    labels: int
    label_flips: int


@dataclasses.dataclass
class TaskResult:
    """One output's labels over a whole check: how many, how many changed, the floor."""

    output: str
    kind: str
    labels: int
    changed: int
    floor: float

    @property
    def agreement(self) -> float:
        return 1.0 - self.changed / self.labels if self.labels else 1.0

    @property
    def passed(self) -> bool:
        return self.agreement >= self.floor

    @property
    def bound(self) -> float:
        return agreement_bound(self.labels, self.changed)

    @property
    def loss(self) -> float:
        """The share changed over the share allowed (1 at the limit; inf where none may change)."""
        allowed = 1.0 - self.floor
        if allowed > 0:
            return (1.0 - self.agreement) / allowed
        return 0.0 if self.changed == 0 else math.inf

    def text(self) -> str:
        what = "labels" if self.kind == LABELS else "labels read from its frames"
        verdict = "meets" if self.passed else "below"
        line = (
            f"output {self.output!r}: {self.labels - self.changed} of {self.labels} {what} kept"
            f" ({self.agreement:.2%}, {verdict} {self.floor:.0%})"
        )
        needed = labels_needed(self.floor)
        if self.labels:
            line += f"; with {CONFIDENCE:.0%} confidence at least {self.bound:.1%} on inputs like these"
        if self.changed == 0 and needed > self.labels:
            line += f" ({needed} labels, none changed, promise {self.floor:.0%})"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "kind": self.kind,
            "labels": self.labels,
            "changed": self.changed,
            "agreement": self.agreement,
            "floor": self.floor,
            "passed": self.passed,
            "lower_bound": self.bound,
            "confidence": CONFIDENCE,
            "labels_needed": labels_needed(self.floor),
        }


def task_results(
    rows: Iterable[_Row], min_cosine: float | None, report_only: bool = False
) -> list[TaskResult]:
    """Each class-score output's labels over the rows of a check, judged against the floor a
    minimum cosine sets (:func:`agreement_floor`); none without a minimum cosine."""
    floor = agreement_floor(min_cosine)
    if floor is None or report_only:
        return []
    totals: dict[str, TaskResult] = {}
    add_labels(totals, rows, floor)
    return list(totals.values())


def add_labels(totals: dict[str, TaskResult], rows: Iterable[_Row], floor: float = 0.0) -> None:
    """Add the labels of ``rows`` (the outputs that hold class scores) to ``totals``, by output;
    a new output's result takes ``floor``."""
    for row in rows:
        if row.task:
            entry = totals.setdefault(row.output, TaskResult(row.output, row.task, 0, 0, floor))
            entry.labels += row.labels
            entry.changed += row.label_flips


def failed(results: Sequence[TaskResult]) -> TaskResult | None:
    """The first result below its floor, or None."""
    return next((r for r in results if not r.passed), None)


def unpromisable(checked: Sequence[TaskResult], held: Sequence[Mapping[str, Any]]) -> str | None:
    """Why no model judged on these held-out samples can have its labels promised (the reason
    :func:`unpromised` would give even with no held-out label changed), or None when some could:
    for an output of class scores (``checked``), fewer held-out labels than :func:`labels_needed`
    for its floor. Known before any search: its smaller model could not be kept."""
    entries = {entry["output"]: entry for entry in held}
    for result in checked:
        entry = entries.get(result.output)
        labels = int(entry["labels"]) if entry else 0
        if agreement_bound(labels, 0) < result.floor:
            return (
                f"output {result.output!r} has {labels} held-out labels, which promise at most"
                f" {agreement_bound(labels, 0):.1%} kept on other inputs ({CONFIDENCE:.0%} confidence), below"
                f" {result.floor:.0%} ({labels_needed(result.floor)} held out, none changed, promise it)"
            )
    return None


def unpromised(checked: Sequence[TaskResult], held: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the held-out samples do not promise the labels of ``checked`` (the outputs that hold
    class scores, judged on the samples a result was chosen on) on other inputs, or None when
    they do: for each output, the held-out labels' lower bound (:func:`agreement_bound`, as
    :meth:`TaskResult.to_dict` gives it in ``held``) reaches its floor.

    A search that picks the smallest of many candidates keeps the one that just meets the floor
    on the samples it saw, and a few held-out samples kept whole cannot show it holds beyond
    them: on a file-type classifier and 100 real files, such a pick kept 97.7% of the labels of
    300 others, where the default run's model kept 100%."""
    entries = {entry["output"]: entry for entry in held}
    for result in checked:
        entry = entries.get(result.output)
        labels = int(entry["labels"]) if entry else 0
        changed = int(entry["changed"]) if entry else 0
        bound = float(entry["lower_bound"]) if entry else 0.0
        if bound < result.floor:
            needed = labels_needed(result.floor)
            return (
                f"output {result.output!r}: {labels} held-out labels, {changed} changed, promise only"
                f" {bound:.1%} kept on other inputs ({CONFIDENCE:.0%} confidence), below"
                f" {result.floor:.0%} ({needed} held out, none changed, promise it)"
            )
    return None
