"""Sensitivity measured with each node quantized alone (quantize/sensitivity.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onnx_conv2matmul.quantize.options import FLOAT, Setting
from onnx_conv2matmul.quantize.ranking import criterion
from onnx_conv2matmul.quantize.reference import FeedSet
from onnx_conv2matmul.quantize.search_options import MEASURE_NODES, AutoOptions
from onnx_conv2matmul.quantize.sensitivity import calibrate


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


@pytest.mark.parametrize(
    ("how", "speed_aware", "nodes", "measure", "expected"),
    [
        ("from the input files", True, 500, None, "measured"),  # the user's files: always
        ("standard normal", False, MEASURE_NODES, None, "measured"),  # the smallest, few nodes
        ("standard normal", False, MEASURE_NODES + 1, None, "predicted"),  # too many to measure
        ("standard normal", True, 10, None, "predicted"),  # speed-aware: the default's search
        ("standard normal", False, 10, False, "predicted"),  # as the options say
        ("from the input files", True, 10, False, "predicted"),
        ("standard normal", True, 10, True, "measured"),
    ],
)
def test_when_sensitivity_is_measured(
    how: str, speed_aware: bool, nodes: int, measure: bool | None, expected: str
) -> None:
    feeds = FeedSet([{"x": np.zeros(3, np.float32)}], [1], "", [], {"x": how})
    options = AutoOptions(min_cosine=0.99, speed_aware=speed_aware, measure=measure)
    assert criterion(options, feeds, nodes) == expected


def test_the_smallest_feeds_that_hold_enough_samples() -> None:
    from onnx_conv2matmul.verify.feeds import smallest_covering

    def feed(rows: int, width: int) -> dict[str, np.ndarray]:
        return {"x": np.zeros((rows, 3, width), np.float32)}

    # --inputs of one size in chunks: the smallest chunk alone holds 8
    assert smallest_covering([feed(15, 64), feed(10, 64), feed(10, 64)], 8) == [1]
    # synthesised, one sample a feed: the shortest first, until 8 (every one of 5 here)
    lengths = [feed(1, n) for n in (64, 80, 97, 128, 191)]
    assert smallest_covering(lengths, 8) == [0, 1, 2, 3, 4]
    assert smallest_covering(lengths, 2) == [0, 1]
    assert smallest_covering([feed(4, 200), feed(4, 100), feed(4, 300)], 8) == [0, 1]  # in order
    assert smallest_covering([], 8) == []


@pytest.mark.parametrize(("others_cosine", "offered"), [(0.973, False), (0.999, True)])
def test_int8_other_weights_that_alone_miss_the_target_are_not_offered(
    monkeypatch: pytest.MonkeyPatch, others_cosine: float, offered: bool
) -> None:
    """Measured alone, every other weight in int8 at once: PP-OCRv4 rec's convs cost cosine 0.973,
    below 0.99 by themselves, so no model of the search could hold them; they stay float."""
    from onnx_conv2matmul.quantize import ranking
    from onnx_conv2matmul.quantize.search_options import OTHER_INT8
    from onnx_conv2matmul.quantize.search_runs import _Measured
    from onnx_conv2matmul.quantize.sensitivity import MatMulNode

    def evaluate(_path, config, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        return _Measured(cosine=others_cosine if config.other_weights else 0.998)

    monkeypatch.setattr(ranking, "_evaluate", evaluate)
    node = MatMulNode("mm", None, 64, 64, 16384)
    node.options = {Setting(4, 64, False): (0.01, 2600)}
    others = MatMulNode("(other weights)", None, 0, 0, 90000)
    others.options = {OTHER_INT8: (1e-5, 23000)}
    reference = type("R", (), {"feeds": type("F", (), {"feeds": [{"x": np.zeros((1, 4), np.float32)}]})()})()
    options = AutoOptions(min_cosine=0.99)
    ranking.measure_alone("m.onnx", [node], others, options, reference, "w", True, None)  # type: ignore[arg-type]
    assert bool(others.options) is offered
    assert node.options[Setting(4, 64, False)][0] == pytest.approx(0.002)  # rescaled to its loss
    if offered:
        assert others.options[OTHER_INT8][0] == pytest.approx(1 - others_cosine)


def test_losses_measured_once_in_a_quantize_run_are_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step back after a held-out miss searches the same model on the same feeds again: the
    losses alone kept by the first search are read, not measured again (hama's phoneme
    recognizer with 12 utterances: 26.7 s -> 19.3 s, the same model). Another model, another
    feed or another setting is measured."""
    from onnx_conv2matmul.quantize import ranking
    from onnx_conv2matmul.quantize.search_runs import _Measured
    from onnx_conv2matmul.quantize.sensitivity import MatMulNode

    runs: list[str] = []

    def evaluate(_path, config, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        runs.append(",".join(config.nodes))
        return _Measured(cosine=0.995)

    monkeypatch.setattr(ranking, "_evaluate", evaluate)

    def measure(model: str, value: float, kept: dict) -> float:
        node = MatMulNode("mm", None, 64, 64, 16384)
        node.options = {Setting(4, 64, False): (0.01, 2600)}
        feeds = [{"x": np.full((1, 4), value, np.float32)}]
        reference = type("R", (), {"feeds": type("F", (), {"feeds": feeds})()})()
        ranking.measure_alone(  # type: ignore[arg-type]
            "m.onnx",
            [node],
            MatMulNode("o", None, 0, 0, 0),
            AutoOptions(min_cosine=0.99),
            reference,
            "w",
            True,
            None,
            ((model, "layout"), kept),
        )
        return node.options[Setting(4, 64, False)][0]

    kept: dict = {}
    first = measure("a.onnx", 0.0, kept)
    assert runs == ["mm"] and len(kept) == 1
    assert measure("a.onnx", 0.0, kept) == first and runs == ["mm"]  # read, not run
    measure("a.onnx", 1.0, kept)  # other feeds
    measure("b.onnx", 0.0, kept)  # another model
    assert runs == ["mm"] * 3 and len(kept) == 3
    measure("a.onnx", 0.0, {})  # a run of its own measures again
    assert len(runs) == 4
