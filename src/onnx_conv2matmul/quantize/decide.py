"""The decide stage of the one quantize pass: each MatMul's setting chosen before anything is
built, from predicted sensitivity, when the uniform settings missed the criterion.

Each quantizable MatMul has three ways to be stored: the uniform setting the run asked for (or
the kernel choice made), int8 symmetric at the same block size, and float. The predicted error
of each (:func:`onnx_conv2matmul.quantize.sensitivity._sensitivities`: the weight's error weighted
by its input's per-channel mean square, measured in the uniform candidate's own check run) and
its bytes give, for each trade-off ``l``, the smallest model for its predicted error (every node
takes the option with the least ``bytes + l * error``; the other weights, int8 or float, likewise).

The uniform candidate's measured loss ``L`` (``1 - worst cosine`` over ``1 - floor``: 1 is the
limit) and its total predicted error ``E`` fix the line through the origin the loss is taken to
follow; the mix is the smallest model whose predicted error is at most :data:`AIM` of the error
where that line meets the limit, ``AIM * E / L``. Nothing is run here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul._graphs import default_opset
from onnx_conv2matmul.quantize import other_weights
from onnx_conv2matmul.quantize.search_options import OTHER_INT8, AutoOptions, Setting
from onnx_conv2matmul.quantize.search_result import AutoConfig
from onnx_conv2matmul.quantize.sensitivity import (
    MatMulNode,
    _breakpoints,
    _other_weights_error,
    _quantizable,
    _sensitivities,
)

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.settings import QuantizeOptions
    from onnx_conv2matmul.quantize.speed_objective import SpeedFilter

AIM = 0.9
"""The mix aims at this share of the predicted error the measured line allows, so that the
second candidate rather passes with a little to spare than misses by a hair. On the Parakeet-shaped
encoder the line was conservative for mixes (the most sensitive layers move first): at 0.8 the mix
measured 0.61 of the limit, at 0.9 0.69, at 1.0 0.94."""


@dataclasses.dataclass
class Decision:
    """The mix chosen: its options, and what it was chosen from (for the report)."""

    options: QuantizeOptions
    counts: dict[str, int]
    predicted_error: float
    uniform_error: float
    target_error: float
    weight_bytes: int

    def to_dict(self) -> dict[str, object]:
        return {
            "settings": self.counts,
            "predicted_error": self.predicted_error,
            "uniform_predicted_error": self.uniform_error,
            "target_error": self.target_error,
            "weight_bytes": self.weight_bytes,
        }


@dataclasses.dataclass
class Sensitivity:
    """Each quantizable MatMul's options and the other weights' (the model of the errors)."""

    nodes: list[MatMulNode]
    others: MatMulNode
    uniform: dict[str, Setting]

    def uniform_error(self) -> float:
        return sum(
            node.options[self.uniform[node.name]][0] for node in self.nodes if node.name in self.uniform
        )


def sensitivity(
    model: ir.Model,
    options: QuantizeOptions,
    activations: Mapping[str, np.ndarray],
    speed_filter: SpeedFilter | None = None,
) -> Sensitivity:
    """The predicted error and bytes of each MatMul (``model``: the rewritten fp32 model) at its
    uniform setting and at int8, and of the other weights at int8. ``speed_filter``: int8 is not
    offered to a layer where it runs slower than float on this CPU (by the kernel costs; the
    default run is kept from them, ``--prefer size`` offers every precision)."""
    selection = AutoOptions(min_cosine=0.0, include=options.include, exclude=options.exclude)
    nodes = [
        node for node in _quantizable(model, selection) if options.setting_for(node.name).bits is not None
    ]
    uniform: dict[str, Setting] = {}
    ladders: dict[str, list[Setting]] = {}
    for node in nodes:
        setting = options.setting_for(node.name)
        assert setting.bits is not None
        own = Setting(setting.bits, setting.block_size, setting.symmetric)
        uniform[node.name] = own
        # int8 symmetric: asymmetric took 6x less loss on PP-OCRv5 rec's MatMuls all in int8, but
        # its errors, predicted lower, kept two small early convs of PP-OCRv4 rec in int8 that
        # sink it (0.9665): 0.457x instead of 0.381x; with both offered, the same.
        ladders[node.name] = [own] if own.bits == 8 else [own, Setting(8, setting.block_size, True)]
    if speed_filter is not None:
        for name, ladder in list(ladders.items()):
            allowed = set(speed_filter.allowed([name], ladder).get(name, tuple(ladder)))
            ladders[name] = [s for s in ladder if s in allowed or s == uniform[name]]
    _sensitivities(model, nodes, [], activations, ladders)
    others = MatMulNode("(other weights)", None, 0, 0, 0)
    # Below opset 13 the other weights would be read through Cast and Mul: offered by the search,
    # which measures their loss, not here, on their weights' error alone (PP-OCRv4 rec's convs in
    # int8 predict little and cost cosine 0.973).
    cast_mul = other_weights.read_through_cast_mul(ir.DataType.FLOAT, default_opset(model) or 0)
    measured = None if cast_mul else _other_weights_error(model)
    if measured is not None:
        error, kept_bytes, int8_bytes = measured
        others.float_bytes = kept_bytes
        others.options[OTHER_INT8] = (error, int8_bytes)
    return Sensitivity(nodes, others, uniform)


def decide(
    sens: Sensitivity,
    options: QuantizeOptions,
    uniform_loss: float,
    *,
    aim: float = AIM,
    missed: tuple[float, float] | None = None,
) -> Decision:
    """The smallest mix whose predicted error is at most ``aim`` times the error at which the
    line through the origin and the uniform candidate (its predicted error, ``uniform_loss``)
    meets the limit; every node in float when even that is too much.

    The first mix is never aimed below the error of every node at its most accurate step other
    than the uniform setting (int8, or float where the ladder offers no int8): far below the floor
    (a loss of tens), the line is no guide (a weight whose int4 steps round most values to zero
    loses its output's energy rather than adding noise to it), and int8 everywhere is worth a
    candidate before float is.

    ``missed``: the predicted error and the measured loss of a mix that missed too. The loss is
    then taken as the straight line through both candidates (the uniform one and that mix), and
    the next mix aims where it meets ``aim`` of the limit; when that line does not reach it above
    zero error, at half the first aim or half the missed mix's error, whichever is lower (on
    PP-OCRv4's detector int8 everywhere still measured a loss of 11.7, and the line through it
    would leave every layer in float)."""
    items = [*sens.nodes, sens.others]
    uniform_error = sens.uniform_error()
    loss = uniform_loss if math.isfinite(uniform_loss) and uniform_loss > 0 else math.inf
    target = aim * uniform_error / loss if math.isfinite(loss) else 0.0
    if missed is None:
        # Each node at its most accurate step other than the uniform setting: the int8 of its
        # ladder, or float (error 0) when none is offered (int8 left out by the speed filter).
        # Counting the uniform setting here made the first mix a copy of the uniform candidate.
        least = sum(
            min((e for s, (e, _) in node.options.items() if s != sens.uniform.get(node.name)), default=0.0)
            for node in sens.nodes
        )
        target = max(target, least)
    else:
        found = _secant(uniform_error, loss, *missed, aim)
        # Without a line, half the first aim, and below half the mix that missed: at or above its
        # error the same mix comes back (PP-OCRv4 rec with the Transposes, its int8 asymmetric:
        # int8 on 28 layers, float on 2, made and checked twice, 0.9665 both times).
        target = found if found is not None else min(target, missed[0]) / 2
    chosen_tradeoff = math.inf
    for tradeoff in [0.0, *_breakpoints(items)]:
        if sum(item.choose(tradeoff)[1] for item in items) <= target:
            chosen_tradeoff = tradeoff
            break
    nodes = {node.name: node.choose(chosen_tradeoff)[0] for node in sens.nodes}
    int8_others = bool(sens.others.options) and sens.others.choose(chosen_tradeoff)[0] == OTHER_INT8
    config = AutoConfig(nodes, int8_others, options.accuracy_level)
    mix = options.only(
        {name: setting.node_setting() for name, setting in sorted(nodes.items())},
        "int8" if int8_others else "keep",
    )
    predicted = sum(item.choose(chosen_tradeoff)[1] for item in items)
    weight_bytes = sum(item.choose(chosen_tradeoff)[2] for item in items)
    return Decision(mix, config.counts(), predicted, uniform_error, target, weight_bytes)


def others_in_float(decision: Decision, sens: Sensitivity) -> Decision | None:
    """``decision``'s MatMul settings with the other weights kept in float; None when it keeps them
    already, or quantizes no MatMul (nothing would be quantized). Their predicted error is the
    least grounded part of the prediction: their weights' own int8 error, weighted by no
    activation and scaled to no measured loss. PP-OCRv5 rec with the Transposes: the mix with its
    1.3 MiB of other convs in int8 measured 0.9897, the same MatMuls with them in float 0.9920."""
    if decision.options.other_weights != "int8" or OTHER_INT8 not in sens.others.options:
        return None
    if not any(setting.bits is not None for setting in decision.options.nodes.values()):
        return None  # it would be the original (silero VAD ifless, where int8 was slower than float)
    error, int8_bytes = sens.others.options[OTHER_INT8]
    return dataclasses.replace(
        decision,
        options=dataclasses.replace(decision.options, other_weights="keep"),
        predicted_error=max(0.0, decision.predicted_error - error),
        weight_bytes=decision.weight_bytes - int8_bytes + sens.others.float_bytes,
    )


def _secant(uniform_error: float, uniform_loss: float, error: float, loss: float, aim: float) -> float | None:
    """The predicted error where the loss reaches ``aim`` on the line through the two candidates
    that missed (uniform, then a mix), below the mix's own; None when that line does not fall to
    it there (far below the floor the losses are no line: then half the first aim)."""
    if not (math.isfinite(loss) and math.isfinite(uniform_loss)) or uniform_error <= error:
        return None
    slope = (uniform_loss - loss) / (uniform_error - error)
    if not (math.isfinite(slope) and slope > 0):
        return None
    found = error - (loss - aim) / slope
    return found if 0.0 <= found < error else None
