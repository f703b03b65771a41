"""A quantize run that quantizes nothing says why on the summary's first line, by cause, with the
figure and the option that changes it; the include/exclude hint only when patterns were given.
Such a run still writes its output (the documented choice) and exits 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize.trade import Layout, Prefer, TransposeTrade
from onnx_conv2matmul.quantize.unchanged import Cause, Unchanged, with_trade
from speed_fakes import sequence_matmul_model

SCHEMA = json.loads((Path(__file__).parent.parent / "schema" / "report.schema.json").read_text())
PATTERN_HINT = "include and exclude patterns"


def _conv(name: str, x: str, y: str, cin: int, cout: int, k: int, group: int, rng: Any) -> tuple[Any, Any]:
    w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    node = helper.make_node("Conv", [x, name + "_w"], [y], name=name, group=group, pads=[k // 2] * 4)
    return node, numpy_helper.from_array(w, name + "_w")


def mobile_block(channels: int = 32, wide: int = 64, pointwise: bool = True) -> onnx.ModelProto:
    """depthwise 3x3 -> pointwise 1x1 (channels -> wide) -> depthwise 3x3: the pointwise conv sits
    between two convs that need channels-first data, so rewriting it adds Transposes. Without
    ``pointwise`` the middle conv is a 3x3 too."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for args in (
        ("dw1", "x", "a", channels, channels, 3, channels),
        ("pw", "a", "b", channels, wide, 1 if pointwise else 3, 1),
        ("dw2", "b", "y", wide, wide, 3, wide),
    ):
        node, weight = _conv(*args, rng=rng)  # type: ignore[misc]
        nodes.append(node)
        weights.append(weight)
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", channels, "H", "W"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", wide, "H", "W"])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _quantize(tmp_path: Path, model: onnx.ModelProto, *args: str) -> tuple[int, dict[str, Any], str]:
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    result = CliRunner().invoke(
        main,
        [
            "quantize",
            str(source),
            str(out),
            "--no-bench",
            "--verify-lengths",
            "16,32",
            *args,
            "--report-json-stdout",
        ],
        catch_exceptions=False,
    )
    data = json.loads(result.stdout)
    jsonschema.validate(data, SCHEMA)
    assert result.exit_code == 0, result.stderr
    assert out.exists()  # the unchanged model is written, with its cause
    return result.exit_code, data, result.stderr


def _first_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.strip())


def test_pointwise_convs_that_add_transposes_are_the_cause(tmp_path: Path) -> None:
    _, data, stderr = _quantize(tmp_path, mobile_block())
    unchanged = data["unchanged"]
    assert unchanged["cause"] == "adds_transposes"
    assert unchanged["option"] == "--prefer size"  # not timed (--no-bench): the model without them
    # 32 x 64 pointwise weights against 32 x 9 + 64 x 9 depthwise ones
    assert unchanged["weight_share"] == pytest.approx(2048 / (2048 + 864), abs=1e-4)
    first = _first_line(stderr)
    assert first.startswith("nothing quantized: 1 pointwise conv holding 70% of the weights")
    assert "not timed" in first and "--prefer size keeps them" in first
    assert data["transposes"]["kept"] == "without them"
    assert PATTERN_HINT not in stderr


def test_larger_kernels_are_the_cause(tmp_path: Path) -> None:
    _, data, stderr = _quantize(tmp_path, mobile_block(pointwise=False))
    assert data["unchanged"]["cause"] == "larger_kernels"
    assert data["unchanged"]["weight_share"] == pytest.approx(1.0)
    first = _first_line(stderr)
    assert "kernels larger than 1" in first and "100%" in first
    assert data["unchanged"]["option"] is None
    assert PATTERN_HINT not in stderr


def test_patterns_that_leave_everything_out_are_the_cause(tmp_path: Path) -> None:
    _, data, stderr = _quantize(tmp_path, sequence_matmul_model(), "--exclude", "mm*")
    assert data["unchanged"]["cause"] == "patterns"
    first = _first_line(stderr)
    assert "'mm*'" in first and "2 quantizable MatMul" in first
    assert PATTERN_HINT in stderr


def test_a_quantized_model_has_no_cause(tmp_path: Path) -> None:
    _, data, stderr = _quantize(tmp_path, sequence_matmul_model())
    assert data["unchanged"] is None and data["quantized_nodes"] == 2
    assert not _first_line(stderr).startswith("nothing quantized")


def _trade(prefer: Prefer, with_them_passed: bool, not_made: str = "", quantized: int = 5) -> TransposeTrade:
    without = Layout("without them", False, 900, True, (1.0,), 0)
    size = 400 if with_them_passed else 0
    with_them = Layout("with them", True, size, with_them_passed, (1.3,), quantized, not_made)
    return TransposeTrade(3, 0.8, 1000, (without, with_them), prefer, 0.1, 0, "the reason")


_CAUSE = Unchanged(
    Cause.ADDS_TRANSPOSES,
    0.8,
    "--allow-added-transposes",
    "nothing quantized: 3 pointwise convs ...; --allow-added-transposes quantizes them",
)


@pytest.mark.parametrize(
    ("prefer", "passed", "not_made", "quantized", "hint"),
    [
        (Prefer.BALANCED, True, "", 5, True),  # left for its latency: --prefer size would keep it
        (Prefer.SPEED, True, "", 5, True),
        (Prefer.SIZE, True, "", 5, False),  # the flag was given: naming it again is no help
        (Prefer.BALANCED, False, "", 5, False),  # it missed the criterion: no --prefer keeps it
        (Prefer.SIZE, False, "", 5, False),
        (Prefer.BALANCED, False, "not made: ...", 5, False),
        (Prefer.BALANCED, True, "", 0, False),  # every MatMul in float (PP-OCRv6 det tiny)
    ],
)
def test_prefer_size_is_named_only_where_it_would_keep_them(
    prefer: Prefer, passed: bool, not_made: str, quantized: int, hint: bool
) -> None:
    unchanged = with_trade(_CAUSE, _trade(prefer, passed, not_made, quantized))
    assert unchanged.message.endswith("measured: the reason" + ("; --prefer size keeps them" if hint else ""))
    assert unchanged.option == ("--prefer size" if hint else None)
    assert "--allow-added-transposes" not in unchanged.message


@pytest.mark.parametrize("real_inputs", [False, True])
def test_the_floors_hint_sends_for_real_inputs_only_a_run_that_had_none(real_inputs: bool) -> None:
    """A run on the user's inputs whose criterion kept every MatMul in float is told what else
    changes it (a lower floor, the task's own measure), not to give real inputs again."""
    from onnx_conv2matmul.quantize.nbits import NBitsResult
    from onnx_conv2matmul.quantize.projection import WeightStats
    from onnx_conv2matmul.quantize.settings import QuantizeOptions
    from onnx_conv2matmul.quantize.unchanged import why_unchanged

    stats = WeightStats(total_bytes=1000, quantizable_bytes=800, quantizable_matmuls=4)
    found = why_unchanged(
        [],
        stats,
        stats,
        NBitsResult(),
        QuantizeOptions(),
        searched=True,
        min_cosine=0.99,
        real_inputs=real_inputs,
    )
    assert found is not None and found.cause is Cause.ACCURACY_FLOOR
    assert ("--inputs with real inputs" in found.message) is not real_inputs
    assert ("--validate" in found.message) is real_inputs
    assert "--min-cosine" in found.message
