"""The default quantize run as one pass (quantize/onepass.py): the original measured once, at most
two candidates built in memory and checked (the classes of layers: tests/test_classes.py), the
result written once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from tests.test_accuracy import outlier_model

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize import build as _build
from onnx_conv2matmul.quantize import decide as _decide
from onnx_conv2matmul.quantize.measure import session_options
from onnx_conv2matmul.quantize.plan import Memos, Request, resolve
from onnx_conv2matmul.quantize.search_options import Setting
from onnx_conv2matmul.quantize.sensitivity import MatMulNode
from onnx_conv2matmul.quantize.settings import QuantizeOptions

CONFORMER = Path(__file__).parent / "data" / "conformer_small.onnx"
LENGTHS = (64, 128, 301)


def _quantize(src: Path, dst: Path, *extra: str, bench: bool = False) -> dict:
    """The CLI's quantize report; with ``bench``, the kernel choice and timing at 3 rounds."""
    timing = ["--bench-rounds", "3"] if bench else ["--no-bench"]
    result = CliRunner().invoke(
        main,
        ["quantize", str(src), str(dst), *timing, "--report-json-stdout", *extra],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _feed(length: int, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + length)
    return {
        "audio_signal": rng.standard_normal((1, 32, length)).astype(np.float32),
        "length": np.array([length], dtype=np.int64),
    }


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_a_model_that_meets_the_floor_takes_one_candidate_and_writes_once(tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    data = _quantize(CONFORMER, out)
    candidates = data["one_pass"]["candidates"]
    assert [c["candidate"] for c in candidates] == ["uniform"] and candidates[0]["passed"]
    assert data["one_pass"]["decision"] is None and data["auto"] is None
    assert "search" not in data["seconds_by_phase"] and data["seconds_by_phase"]["measure"] > 0
    written = sum(f.stat().st_size for f in tmp_path.iterdir())
    assert data["files"]["output_bytes"] == written  # nothing else left beside it
    assert written <= data["bytes_written"] < written + 2**20  # the result, plus the small reference
    model = onnx.load(out)
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)
    original = ort.InferenceSession(str(CONFORMER), providers=["CPUExecutionProvider"])
    result = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for length in LENGTHS:  # lengths the check never fed
        feed = _feed(length)
        want, got = original.run(None, feed), result.run(None, feed)
        assert _cosine(want[0], got[0]) >= 0.99
        np.testing.assert_array_equal(want[1], got[1])


def test_below_the_floor_two_candidates_and_the_mix_meets_it(tmp_path: Path) -> None:
    src = tmp_path / "outliers.onnx"
    onnx.save(outlier_model(), src)
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    data = _quantize(src, out)
    candidates = data["one_pass"]["candidates"]
    assert len(candidates) == 2 and not candidates[0]["passed"] and candidates[1]["passed"]
    assert "decision" not in candidates[0] and candidates[1]["decision"] == data["one_pass"]["decision"]
    assert data["quantized_nodes"] == 1 and sorted(os.listdir(out.parent)) == ["q.onnx"]
    x = np.random.default_rng(3).standard_normal((2, 9, 64)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for row in range(2):
        assert _cosine(want[row], got[row]) >= 0.99


@pytest.mark.parametrize("options", [QuantizeOptions(block_size=64), QuantizeOptions(bits=8, block_size=128)])
def test_a_candidate_in_memory_computes_what_its_file_does(tmp_path: Path, options: QuantizeOptions) -> None:
    plan = resolve(CONFORMER, tmp_path / "x.onnx", Request())
    candidate = _build.build(plan, options)
    path = tmp_path / "saved.onnx"
    import onnx_ir as ir

    in_memory = _build.open_in_memory(candidate.model, str(CONFORMER.parent), session_options(plan.verify))
    ir.save(candidate.model, path)
    saved = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in in_memory.get_outputs()] == [o.name for o in saved.get_outputs()]
    for length in LENGTHS:
        feed = _feed(length)
        for a, b in zip(in_memory.run(None, feed), saved.run(None, feed), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _sensitivity(errors: list[tuple[float, float]]) -> _decide.Sensitivity:
    """Nodes of 1,000 float bytes: int4 (100 bytes) and int8 (300 bytes) with the given errors."""
    int4, int8 = Setting(4, 64, False), Setting(8, 64, True)
    nodes = []
    for index, (e4, e8) in enumerate(errors):
        node = MatMulNode(f"n{index}", None, 64, 64, 1000)
        node.options = {int4: (e4, 100), int8: (e8, 300)}
        nodes.append(node)
    return _decide.Sensitivity(
        nodes, MatMulNode("(other weights)", None, 0, 0, 0), {n.name: int4 for n in nodes}
    )


def test_the_decision_moves_the_most_sensitive_layers_first_and_more_as_the_loss_grows() -> None:
    sens = _sensitivity([(0.5, 0.002), (0.1, 0.0004), (0.05, 0.0002), (0.05, 0.0002)])
    options = QuantizeOptions()
    near = _decide.decide(sens, options, 1.2)
    far = _decide.decide(sens, options, 3.0)
    assert near.options.nodes["n0"].bits == 8 and near.options.nodes["n3"].bits == 4
    assert near.predicted_error <= near.target_error and far.predicted_error <= far.target_error
    assert far.weight_bytes >= near.weight_bytes
    assert sum(s.bits == 8 for s in far.options.nodes.values()) >= sum(
        s.bits == 8 for s in near.options.nodes.values()
    )


def test_far_below_the_floor_int8_everywhere_comes_before_float() -> None:
    sens = _sensitivity([(0.5, 0.01)])
    first = _decide.decide(sens, QuantizeOptions(), 200.0)
    assert first.options.nodes["n0"].bits == 8
    # int8 everywhere missed too, by as much: no line reaches the floor; half the first aim.
    second = _decide.decide(sens, QuantizeOptions(), 200.0, missed=(first.predicted_error, 150.0))
    assert second.target_error == pytest.approx(_decide.AIM / 2 * 0.5 / 200.0)
    assert second.options.nodes["n0"].bits is None


def test_a_mix_that_missed_far_below_its_aim_is_not_made_again() -> None:
    """Far below the floor the first mix is int8 everywhere, its predicted error well under the
    aim; when it misses without a line to follow, the next aims below half its error, not at half
    the first aim, where the same mix came back (PP-OCRv4 rec with the Transposes, checked twice)."""
    sens = _sensitivity([(0.5, 0.001), (0.5, 0.0005)])
    first = _decide.decide(sens, QuantizeOptions(), 100.0)
    assert [s.bits for s in first.options.nodes.values()] == [8, 8]
    assert first.predicted_error < first.target_error / 2
    second = _decide.decide(sens, QuantizeOptions(), 100.0, missed=(first.predicted_error, 3.3))
    assert second.target_error == pytest.approx(first.predicted_error / 2)
    assert [second.options.nodes[n].bits for n in ("n0", "n1")] == [None, 8]


def test_with_int8_left_out_the_first_mix_still_moves_layers() -> None:
    """The speed filter left only int4 in every ladder (int8 slower than float on this CPU): the
    first mix aims where the line says, moving the most sensitive layers to float; before, the
    floor of every node's most accurate option was the uniform error itself, and the first mix
    was a copy of the uniform candidate (the Parakeet-shaped encoder: 0.98908, then 0.98896)."""
    int4 = Setting(4, 64, False)
    nodes = []
    for index, error in enumerate([0.4, 0.3, 0.2, 0.1]):
        node = MatMulNode(f"n{index}", None, 64, 64, 1000)
        node.options = {int4: (error, 100)}
        nodes.append(node)
    sens = _decide.Sensitivity(
        nodes, MatMulNode("(other weights)", None, 0, 0, 0), {n.name: int4 for n in nodes}
    )
    decision = _decide.decide(sens, QuantizeOptions(), 1.1)
    assert decision.target_error == pytest.approx(_decide.AIM * 1.0 / 1.1)
    assert decision.options.nodes["n0"].bits is None  # the most sensitive goes to float
    assert [decision.options.nodes[f"n{i}"].bits for i in (1, 2, 3)] == [4, 4, 4]


def test_after_a_mix_that_missed_the_next_aims_through_both_losses() -> None:
    sens = _sensitivity([(0.4, 0.002), (0.3, 0.0015), (0.2, 0.001), (0.1, 0.0005)])
    uniform_error = sens.uniform_error()
    first = _decide.decide(sens, QuantizeOptions(), 1.5)
    # The mix missed at 1.05: the line through (1.0, 1.5) and (first, 1.05) meets 0.9 further down.
    second = _decide.decide(sens, QuantizeOptions(), 1.5, missed=(first.predicted_error, 1.05))
    slope = (1.5 - 1.05) / (uniform_error - first.predicted_error)
    assert second.target_error == pytest.approx(first.predicted_error - (1.05 - 0.9) / slope)
    assert second.target_error > 0
    assert second.predicted_error <= second.target_error < first.predicted_error
    assert second.weight_bytes >= first.weight_bytes
    # A mix that measured worse than the uniform candidate gives no falling line: half the first
    # aim or half the missed mix's error, the lower, so that the same mix does not come back.
    odd = _decide.decide(sens, QuantizeOptions(), 1.5, missed=(first.predicted_error, 1.8))
    aim = _decide.AIM * uniform_error / 1.5
    assert odd.target_error == pytest.approx(min(aim, first.predicted_error) / 2)
    assert odd.predicted_error < first.predicted_error and odd.options.nodes != first.options.nodes


@pytest.fixture
def larger_blocks_cheaper(monkeypatch: pytest.MonkeyPatch, quiet_machine: None) -> None:
    """Kernel timings from a fake machine where block 256 at level 4 is the cheapest setting."""
    from onnx_conv2matmul.speed import costs as costs_module
    from speed_fakes import FakeClock, KernelMachine, int8_machine

    clock = FakeClock()
    machine = KernelMachine(clock, int8_machine(3.0))
    real = costs_module.KernelCosts

    def fake(*args: object, **kwargs: object) -> object:
        kwargs.update(read_cache=False, clock=clock, session_factory=machine)
        return real(None, **{k: v for k, v in kwargs.items() if k != "path"})

    monkeypatch.setattr(costs_module, "KernelCosts", fake)


def test_a_kernel_chosen_for_speed_that_misses_goes_to_the_mix_at_that_setting(
    tmp_path: Path, larger_blocks_cheaper: None
) -> None:
    """Block 256 level 4, the cheapest, misses the floor: the per-layer choice starts from it (its
    costs are the ones it trades against float), with no second uniform candidate at the most
    accurate setting (on the Parakeet-shaped encoder that one missed too, cost a build and a check,
    and block 64 level 0 ran 1.08x float there)."""
    src = tmp_path / "m.onnx"
    onnx.save(outlier_model(k=256), src)  # K = 256: block 256 pads nothing, and takes the fewest bytes
    out = tmp_path / "q.onnx"
    data = _quantize(src, out, bench=True)
    assert data["kernel_costs"]["winner"] != 0
    candidates = data["one_pass"]["candidates"]
    assert candidates[0]["candidate"] == "uniform" and not candidates[0]["passed"]
    assert all(c["candidate"].startswith("mix") for c in candidates[1:]) and candidates[-1]["passed"]
    settings = data["options"]["quantize"]
    assert (settings["block_size"], settings["accuracy_level"]) == (256, 4)
    x = np.random.default_rng(3).standard_normal((2, 9, 256)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for row in range(2):
        assert _cosine(want[row], got[row]) >= 0.99


def test_a_block_that_pads_k_into_more_bytes_is_not_costed(
    tmp_path: Path, larger_blocks_cheaper: None
) -> None:
    """K = 64: a block of 256 stores four times the values (133 bytes a column against 37): the
    default does not trade that size for a kernel a few percent faster (PLCMOS v2: 0.634x at block
    256, 0.591x at 64). The reason names what was left out."""
    src = tmp_path / "m.onnx"
    onnx.save(outlier_model(), src)
    out = tmp_path / "q.onnx"
    data = _quantize(src, out, bench=True)
    costs = data["kernel_costs"]
    assert {c["block_size"] for c in costs["candidates"]} == {64}
    assert "block 128 (1.86x block 64's bytes)" in costs["reason"]
    assert "block 256 (3.59x block 64's bytes)" in costs["reason"]
    assert data["options"]["quantize"]["block_size"] == 64


def _options(prepack: bool) -> object:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not prepack:  # borrowed, not copied (see quantize/build.py)
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


@pytest.mark.parametrize("prepack", [True, False])
def test_a_session_in_memory_takes_arrays_that_are_views(tmp_path: Path, prepack: bool) -> None:
    """An initializer whose array is a view (a moved axis, as int8 storage of other weights
    makes): onnxruntime borrows only C-contiguous buffers and refused the copy it would own
    ("Buffer containing the initializer must be owned by the user", exit 3 on a BERT)."""
    import onnx_ir as ir

    table = np.arange(2 * 64 * 300, dtype=np.float32).reshape(2, 64, 300)
    view = np.moveaxis(table, 2, 0)  # (300, 2, 64), not C-contiguous
    assert not view.flags.c_contiguous
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([300, 2, 64]))
    w = ir.Value(name="w", const_value=ir.Tensor(view, name="w"))
    w.type, w.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([300, 2, 64])
    add = ir.node("Add", [x, w])
    add.outputs[0].name = "y"
    add.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], add.outputs, nodes=[add], initializers=[w], opset_imports={"": 17})
    model = ir.Model(graph, ir_version=8)
    session = _build.open_in_memory(model, str(tmp_path), _options(prepack))
    feed = np.ones((300, 2, 64), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": feed})[0], feed + view)


@pytest.mark.parametrize("prepack", [True, False])
def test_a_session_in_memory_keeps_an_unused_initializer_out_of_its_hands(
    tmp_path: Path, prepack: bool
) -> None:
    """An initializer no node reads (silero VAD's dynamo export has one of 258 floats):
    onnxruntime drops it while it loads the graph, then failed to replace it with the array
    handed over ("Failed to find existing initializer", exit 3)."""
    import onnx_ir as ir

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4, 512]))
    used = ir.Value(name="w", const_value=ir.tensor(np.full((4, 512), 2.0, np.float32), name="w"))
    unused = ir.Value(name="val_7", const_value=ir.tensor(np.ones(600, np.float32), name="val_7"))
    for value, shape in ((used, [4, 512]), (unused, [600])):
        value.type, value.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(shape)
    mul = ir.node("Mul", [x, used])
    mul.outputs[0].name = "y"
    mul.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], mul.outputs, nodes=[mul], initializers=[used, unused], opset_imports={"": 17})
    session = _build.open_in_memory(ir.Model(graph, ir_version=8), str(tmp_path), _options(prepack))
    feed = np.ones((4, 512), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": feed})[0], 2 * feed)


def _resident_kib(path: Path) -> int:
    """This process's resident memory of its mappings of ``path`` (KiB)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                inside = line.rstrip().endswith(str(path))
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def _anonymous_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_session_that_does_not_prepack_borrows_a_mapped_weight_and_gives_its_pages_back(
    tmp_path: Path,
) -> None:
    """The classes' switched session (no prepacking) reads the int4 blocks where they lie, memory-
    mapped from the scratch folder: onnxruntime copied every array handed over as an external
    initializer (0.6 GB of the Parakeet-shaped encoder's peak). Borrowed, the weight costs no
    memory of the process's own, and :func:`release_borrowed` gives its pages back after a run
    (read again from the file by the next run, which computes the same)."""
    import onnx_ir as ir

    rng = np.random.default_rng(0)
    stored = tmp_path / "w.npy"
    np.save(stored, rng.standard_normal((2048, 2048)).astype(np.float32))  # 16 MiB
    weight = np.load(stored, mmap_mode="r")
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3, 2048]))
    w = ir.Value(name="w", const_value=ir.tensor(weight, name="w"))
    w.type, w.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([2048, 2048])
    matmul = ir.node("MatMul", [x, w])
    matmul.outputs[0].name = "y"
    matmul.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], matmul.outputs, nodes=[matmul], initializers=[w], opset_imports={"": 17})
    feed = rng.standard_normal((3, 2048)).astype(np.float32)
    want = feed.astype(np.float64) @ np.asarray(weight, np.float64)

    before = _anonymous_kib()
    session = _build.open_in_memory(ir.Model(graph, ir_version=8), str(tmp_path), _options(prepack=False))
    assert _anonymous_kib() - before < 8 * 1024  # a copy would be 16 MiB
    np.testing.assert_allclose(session.run(None, {"x": feed})[0], want, rtol=1e-4, atol=1e-3)
    assert _resident_kib(stored) > 8 * 1024  # read where it lies
    _build.release_borrowed(session)
    assert _resident_kib(stored) < 1024
    np.testing.assert_allclose(session.run(None, {"x": feed})[0], want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(("opset", "offered"), [(12, False), (13, True)])
def test_the_one_pass_offers_int8_other_weights_only_where_dequantize_linear_reads_them(
    opset: int, offered: bool
) -> None:
    """Below opset 13 the other weights would be read through Cast and Mul: the one pass, which
    only predicts their error, leaves them to the search, which measures it (PP-OCRv4 rec's convs
    in int8 predict little and cost cosine 0.973: its one pass then met the criterion nowhere)."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    conv = numpy_helper.from_array(rng.standard_normal((128, 64, 3)).astype(np.float32), "wide")  # 96 KiB
    mm = numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "wide"], ["c"], pads=[1, 1], name="conv"),
            helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["t", "w"], ["y"], name="mm"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 64])],
        [conv, mm],
    )
    model = ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    )
    sens = _decide.sensitivity(model, QuantizeOptions(), {})
    assert [n.name for n in sens.nodes] == ["mm"]
    assert bool(sens.others.options) is offered


def _conv_then_matmuls(path: Path) -> None:
    """A 3-tap conv (96 KiB of other weights, opset 13) before two MatMuls of 128x64 and 64x64."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((128, 64, 3)).astype(np.float32), "wide"),
        numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "wide"], ["c"], pads=[1, 1], name="conv"),
            helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["t", "w1"], ["h"], name="mm1"),
            helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 64])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_a_mix_that_missed_with_the_other_weights_in_int8_is_checked_again_with_them_in_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their predicted error is their weights' alone (PP-OCRv5 rec: the mix with its other convs
    in int8 measured 0.9897, the same MatMuls with them in float 0.9920): after a mix that stored
    them in int8 and missed, the next candidate keeps them in float and the MatMuls as they were,
    rather than moving MatMuls on a line that their error bent."""
    import dataclasses

    from onnx_conv2matmul.quantize import onepass

    src, out = tmp_path / "model.onnx", tmp_path / "out.onnx"
    _conv_then_matmuls(src)
    real = onepass._check.check_model
    seen: list[bool] = []
    orders: list[Any] = []

    def checked_as_below(plan: Any, model: Any, reference: Any, **kwargs: Any) -> Any:
        result = real(plan, model, reference, **kwargs)
        if kwargs.get("runs") is not None and kwargs["runs"].only:
            return result  # the classes' short runs
        seen.append(any(node.op_type == "DequantizeLinear" for node in model.graph))
        orders.append(kwargs.get("runs"))
        worst = {1: 0.95, 2: 0.985}.get(len(seen), 0.995)  # the uniform, the mix, then one that meets it
        met = worst >= 0.99
        # The mix stopped at the first feed that missed, as a later candidate does.
        stopped: dict[str, Any] = {"stopped": True, "samples": (1, 3)} if len(seen) == 2 else {}
        failure = "" if met else "y"
        return dataclasses.replace(result, worst_cosine=worst, passed=met, failure=failure, **stopped)

    monkeypatch.setattr(onepass._check, "check_model", checked_as_below)
    data = _quantize(src, out)
    candidates = data["one_pass"]["candidates"]
    assert [c["candidate"] for c in candidates] == ["uniform", "mix", "mix, other weights in float"]
    assert [c.get("stopped_after_samples") for c in candidates] == [None, [1, 3], None]
    schema = json.loads((Path(__file__).parent.parent / "schema" / "report.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(data)  # the report says so as its schema allows
    assert seen == [False, True, False]
    # The first runs every feed; the later ones the first's worst feeds first.
    assert orders[0] is None and orders[1] is not None and orders[1] == orders[2]
    assert candidates[1]["settings"] == candidates[2]["settings"]  # the MatMuls as they were
    mix, kept = candidates[1]["decision"], candidates[2]["decision"]
    assert kept["weight_bytes"] > mix["weight_bytes"] and kept["predicted_error"] < mix["predicted_error"]
    assert data["options"]["quantize"]["other_weights"] == "keep"
    written = onnx.load(str(out))
    assert not [n for n in written.graph.node if n.op_type == "DequantizeLinear"]
    assert [n.name for n in written.graph.node if n.op_type == "MatMulNBits"]


def test_a_decision_that_keeps_the_other_weights_in_float_has_no_such_candidate() -> None:
    import dataclasses

    from onnx_conv2matmul.quantize.settings import NodeSetting

    sens = _sensitivity([(0.5, 0.002), (0.1, 0.0004)])
    assert _decide.others_in_float(_decide.decide(sens, QuantizeOptions(), 1.5), sens) is None
    sens.others.float_bytes = 4000
    sens.others.options = {_decide.OTHER_INT8: (1e-6, 1000)}
    decision = _decide.decide(sens, QuantizeOptions(), 1.5)
    assert decision.options.other_weights == "int8"
    kept = _decide.others_in_float(decision, sens)
    assert kept is not None and kept.options.other_weights == "keep"
    every_float = dataclasses.replace(
        decision,
        options=decision.options.only({n: NodeSetting(None, 64, False) for n in ("n0", "n1")}, "int8"),
    )
    assert _decide.others_in_float(every_float, sens) is None  # it would quantize nothing
    assert kept.options.nodes == decision.options.nodes
    assert kept.weight_bytes == decision.weight_bytes + 3000
    assert kept.predicted_error == pytest.approx(decision.predicted_error - 1e-6)


def _with_external_data(tmp_path: Path) -> tuple[Any, list[Any]]:
    """:func:`_conv_then_matmuls` saved with its weights in a data file, loaded by onnx-ir (each
    weight mapped when read), and its three weights."""
    import onnx_ir as ir

    src = tmp_path / "external.onnx"
    _conv_then_matmuls(src)
    onnx.save(onnx.load(str(src)), str(src), save_as_external_data=True, location="external.data")
    model = ir.load(str(src))
    weights = [v.const_value for v in model.graph.initializers.values()]
    assert len(weights) == 3 and all(isinstance(w, ir.ExternalTensor) for w in weights)
    return model, weights


def test_the_other_weights_error_leaves_no_data_file_mapped(tmp_path: Path) -> None:
    """onnx-ir maps a weight's whole data file to read it: each other weight read for its int8
    error is let go after, else every one holds the file's size of address space (the 2.31 GiB
    encoder went over a 7 GB limit of ``prlimit --as`` there)."""
    from onnx_conv2matmul.quantize.sensitivity import _other_weights_error

    model, weights = _with_external_data(tmp_path)
    found = _other_weights_error(model)
    assert found is not None and found[1] == 128 * 64 * 3 * 4  # the conv's weight, read
    assert all(tensor.raw is None for tensor in weights)


def test_a_models_digest_leaves_no_data_file_mapped(tmp_path: Path) -> None:
    """The search's digest of a model reads every weight: those it mapped to read are let go after
    (the 2.31 GiB encoder's --auto went over a 7 GB limit of ``prlimit --as`` there), and the
    digest is the same as from the weights in memory."""
    import onnx_ir as ir

    from onnx_conv2matmul.quantize.search_runs import model_digest

    src = tmp_path / "model.onnx"
    _conv_then_matmuls(src)
    in_memory = model_digest(ir.load(str(src)))
    model, weights = _with_external_data(tmp_path)
    assert model_digest(model) == in_memory
    assert all(tensor.raw is None for tensor in weights)
    assert model_digest(model) == in_memory  # read again after being let go


@pytest.mark.parametrize(
    ("prefer_size", "block", "then"),
    [(True, 256, 64), (True, 64, None), (True, 32, None), (False, 256, None)],
)
def test_prefer_size_goes_on_at_the_default_block_when_a_larger_one_missed(
    prefer_size: bool, block: int, then: int | None
) -> None:
    """--prefer size makes its uniform candidate at the block of the fewest bytes; when that one
    is larger than the default's and misses, the mix is decided at the default block, more
    accurate (openWakeWord's hey jarvis: 0.27x from a mix at block 128, 0.16x at 64)."""
    from types import SimpleNamespace

    from onnx_conv2matmul.quantize.onepass import _size_block

    run = SimpleNamespace(
        plan=SimpleNamespace(request=Request(smallest=prefer_size)),
        quantize=QuantizeOptions(block_size=block, accuracy_level=0),
    )
    smaller = _size_block(run)  # type: ignore[arg-type]
    assert (None if smaller is None else smaller.block_size) == then
    if smaller is not None:
        assert smaller == QuantizeOptions(block_size=64, accuracy_level=0)


@pytest.mark.parametrize("missed", [False, True], ids=["one pass", "one pass missed"])
def test_a_run_whose_one_pass_already_missed_goes_straight_to_the_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missed: bool
) -> None:
    """A layout of the Transposes' trade made as a candidate first and missed there is searched
    with ``one_pass_missed``: its one pass is not made a second time (no uniform candidate built
    or checked again), the search below the floor chooses, and its model meets the floor. The
    search keeps the losses it measures alone in the run's store (the request's ``losses``),
    under the model's source and rewrite."""
    from onnx_conv2matmul.files.progress import NullProgress
    from onnx_conv2matmul.quantize import search as _search
    from onnx_conv2matmul.quantize.workflow import quantize_file

    real, stores = _search.search, []

    def search(*args: Any, **kwargs: Any) -> Any:
        stores.append(kwargs["losses"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_search, "search", search)

    class Phases(NullProgress):
        def __init__(self) -> None:
            self.names: list[str] = []

        def phase(self, name: str) -> None:
            self.names.append(name)

    src = tmp_path / "outliers.onnx"
    onnx.save(outlier_model(), src)
    progress = Phases()
    losses: dict[Any, float] = {}
    request = Request(progress=progress, one_pass_missed=missed, memos=Memos(losses=losses))
    report = quantize_file(src, tmp_path / "q.onnx", request)
    checked = [name for name in progress.names if name.startswith("Checking the candidate")]
    searched = [name for name in progress.names if name.startswith("Evaluating configuration")]
    assert report.passed and report.quantized_nodes == 1
    assert (not checked, bool(searched)) == (missed, missed)
    assert (report.one_pass is None) is missed
    assert any("the search chose the settings" in w for w in report.warnings) is missed
    assert [store[1] is losses and store[0][0] == str(src) for store in stores] == [True] * missed


def test_the_trade_asks_a_layout_for_the_one_pass_alone_or_for_the_search_straight_away() -> None:
    from onnx_conv2matmul.rewrite.options import ConvertOptions

    convert = ConvertOptions()
    one_pass = Request().again(convert, search=False)
    assert one_pass.candidate and not one_pass.one_pass_missed and one_pass.nested
    search = Request().again(convert, search=True)
    assert not search.candidate and search.one_pass_missed
    as_asked = Request().again(convert)
    assert not as_asked.candidate and not as_asked.one_pass_missed
    # A candidate of another run stays one: it never searches below the floor.
    again = Request(candidate=True).again(convert, search=True)
    assert again.candidate and not again.one_pass_missed


class _Session:
    """A candidate's session: its outputs are the feed's own, except on ``bad`` feeds (reversed:
    a cosine far below any floor); it counts its runs."""

    def __init__(self, bad: set[int]) -> None:
        self.bad, self.runs = bad, []  # type: ignore[var-annotated]

    def run(self, names: Any, feed: dict[str, np.ndarray], options: Any = None) -> list[np.ndarray]:
        index = int(feed["x"][0, 0])
        self.runs.append(index)
        x = feed["x"]
        return [x[:, ::-1].copy() if index in self.bad else x.copy()]


def _reference(tmp_path: Path, n: int) -> Any:
    from onnx_conv2matmul.quantize.reference import FeedSet, Reference

    rng = np.random.default_rng(0)
    feeds = []
    for i in range(n):
        x = rng.standard_normal((1, 16)).astype(np.float32) + 3.0
        x[0, 0] = i  # the feed's number, read by _Session
        feeds.append({"x": x})
    reference = Reference(str(tmp_path), ["y"], FeedSet(feeds, list(range(1, n + 1)), "test"))
    for i, feed in enumerate(feeds):
        reference.put(i, [feed["x"]])
    return reference


def test_a_later_candidate_runs_the_worst_feeds_first_and_stops_at_the_first_miss(tmp_path: Path) -> None:
    """The one pass's candidates after the first: the feeds the first found worst go first, and
    a feed that misses ends the check (the candidate fails whatever the rest give: PP-OCRv4 rec's
    mixes took 1.8 s each on 35 lines). One that passes runs every feed, its rows in feed order."""
    from onnx_conv2matmul.quantize import check as _check
    from onnx_conv2matmul.verify.check import VerifyOptions

    reference, verify = _reference(tmp_path, 6), VerifyOptions(min_cosine=0.99)
    first = _check.check(_Session({4}), reference, verify)
    assert not first.passed and not first.stopped and first.indices == list(range(6))
    order = first.worst_first()
    assert order.indices[0] == 4 and sorted(order.indices) == list(range(6)) and not order.only

    session = _Session({4, 5})
    later = _check.check(session, reference, verify, runs=order)
    assert session.runs == [4] and later.stopped and not later.passed
    assert later.samples == (1, 6) and later.indices == [4] and later.labels == []
    assert later.worst_cosine is not None and later.worst_cosine < 0.99 and later.failure

    session = _Session(set())
    passed = _check.check(session, reference, verify, runs=_check.Runs((5, 4)))
    assert session.runs[:2] == [5, 4] and sorted(session.runs) == list(range(6))
    assert passed.passed and not passed.stopped and passed.indices == list(range(6))
    assert [rows[0].length for rows in passed.rows] == list(range(1, 7))  # as verify reports them

    session = _Session({0})  # the miss comes last in the order: every feed was run, none left
    last = _check.check(session, reference, verify, runs=_check.Runs((1, 2, 3, 4, 5, 0)))
    assert not last.passed and not last.stopped and last.samples == (6, 6)

    session = _Session({2})  # the classes' short runs: those feeds alone, each to the end
    short = _check.check(session, reference, verify, runs=_check.Runs((3, 2, 1), only=True))
    assert session.runs == [3, 2, 1] and short.indices == [1, 2, 3] and not short.stopped


def test_only_a_candidate_the_mix_is_not_decided_from_stops_at_its_first_miss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first candidate runs every feed; a mix after it runs them worst first and may stop; a
    second uniform candidate (--prefer size's, at the default block) gathers the statistics and
    the loss the mix is decided from, so it runs every feed too."""
    from types import SimpleNamespace

    from onnx_conv2matmul.quantize import check as _check
    from onnx_conv2matmul.quantize import onepass

    asked: list[Any] = []

    def check_model(plan: Any, model: Any, reference: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("runs"))
        rows = [[SimpleNamespace(worst_cosine=c)] for c in (0.99, 0.9, 0.95)]
        return _check.Checked(rows, False, 0.9, "x", 0.0, indices=[0, 1, 2])  # type: ignore[arg-type]

    monkeypatch.setattr(onepass._check, "check_model", check_model)
    one = onepass.OnePass(
        SimpleNamespace(plan=SimpleNamespace(request=Request()), quantize=None), None, False
    )  # type: ignore[arg-type]
    one.measurement = SimpleNamespace(reference=None)  # type: ignore[assignment]
    candidate = SimpleNamespace(model=None, result=SimpleNamespace(settings={}))
    one._checked(candidate, ["a"], "uniform")  # type: ignore[arg-type]
    one._checked(candidate, ["a"], "uniform, block 64")  # type: ignore[arg-type]
    one._checked(candidate, [], "mix")  # type: ignore[arg-type]
    assert asked[:2] == [None, None]
    assert asked[2] == _check.Runs((1, 2, 0))


def test_a_step_back_does_not_check_the_same_uniform_candidate_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A held-out miss steps back with a stricter minimum cosine. The uniform candidate of the
    same input, rewrite, settings and feeds missed the looser one, so it misses this one too: the
    earlier check is read back (PP-OCRv4 rec with 35 real lines: 1.4 s) and the report's row says
    so. A looser floor, other settings, a mix, or a candidate that passed are checked again."""
    from types import SimpleNamespace

    from onnx_conv2matmul.quantize import check as _check
    from onnx_conv2matmul.quantize import onepass
    from onnx_conv2matmul.quantize.reference import FeedSet

    calls: list[tuple[float, str]] = []

    def check_model(plan: Any, model: Any, reference: Any, **kwargs: Any) -> Any:
        calls.append((plan.verify.min_cosine, model))
        passed = model == "passes"
        rows = [[SimpleNamespace(worst_cosine=0.995 if passed else 0.95)]]
        return _check.Checked(rows, passed, rows[0][0].worst_cosine, "" if passed else "x", 1.5, indices=[0])  # type: ignore[arg-type]

    monkeypatch.setattr(onepass._check, "check_model", check_model)
    memos = Memos()
    feeds = FeedSet([{"x": np.zeros((1, 2), np.float32)}], [1], "given")

    def check(floor: float, settings: str, statistics: list[str] = ["a"]) -> dict[str, Any]:  # noqa: B006
        plan = SimpleNamespace(
            request=Request(memos=memos), verify=SimpleNamespace(min_cosine=floor), src="m", convert="c"
        )
        one = onepass.OnePass(SimpleNamespace(plan=plan, quantize=settings), None, False)  # type: ignore[arg-type]
        one.measurement = SimpleNamespace(reference=SimpleNamespace(feeds=feeds))  # type: ignore[assignment]
        candidate = SimpleNamespace(model=settings, result=SimpleNamespace(settings={}))
        one._checked(candidate, statistics, "uniform")  # type: ignore[arg-type]
        return one.candidates[-1]

    first = check(0.99, "int4")
    assert calls == [(0.99, "int4")] and "checked_before" not in first and first["seconds"] == 1.5
    again = check(0.995, "int4")  # the step back's stricter floor
    assert calls == [(0.99, "int4")]
    assert again["checked_before"] is True and again["seconds"] == 0.0 and not again["passed"]
    assert again["worst_cosine"] == first["worst_cosine"]
    check(0.98, "int4")  # a looser floor could be met
    check(0.995, "int4 block 32")  # another candidate
    check(0.995, "int4", statistics=[])  # a mix gathers no statistics: never read back
    check(0.99, "passes")
    check(0.995, "passes")  # what passed may miss a stricter floor
    assert calls[1:] == [
        (0.98, "int4"),
        (0.995, "int4 block 32"),
        (0.995, "int4"),
        (0.99, "passes"),
        (0.995, "passes"),
    ]
