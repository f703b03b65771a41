"""Stable codes for why a convolution was left untouched.

The values are part of the JSON report and are documented in docs/rewrite.md: never
rename one, only add new members.
"""

from __future__ import annotations

import enum


class SkipReason(str, enum.Enum):
    """Why a Conv-like node was not rewritten."""

    UNSUPPORTED_OP = "unsupported_op"
    """Not a default-domain ``Conv`` or a ``com.microsoft`` ``FusedConv`` (ConvInteger, QLinearConv, ...)."""
    WEIGHT_NOT_CONSTANT = "weight_not_constant"
    """The weight is computed at run time or is a graph input."""
    WEIGHT_OVERRIDABLE = "weight_overridable"
    """The weight is an initializer that is also a graph input, so a caller may replace it."""
    UNSUPPORTED_RANK = "unsupported_rank"
    """The weight is not of rank 3, 4 or 5 (Conv1D, Conv2D, Conv3D)."""
    KERNEL_NOT_POINTWISE = "kernel_not_pointwise"
    """A kernel dimension is larger than 1."""
    GROUPED = "grouped"
    """``group`` is above 1 with several input channels per group: converted in extended mode only."""
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    """The weight is not a floating-point type MatMul accepts."""
    INVALID_ATTRIBUTES = "invalid_attributes"
    """Attributes or bias shape are inconsistent with the weight (the node is invalid as it is)."""
    NEEDS_EXTENDED_MODE = "needs_extended_mode"
    """Strides or pads need ``--extended-conv1x1`` (auto_pad alone does not: it pads nothing)."""
    DILATION_NEEDS_OPT_IN = "dilation_needs_opt_in"
    """A dilation above 1 needs ``--allow-non-unit-dilation``."""
    DILATION_ABOVE_MAX = "dilation_above_max"
    """A dilation is above ``--max-dilation``."""
    OPSET_UNSUPPORTED = "opset_unsupported"
    """The model's opset or IR version cannot express the rewrite (Slice with steps < 10, ...)."""
    WEIGHT_SHARED = "weight_shared"
    """The weight also feeds a node that stays; converting would store it twice."""
    AMBIGUOUS_WEIGHT = "ambiguous_weight"
    """The weight's name is defined in more than one scope, so runtimes may resolve it differently."""
    IN_FUNCTION = "in_function"
    """The node is inside a model-local function (not rewritten)."""
    ADDS_TRANSPOSES = "adds_transposes"
    """Its channels-last form would add Transposes to the model; ``--allow-added-transposes``."""
    DEPTHWISE = "depthwise"
    """A depthwise convolution (one input channel per group): a per-channel scale, no matrix."""
    UNSUPPORTED_ACTIVATION = "unsupported_activation"
    """A ``FusedConv`` activation the standard ops cannot express exactly (unknown name, wrong
    ``activation_params`` count or type)."""

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS: dict[SkipReason, str] = {
    SkipReason.UNSUPPORTED_OP: "not a Conv or com.microsoft FusedConv",
    SkipReason.WEIGHT_NOT_CONSTANT: "weight is not a constant",
    SkipReason.WEIGHT_OVERRIDABLE: "weight initializer is also a graph input",
    SkipReason.UNSUPPORTED_RANK: "weight rank is not 3, 4 or 5",
    SkipReason.KERNEL_NOT_POINTWISE: "kernel is not pointwise",
    SkipReason.GROUPED: "grouped convolution needs --extended-conv1x1",
    SkipReason.UNSUPPORTED_DTYPE: "weight type not supported by MatMul",
    SkipReason.INVALID_ATTRIBUTES: "attributes inconsistent with the weight",
    SkipReason.NEEDS_EXTENDED_MODE: "strides/pads need --extended-conv1x1",
    SkipReason.DILATION_NEEDS_OPT_IN: "dilation > 1 needs --allow-non-unit-dilation",
    SkipReason.DILATION_ABOVE_MAX: "dilation above --max-dilation",
    SkipReason.OPSET_UNSUPPORTED: "model opset or IR version cannot express the rewrite",
    SkipReason.WEIGHT_SHARED: "weight also used by a node that stays",
    SkipReason.AMBIGUOUS_WEIGHT: "weight name defined in several scopes",
    SkipReason.IN_FUNCTION: "inside a model-local function",
    SkipReason.ADDS_TRANSPOSES: "would add Transposes; --allow-added-transposes",
    SkipReason.DEPTHWISE: "depthwise convolution",
    SkipReason.UNSUPPORTED_ACTIVATION: "FusedConv activation not expressible",
}
