"""Sensitivity measured with each node quantized alone (quantize/criteria.py)."""

from __future__ import annotations

import dataclasses

import pytest

from onnx_conv2matmul.quantize.criteria import calibrate
from onnx_conv2matmul.quantize.options import FLOAT, Setting


@dataclasses.dataclass
class _Node:
    name: str
    options: dict[Setting, tuple[float, int]]


INT4 = Setting(4, 32, False)
INT8 = Setting(8, 32, False)


def test_measured_losses_replace_a_misranking_prediction() -> None:
    """The predictor says ``a`` hurts more than ``b``; measured alone, ``b`` does: after the
    calibration ``b`` is the more sensitive at every setting, and each node's own settings
    keep their predicted ratio."""
    a = _Node("a", {INT4: (0.02, 100), INT8: (0.002, 200), FLOAT: (0.0, 400)})
    b = _Node("b", {INT4: (0.01, 100), INT8: (0.001, 200)})
    measured = {"a": 0.001, "b": 0.05}
    asked: list[tuple[str, Setting]] = []

    def loss_alone(name: str, setting: Setting) -> float:
        asked.append((name, setting))
        return measured[name]

    found = calibrate([a, b], loss_alone)
    assert asked == [("a", INT4), ("b", INT4)]  # the smallest setting, once per node
    assert a.options[INT4][0] == pytest.approx(0.001) and b.options[INT4][0] == pytest.approx(0.05)
    assert b.options[INT8][0] > a.options[INT8][0]
    assert a.options[INT8][0] / a.options[INT4][0] == pytest.approx(0.1)
    assert a.options[FLOAT] == (0.0, 400) and a.options[INT8][1] == 200
    rows = [(m.node, m.setting, m.measured) for m in found]
    assert rows == [("a", INT4.label, 0.001), ("b", INT4.label, 0.05)]


def test_a_node_without_quantized_settings_is_not_run() -> None:
    node = _Node("f", {FLOAT: (0.0, 10)})
    assert calibrate([node], lambda *_: pytest.fail("ran")) == []
