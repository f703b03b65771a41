"""Classes of layers, measured (quantize/classes.py): where the predicted errors of a model of
repeated blocks say nothing about what a layer costs the output, each class is quantized alone and
its loss scales the prediction before the mix is chosen."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize import classes as _classes
from onnx_conv2matmul.quantize import decide as _decide
from onnx_conv2matmul.quantize.search_options import Setting
from onnx_conv2matmul.quantize.sensitivity import MatMulNode

C, BLOCKS = 64, 12


def repeated_blocks(blocks: int = BLOCKS, seed: int = 0) -> onnx.ModelProto:
    """``blocks`` residual blocks of two MatMuls whose weights have the same statistics: ``q``'s
    output is scaled by 1e-3 before it joins the residual (an attention's softmax absorbs its
    query's error likewise), ``v``'s joins it whole. Each weight has a row of 6 that sets its
    int4 scale (its input channel scaled by 1e-3), so int4 costs each the same relative error:
    the prediction cannot tell them apart, the output can."""
    rng = np.random.default_rng(seed)
    scale = np.ones(C, np.float32)
    scale[0] = 1e-3
    inits = [
        numpy_helper.from_array(np.zeros(C, np.float32), "zero"),
        numpy_helper.from_array(np.ones(C, np.float32), "one"),
        numpy_helper.from_array(np.full(C, 1e-3, np.float32), "quiet"),
        numpy_helper.from_array(scale, "s"),
    ]
    nodes = [helper.make_node("Add", ["x", "zero"], ["h0"], name="start")]
    for i in range(blocks):
        for role in ("q", "v"):
            weight = rng.standard_normal((C, C)).astype(np.float32)
            weight[0, :] = 6.0
            inits.append(numpy_helper.from_array(weight, f"W{role}{i}"))
        nodes += [
            helper.make_node("Mul", [f"h{i}", "s"], [f"hs{i}"]),
            helper.make_node("MatMul", [f"hs{i}", f"Wq{i}"], [f"q{i}"], name=f"q{i}"),
            helper.make_node("Mul", [f"q{i}", "quiet"], [f"qq{i}"]),
            helper.make_node("Add", [f"h{i}", f"qq{i}"], [f"g{i}"]),
            helper.make_node("Mul", [f"g{i}", "s"], [f"gs{i}"]),
            helper.make_node("MatMul", [f"gs{i}", f"Wv{i}"], [f"v{i}"], name=f"v{i}"),
            helper.make_node("Add", [f"g{i}", f"v{i}"], [f"h{i + 1}"]),
        ]
    nodes.append(helper.make_node("LayerNormalization", [f"h{blocks}", "one", "zero"], ["y"], axis=-1))
    graph = helper.make_graph(
        nodes,
        "blocks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", C])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", C])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_layers_of_one_role_share_a_class() -> None:
    model = ir.from_proto(repeated_blocks())
    names = [f"{role}{i}" for i in range(BLOCKS) for role in ("q", "v")]
    groups = _classes.classes(model, names)
    assert sorted(name for group in groups for name in group) == sorted(names)
    for group in groups:
        assert len({name[0] for name in group}) == 1  # no class mixes the roles
    assert max(len(group) for group in groups) >= BLOCKS - 2  # the blocks' depth in one class each
    assert _classes.not_worth_measuring(_classes.losses_of(_sensitivity(names), groups)) == ""


def _sensitivity(names: list[str], error: float = 0.1) -> _decide.Sensitivity:
    int4, int8 = Setting(4, 64, False), Setting(8, 64, True)
    nodes = []
    for name in names:
        node = MatMulNode(name, None, C, C, 1000)
        node.options = {int4: (error, 100), int8: (error / 20, 300)}
        nodes.append(node)
    return _decide.Sensitivity(nodes, MatMulNode("(other weights)", None, 0, 0, 0), {n: int4 for n in names})


def test_calibration_scales_each_class_to_its_loss_and_keeps_the_total() -> None:
    sens = _sensitivity(["a1", "a2", "b1", "b2"])
    groups = _classes.losses_of(sens, [["a1", "a2"], ["b1", "b2"]])
    assert [g.predicted for g in groups] == pytest.approx([0.2, 0.2])
    groups[0].measured, groups[1].measured = 0.0, 1.5
    assert _classes.calibrate(sens, groups)
    errors = {node.name: node.options[Setting(4, 64, False)][0] for node in sens.nodes}
    quiet, loud = errors[groups[0].names[0]], errors[groups[1].names[0]]
    assert quiet == pytest.approx(_classes.GAIN_FLOOR * 0.1) and loud == pytest.approx(0.2)
    assert sum(errors.values()) == pytest.approx(
        0.4 + 2 * _classes.GAIN_FLOOR * 0.1
    )  # the total, but the floor
    # int8 scaled alike: the class's options keep their ratio.
    node = next(n for n in sens.nodes if n.name == groups[1].names[0])
    assert node.options[Setting(8, 64, True)][0] == pytest.approx(0.2 / 20)
    # A class not measured leaves the prediction as it is.
    other = _sensitivity(["a1", "b1"])
    assert not _classes.calibrate(other, _classes.losses_of(other, [["a1"], ["b1"]]))


@pytest.mark.parametrize(
    ("losses", "applied"),
    [((math.inf, 1.0), False), ((0.0, 0.0), False), ((-1e-9, 2.0), True)],
    ids=["not-finite", "nothing-lost", "slightly-negative"],
)
def test_calibration_with_odd_losses(losses: tuple[float, float], applied: bool) -> None:
    """A loss that is not finite or a total of nothing leaves the prediction; a class measured at
    nothing (or a hair below: cosines may pass 1) keeps a floor of its errors, so a second mix can
    still move its layers."""
    sens = _sensitivity(["a1", "b1"])
    groups = _classes.losses_of(sens, [["a1"], ["b1"]])
    for group, loss in zip(groups, losses, strict=True):
        group.measured = loss
    assert _classes.calibrate(sens, groups) is applied
    errors = {node.name: node.options[Setting(4, 64, False)][0] for node in sens.nodes}
    if not applied:
        assert set(errors.values()) == {0.1}
    else:
        quiet = errors[groups[0].names[0]]
        assert quiet == pytest.approx(_classes.GAIN_FLOOR * 0.1) and quiet > 0
        assert errors[groups[1].names[0]] == pytest.approx(0.2)


def test_the_reasons_not_to_measure() -> None:
    def groups(*sizes: int) -> list[_classes.ClassLoss]:
        return [_classes.ClassLoss([f"n{i}_{j}" for j in range(size)], 0.1) for i, size in enumerate(sizes)]

    assert "nothing to tell apart" in _classes.not_worth_measuring(groups(24))
    assert "fewer than 4 layers" in _classes.not_worth_measuring(groups(1, 1, 2))
    many = groups(*([5] * (_classes.MAX_CLASSES + 1)))
    assert f"more than {_classes.MAX_CLASSES}" in _classes.not_worth_measuring(many)
    assert _classes.not_worth_measuring(groups(5, 5, 2)) == ""


def test_the_blocks_spilled_read_back_as_they_were(tmp_path: Path) -> None:
    from onnx_conv2matmul.quantize.blockwise import MemoryBlockCache

    rng = np.random.default_rng(0)
    held = MemoryBlockCache()
    arrays = {
        "a|w|4|64|False": (
            rng.integers(0, 255, (8, 2, 32), dtype=np.uint8),
            rng.random(16).astype(np.float32),
            rng.integers(0, 255, 8, dtype=np.uint8),
        ),
        "a|w|8|64|True": (
            rng.integers(0, 255, (8, 1, 64), dtype=np.uint8),
            rng.random(8).astype(np.float32),
            np.full(8, 128, np.uint8),
        ),
    }
    for key, (packed, scales, zero_points) in arrays.items():
        held.put(key, packed, scales, zero_points)
    disk = held.spill(str(tmp_path / "blocks"))
    assert held.get("a|w|4|64|False") is None  # let go
    for key, want in arrays.items():
        got = disk.get(key)
        assert got is not None
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def _quantize(src: Path, dst: Path) -> dict:
    result = CliRunner().invoke(
        main, ["quantize", str(src), str(dst), "--no-bench", "--report-json-stdout"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("measured", [True, False], ids=["measured", "predicted-only"])
def test_the_classes_measured_keep_the_quiet_layers_in_int4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: bool
) -> None:
    """The uniform int4 candidate misses (cosine about 0.82). Measured, the classes of ``q``
    cost the output nearly nothing and those of ``v`` all of it: the mix keeps every ``q`` in
    int4 and moves the ``v`` layers, in one candidate. Predicted only (every layer alike), the
    mix moves nearly every layer to int8: a larger model."""
    if not measured:
        monkeypatch.setattr(_classes, "MIN_LAYERS_PER_CLASS", 1e9)
    src = tmp_path / "blocks.onnx"
    onnx.save(repeated_blocks(), src)
    out = tmp_path / "q.onnx"
    data = _quantize(src, out)
    one_pass = data["one_pass"]
    assert [c["candidate"] for c in one_pass["candidates"]] == ["uniform", "mix"]
    classes = one_pass["classes"]
    nodes = data["options"]["quantize"]["nodes"]
    if measured:
        assert all(group["measured_loss"] is not None for group in classes["measured"])
        assert "scaled to their losses" in classes["note"]
        assert all(nodes[f"q{i}"]["bits"] == 4 for i in range(BLOCKS))
        assert all(nodes[f"v{i}"]["bits"] != 4 for i in range(BLOCKS))
    else:
        assert "not measured" in classes["note"]
        assert sum(setting["bits"] == 4 for setting in nodes.values()) < BLOCKS
    x = np.random.default_rng(3).standard_normal((2, 9, C)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for row in range(2):
        a, b = want[row].ravel().astype(np.float64), got[row].ravel().astype(np.float64)
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.99


def test_a_class_onnxruntime_cannot_run_lets_every_class_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second class's session fails: no class is applied, and the note names it."""
    from onnx_conv2matmul.quantize import check as _check

    real, calls = _check.check, []

    def failing(session: object, *args: object, **kwargs: object) -> object:
        checked = real(session, *args, **kwargs)  # type: ignore[arg-type]
        runs = kwargs.get("runs")
        if runs is not None and runs.only:  # type: ignore[attr-defined]
            calls.append(1)
            if len(calls) == 2:
                return _check.Checked([], False, None, "onnxruntime cannot run the candidate", 0.0)
        return checked

    monkeypatch.setattr(_check, "check", failing)
    src = tmp_path / "blocks.onnx"
    onnx.save(repeated_blocks(), src)
    data = _quantize(src, tmp_path / "q.onnx")
    classes = data["one_pass"]["classes"]
    assert "not measured" in classes["note"] and "onnxruntime cannot run" in classes["note"]
    assert all(group["measured_loss"] is None for group in classes["measured"])
