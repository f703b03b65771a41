"""What the ``--auto`` search looks for (:class:`AutoOptions`) and the settings it chooses each
MatMul's from (:class:`Setting`, :data:`LADDER`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.quantize.settings import NodeSetting, QuantizeOptions

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.metric import MetricTarget


DEFAULT_MAX_EVALUATIONS = 8


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one MatMul is stored: MatMulNBits with these settings, or float (``bits`` None)."""

    bits: int | None
    block_size: int = 64
    symmetric: bool = False

    @property
    def label(self) -> str:
        if self.bits is None:
            return "float"
        return f"int{self.bits} block {self.block_size} {'symmetric' if self.symmetric else 'asymmetric'}"

    def to_dict(self) -> dict[str, Any]:
        if self.bits is None:
            return {"bits": None}
        return {"bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric}

    def node_setting(self) -> NodeSetting:
        """The same as a per-node setting of :class:`QuantizeOptions`."""
        return NodeSetting(self.bits, self.block_size, self.symmetric)


FLOAT = Setting(None)
# The other weights' one option besides float, in the same allocation as the MatMuls.
OTHER_INT8 = Setting(8, 0, True)

LADDER: tuple[Setting, ...] = tuple(
    Setting(bits, block, symmetric)
    for bits in (4, 8)
    for block in (128, 64, 32)
    for symmetric in (True, False)
)
"""The quantized settings the search chooses from (float is always a choice)."""


CRITERIA = (
    "predicted",
    "measured",
    "weight_error",
    "hawq",
    "mean_variance",
    "max_variance",
    "mean_magnitude",
)
"""How the search may rank the MatMuls (see :mod:`onnx_conv2matmul.quantize.sensitivity`)."""


MEASURE_NODES = 64
"""Asked for the smallest model (``--auto``, or ``--prefer size`` below the floor: not
``speed_aware``), the search measures each node alone on synthesised inputs too when the model
has at most this many quantizable MatMuls: one short evaluation per node."""


MEASURE_SAMPLES = 4
"""Each node is measured alone on the smallest feeds that hold at least this many samples: a
ranking, which every evaluation then checks on all of them. hama's speech recognizer (43 nodes,
one utterance a feed) with 12 real utterances under ``--auto --inputs``: 8 samples took 4.4 s to
rank and gave 0.781x at PER 44.76%; 4 took 2.0 s and gave 0.753x at PER 44.50% (fp32 45.01%)."""


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """What the search looks for: ``min_cosine``, ``metric`` or both (``quantize_file`` takes
    neither as its floor, :data:`onnx_conv2matmul.quantize.plan.DEFAULT_MIN_COSINE`).

    Attributes:
        min_cosine: Every float output's cosine similarity to fp32, for every sample of
            every feed, must be at least this.
        metric: The user's score and the largest drop it may show.
        max_evaluations: Most full-model evaluations (at least 2).
        ladder: The quantized settings to choose from.
        other_weights: True or False to force int8 or float for the other weights;
            None lets the search decide.
        accuracy_level: MatMulNBits accuracy level of every quantized node.
        exclude: Glob patterns of MatMul names kept in float.
        include: When given, only MatMuls matching one of these are candidates.
        measure: Scale each node's predicted error by its output error measured with the
            node quantized alone (see :func:`onnx_conv2matmul.quantize.sensitivity.calibrate`); None:
            when the inputs are the user's files, or when not ``speed_aware`` with at most
            :data:`MEASURE_NODES` nodes.
        speed_aware: Offer each node only the settings that float does not beat on this CPU
            (the kernel costs, when measured): the search that runs because the default
            settings fell below the floor is; ``--auto``, asked for the smallest model, is not.
        criterion: How the nodes are ranked, one of
            :data:`CRITERIA` (``measured``, ``predicted`` or
            one of NNCF's rankers); None: as ``measure`` says. It wins over ``measure``.
    """

    min_cosine: float | None = None
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS
    ladder: tuple[Setting, ...] = LADDER
    other_weights: bool | None = None
    accuracy_level: int = 0
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    metric: MetricTarget | None = None
    measure: bool | None = None
    criterion: str | None = None
    speed_aware: bool = False

    def __post_init__(self) -> None:
        if self.criterion is not None and self.criterion not in CRITERIA:
            raise ValueError(f"unknown criterion {self.criterion!r}; one of {', '.join(CRITERIA)}")
        if self.max_evaluations < 2:
            raise ValueError(f"the search needs at least 2 evaluations, got {self.max_evaluations}")
        if any(s.bits is None for s in self.ladder):
            raise ValueError("the ladder holds quantized settings only (float is always a choice)")

    def selects(self, name: str) -> bool:
        return QuantizeOptions(exclude=self.exclude, include=self.include).selects(name)
