"""What a check is asked to do: the criterion, the inputs and the memory it may hold."""

# pragma: no mutate start
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

DEFAULT_LENGTHS = (64, 80, 97, 128, 191)
# Image inputs: multiples of 32, the stride of the deepest features of most image networks
# (detectors join them, upsampled, to shallower ones); 96 and 160 are odd multiples of 32,
# the counterpart of the odd sequence lengths.
IMAGE_LENGTHS = (64, 96, 128, 160)
# Tried in turn when the original cannot run at a default length (networks of stride 64
# or 128, or sequence models that need even or aligned lengths).
IMAGE_SPARE_LENGTHS = (192, 256, 384, 512)
SPARE_LENGTHS = (96, 160, 192, 256, 512)
LONG_LENGTH = 3000
"""The long run of a speech encoder's default check, in frames: 30 s of 10 ms feature frames.
Users report int8 Parakeet encoders losing accuracy only on clips longer than about 20 s."""
DEFAULT_MAX_ABS = 3e-5
DEFAULT_MEAN_ABS = 2e-6
DEFAULT_MEMORY = 64 * 2**20
"""The default budget of one run: its inputs and both models' outputs, 64 MiB (see
:attr:`VerifyOptions.memory`)."""

LABEL_MODES = ("auto", "cosine", "labels")
"""``--criterion``: see :attr:`VerifyOptions.labels`."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``512MiB``, ``2GiB``, ``1.5G``, ``300MB``, ``65536``...

    ``K``, ``M``, ``G``, ``T`` with or without ``i`` and ``B`` are powers of 1024 (a
    memory size); ``KB``, ``MB``, ... without ``i`` are powers of 1000, as disks count.

    Raises:
        ValueError: not a size, or zero.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1G)")
    number, unit, binary, byte = match.groups()
    power = " kmgt".index(unit.lower()) if unit else 0
    base = 1000 if (unit and byte and not binary) else 1024
    size = int(float(number) * base**power)
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte: {text!r}")
    return size


def format_size(size: int) -> str:
    """``64 MiB``, ``1.5 GiB``, ``812 B``: a byte count as the reports show it."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) or unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class Found:
    """A value the model's inputs take, found before the check (see
    :mod:`onnx_conv2matmul.verify.discover`): an input's value (``what`` an input name) or an
    input axis's size (``what`` written ``input[axis]``), and how it was found."""

    what: str
    value: int
    how: str

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "value": self.value, "how": self.how}


class Criterion(str, enum.Enum):
    """How float outputs are judged (integer, bool and string outputs always match exactly).

    In every criterion an output fails when it cannot be compared (shape, type, a candidate
    that does not run) or when its NaN/Inf differ.
    """

    SCALED_DIFFERENCE = "scaled_difference"
    """``max_abs`` and ``mean_abs`` of the scaled differences at most the options' limits."""
    MIN_COSINE = "min_cosine"
    """Cosine similarity at least the options' ``min_cosine`` (quantized models)."""
    REPORT_ONLY = "report_only"
    """Measured and reported; any cosine similarity and difference pass."""


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """How inputs are synthesised and outputs judged.

    Attributes:
        lengths: Each sequence dim takes these values in turn (see
            :mod:`onnx_conv2matmul.verify.roles` for which dims are batch and which are
            sequence). None: chosen from the model's inputs, with spares for lengths the
            original model cannot run at, within ``memory`` (see
            :func:`onnx_conv2matmul.verify.plan.plan_lengths`).
        batch: Value of the batch dims.
        seed: Seed of the random inputs.
        max_abs: Largest allowed scaled absolute difference (see
            :func:`onnx_conv2matmul.verify.tally.element_scales`).
        mean_abs: Largest allowed mean scaled absolute difference.
        min_cosine: When set, the criterion is cosine similarity >= this (for
            quantized models), instead of the absolute thresholds.
        report_only: Measure float outputs without judging them (see
            :attr:`Criterion.REPORT_ONLY`); excludes ``min_cosine``.
        signal_input: Name of the main signal input (random normal; others may be zero).
        length_input: Name of the length input (gets the length per batch row);
            by default an integer input of rank 1 whose name says length.
        output_indices: Indices of outputs to compare (default: all).
        inputs: Fixed values per input name: a scalar fill.
        dims: Fixed values per symbolic dim name.
        deterministic: One thread, sequential execution, deterministic compute.
        feeds: Real inputs instead of synthesised ones: one run per feed (a mapping of
            input name to array, e.g. from :func:`onnx_conv2matmul.verify.given.load_inputs`).
            Excludes ``lengths``, ``inputs`` and ``dims``.
        memory: The budget of one run, in bytes: its inputs plus the outputs of both
            models, which the check holds at once (estimated from the output shapes
            before the run). Default lengths are shortened to fit it; lengths given or a
            model that do not fit it are refused; real inputs are fed in chunks of
            samples that fit it (see :mod:`onnx_conv2matmul.verify.stream`), only one
            sample that does not fit is refused.
        axes: Fixed sizes per input axis, keyed ``input[axis]`` (an unnamed dim has no
            name for ``dims``): the axis is taken as static. With ``feeds``, they serve
            the steps that still synthesise inputs (the latency step).
        found: What :func:`onnx_conv2matmul.verify.discover.discover` found and put into
            ``inputs`` and ``axes``; None: not looked for yet (the check looks).
        labels: Which outputs a minimum cosine also judges by the labels they give
            (:mod:`onnx_conv2matmul.verify.labels`): ``auto`` those the graph shows as class
            scores, ``cosine`` none, ``labels`` every float output that can hold them.
    """

    lengths: tuple[int, ...] | None = None
    batch: int = 1
    seed: int = 0
    max_abs: float = DEFAULT_MAX_ABS
    mean_abs: float = DEFAULT_MEAN_ABS
    min_cosine: float | None = None
    signal_input: str | None = None
    length_input: str | None = None
    output_indices: tuple[int, ...] | None = None
    inputs: Mapping[str, float] = dataclasses.field(default_factory=dict)
    dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
    deterministic: bool = False
    report_only: bool = False
    # Arrays have no truth value: options holding feeds compare as equal whatever the arrays.
    feeds: tuple[Mapping[str, np.ndarray], ...] | None = dataclasses.field(default=None, compare=False)
    memory: int = DEFAULT_MEMORY
    axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    found: tuple[Found, ...] | None = None
    labels: str = "auto"

    def __post_init__(self) -> None:
        if self.labels not in LABEL_MODES:
            raise ValueError(f"the labels criterion is one of {', '.join(LABEL_MODES)}, not {self.labels!r}")
        if self.feeds is not None:
            if not self.feeds:
                raise ValueError("verify feeds must hold at least one set of inputs")
            given = [
                name
                for name, value in (
                    ("lengths", self.lengths),
                    ("input values", self.inputs),
                    ("dim values", self.dims),
                )
                if value
            ]
            if given:
                raise ValueError(f"real inputs cannot be combined with {' or '.join(given)}")
        if self.report_only and self.min_cosine is not None:
            raise ValueError("a report-only verification takes no minimum cosine similarity")
        if self.lengths is not None and (not self.lengths or any(n < 1 for n in self.lengths)):
            raise ValueError("verify lengths must be positive integers")
        if self.batch < 1:
            raise ValueError("verify batch must be >= 1")
        if any(v < 1 for v in self.dims.values()) or any(v < 1 for v in self.axes.values()):
            raise ValueError("verify dims must be >= 1")
        if self.memory < 1:
            raise ValueError("the verify memory budget must be at least 1 byte")

    @property
    def criterion(self) -> Criterion:
        """How float outputs are judged: report only, minimum cosine, or scaled differences."""
        if self.report_only:
            return Criterion.REPORT_ONLY
        if self.min_cosine is not None:
            return Criterion.MIN_COSINE
        return Criterion.SCALED_DIFFERENCE

    def criterion_dict(self) -> dict[str, Any]:
        """The criterion for the report: its ``kind`` and the limits it uses."""
        criterion = self.criterion
        if criterion is Criterion.MIN_COSINE:
            return {"kind": criterion.value, "min_cosine": self.min_cosine, "labels": self.labels}
        if criterion is Criterion.SCALED_DIFFERENCE:
            return {"kind": criterion.value, "max_abs": self.max_abs, "mean_abs": self.mean_abs}
        return {"kind": criterion.value}

    def to_dict(self) -> dict[str, Any]:
        feeds = self.feeds
        data = dataclasses.asdict(dataclasses.replace(self, feeds=None))
        data["inputs"] = dict(self.inputs)
        data["dims"] = dict(self.dims)
        data["axes"] = dict(self.axes)
        data["found"] = None if self.found is None else [f.to_dict() for f in self.found]
        data["feeds"] = None if feeds is None else [feed_source(feed, i) for i, feed in enumerate(feeds)]
        return data


def feed_source(feed: Mapping[str, np.ndarray], index: int) -> str:
    """Where a feed came from: its file, or ``feed <n>`` (from 1) for one made in memory."""
    return getattr(feed, "source", None) or f"feed {index + 1}"


# pragma: no mutate end
