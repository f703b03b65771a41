"""Sensitivity measured on the user's inputs: each MatMul quantized alone, its output error measured.

The search's error model (:mod:`onnx_conv2matmul.quantize.sensitivity`) predicts each node's
error from its weights and the energy of its input channels. On a trained CNN the prediction
can rank the nodes wrongly: the error a layer's weights make is not what the outputs show after
the layers that follow (normalisations, activations, pooling) have taken it in. With real inputs
(``--inputs``), :func:`calibrate` measures it instead: each quantizable MatMul is quantized alone
at its smallest setting, the model is run on every feed, and the loss is ``1 -`` the worst
per-sample cosine similarity of the float outputs to fp32. Each node's predicted errors (all its
settings) are scaled by the ratio of that measured loss to its predicted error at that setting, so
the allocation ranks nodes by what they do to the outputs, and the ratios between a node's own
settings stay as predicted. One full-model run per node and feed: a few seconds per node on a
10 MiB recognizer with 50 lines, which is why it runs only on real inputs by default
(``AutoOptions.measure``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from onnx_conv2matmul.quantize.search_options import Setting


@dataclasses.dataclass(frozen=True)
class Measured:
    """One node quantized alone: its setting, the predicted error and the measured loss."""

    node: str
    setting: str
    predicted: float
    measured: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def calibrate(nodes: Sequence[Any], loss_alone: Callable[[str, Setting], float]) -> list[Measured]:
    """Scale each node's predicted errors by its measured loss (see the module's documentation).

    ``nodes`` are the search's nodes (``name`` and ``options``: setting to (error, bytes));
    ``loss_alone(name, setting)`` builds the model with only that node quantized and returns
    ``1 - worst cosine`` over the feeds. Nodes with no quantized setting are left as they are.
    """
    from onnx_conv2matmul.quantize.criteria import rescale

    return [Measured(*row) for row in rescale(nodes, loss_alone)]
