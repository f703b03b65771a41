"""Options of the rewrite."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """What the rewrite may do.

    Attributes:
        extended: Also rewrite convs with explicit pads or strides above 1 (emits
            ``Pad``/``Slice`` as needed), and grouped pointwise convs with several input
            channels per group (one MatMul per group). ``auto_pad`` alone never needs it:
            for a kernel of 1 it pads nothing.
        allow_non_unit_dilation: Rewrite convs whose dilations are above 1. For a
            kernel of size 1 dilation has no effect on the result.
        max_dilation: With ``allow_non_unit_dilation``, skip convs with a dilation
            above this value. ``None`` means no limit.
        allow_added_transposes: Also rewrite convs whose channels-last form leaves
            Transpose nodes the cleanup cannot cancel (a pointwise conv between two
            ops that need channels-first data, such as depthwise convs). Off by
            default: the rewrite then never adds Transposes to the model.
        gemm: Also rewrite ``Gemm`` nodes with a constant weight into MatMul (+ Mul) (+ Add).
            When off, Gemms are not considered at all (not reported).
    """

    extended: bool = False
    allow_non_unit_dilation: bool = False
    max_dilation: int | None = None
    allow_added_transposes: bool = False
    gemm: bool = True

    def __post_init__(self) -> None:
        if self.max_dilation is not None and self.max_dilation < 1:
            raise ValueError(f"max_dilation must be >= 1, got {self.max_dilation}")

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
