"""``--int8-dynamic`` as one pass (``quantize/int8_step.py``): per-channel scales first, per
tensor next, then a step back that leaves in float the nodes whose measured loss sinks the rest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize.int8_step import MAX_UNITS, groups_of

D = 48


def _chain(bad: int, layers: int = 4, seed: int = 0) -> onnx.ModelProto:
    """``x [B, T, D]`` through ``layers`` MatMuls with a Relu between them. Layer ``bad``'s weight
    has a row of 60s in every column, read from an input channel scaled by 1e-3: that row adds
    little to the output, but it sets every column's int8 scale, so per channel as per tensor the
    other weights fall to a few levels and the layer's output is ruined."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    current = "x"
    for index in range(layers):
        weight = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
        if index == bad:
            weight[0, :] = 60.0
            scale = np.ones(D, np.float32)
            scale[0] = 1e-3
            inits.append(numpy_helper.from_array(scale, f"s{index}"))
            nodes.append(helper.make_node("Mul", [current, f"s{index}"], [f"m{index}"], name=f"scale{index}"))
            current = f"m{index}"
        inits.append(numpy_helper.from_array(weight, f"W{index}"))
        out = "y" if index == layers - 1 else f"h{index}"
        nodes.append(helper.make_node("MatMul", [current, f"W{index}"], [out], name=f"layer{index}"))
        if index < layers - 1:
            nodes.append(helper.make_node("Relu", [out], [f"r{index}"], name=f"relu{index}"))
            current = f"r{index}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", D])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _saved_chain(tmp_path: Path, bad: int) -> tuple[Path, Path]:
    """:func:`_chain` saved in ``tmp_path``, and the output path beside it."""
    src = tmp_path / "chain.onnx"
    onnx.save(_chain(bad), src)
    return src, tmp_path / "out.onnx"


def _int8_nodes(path: Path) -> int:
    return sum(n.op_type == "MatMulInteger" for n in onnx.load(path).graph.node)


def _quantize(src: Path, out: Path, *more: str) -> tuple[int, dict]:
    result = CliRunner().invoke(
        main,
        ["quantize", str(src), str(out), "--int8-dynamic", "--no-bench", "--report-json-stdout", *more],
        catch_exceptions=False,
    )
    return result.exit_code, json.loads(result.stdout)


def _cosines(src: Path, out: Path) -> list[float]:
    """The worst per-row cosine of the two models' outputs at several lengths, in onnxruntime."""
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    worst = []
    for length in (1, 7, 64, 193):
        x = rng.standard_normal((2, length, D)).astype(np.float32)
        ya, yb = a.run(None, {"x": x})[0], b.run(None, {"x": x})[0]
        cos = [
            float(np.dot(p.ravel(), q.ravel()) / (np.linalg.norm(p) * np.linalg.norm(q)))
            for p, q in zip(ya, yb, strict=True)
        ]
        worst.append(min(cos))
    return worst


@pytest.mark.parametrize("bad", [0, 2])
def test_the_step_back_leaves_the_node_that_sinks_the_rest_in_float(tmp_path: Path, bad: int) -> None:
    src, out = _saved_chain(tmp_path, bad)
    code, data = _quantize(src, out)
    assert code == 0, data["error"]
    made = [(c["candidate"], c["passed"]) for c in data["one_pass"]["candidates"]]
    assert made[:2] == [("int8 per channel", False), ("int8 per tensor", False)]
    decision = data["one_pass"]["decision"]
    mode = decision["mode"]  # the scales of the two whole candidates that lost less
    assert [label for label, _ in made[2:6]] == [f"int8 {mode}: layer{i} alone" for i in range(4)]
    assert made[6:] == [(f"int8 {mode}, 3 of 4 nodes", True)]
    assert decision["kept"] == [f"layer{i}" for i in range(4) if i != bad]
    losses = {m["nodes"][0]: m["loss"] for m in decision["measured"]}
    assert losses[f"layer{bad}"] > 1 > max(v for k, v in losses.items() if k != f"layer{bad}")
    # The graph: the bad layer a float MatMul still, the three others int8.
    model = onnx.load(out)
    ops = {n.name: n.op_type for n in model.graph.node}
    assert ops[f"layer{bad}"] == "MatMul"
    assert sum(op == "MatMulInteger" for op in ops.values()) == 3
    assert data["quantized_nodes"] == 3
    assert data["verification"]["passed"]
    assert min(_cosines(src, out)) >= 0.99
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.onnx", "out.onnx"]


def test_a_model_int8_per_channel_meets_the_floor_makes_one_candidate(tmp_path: Path) -> None:
    src, out = _saved_chain(tmp_path, -1)
    code, data = _quantize(src, out)
    assert code == 0
    assert [c["candidate"] for c in data["one_pass"]["candidates"]] == ["int8 per channel"]
    assert data["one_pass"]["candidates"][0]["settings"] == {"int8 per channel": 4}
    assert data["one_pass"]["decision"] is None
    # The final check reports the candidate's rows: the model is not run again.
    assert any("it was not run again" in w for w in data["verification"]["warnings"])
    assert min(_cosines(src, out)) >= 0.99
    assert _int8_nodes(out) == 4


def test_a_floor_of_minus_one_keeps_the_first_candidate(tmp_path: Path) -> None:
    src, out = _saved_chain(tmp_path, 1)
    code, data = _quantize(src, out, "--min-cosine", "-1")
    assert code == 0
    assert [c["candidate"] for c in data["one_pass"]["candidates"]] == ["int8 per channel"]
    assert data["one_pass"]["candidates"][0]["worst_cosine"] < 0.9  # what the floor accepts
    assert _int8_nodes(out) == 4


def test_a_refusal_leaves_nothing_behind(tmp_path: Path) -> None:
    """Every subset misses a floor of 0.999999: exit 2, no output, no scratch."""
    src, out = _saved_chain(tmp_path, 0)
    code, data = _quantize(src, out, "--min-cosine", "0.9999999")
    assert code == 2
    assert data["error"].startswith("int8 dynamic quantization misses the accuracy criterion")
    assert "its 4 quantizable nodes" in data["error"] and "no set of them met it" in data["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.onnx"]


@given(st.integers(0, 40), st.integers(1, 12))
def test_groups_are_consecutive_even_and_at_most_the_count(length: int, count: int) -> None:
    names = [f"n{i}" for i in range(length)]
    groups = groups_of(names, count)
    assert [n for g in groups for n in g] == names
    assert len(groups) == min(count, length)
    sizes = [len(g) for g in groups]
    assert not sizes or max(sizes) - min(sizes) <= 1
    assert all(sizes)


def test_the_step_back_measures_at_most_max_units_groups() -> None:
    assert len(groups_of([f"n{i}" for i in range(100)])) == MAX_UNITS


def test_a_model_with_nothing_int8_says_so(tmp_path: Path) -> None:
    """A 3x3 conv alone: int8 dynamic leaves Conv in float, so nothing is int8, and the warning
    says why, with the share of the weights in convs."""
    weight = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 8, "H", "W"])],
        [numpy_helper.from_array(weight, "W")],
    )
    src, out = tmp_path / "conv.onnx", tmp_path / "out.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    code, data = _quantize(src, out)
    assert code == 0 and data["quantized_nodes"] == 0
    warning = next(w for w in data["warnings"] if w.startswith("no node was quantized"))
    assert "not Conv" in warning and "100% of its float weights are in other Conv nodes" in warning


def test_bytes_written_counts_every_candidate_made(tmp_path: Path) -> None:
    """The step back made seven candidates (each removed but the one kept), the reference files and
    the rewritten fp32 copy: all of them are in ``bytes_written``."""
    src, out = _saved_chain(tmp_path, 1)
    code, data = _quantize(src, out)
    assert code == 0 and len(data["one_pass"]["candidates"]) == 7
    assert data["bytes_written"] > 7 * out.stat().st_size + src.stat().st_size * 0.9


def test_a_held_out_miss_chooses_again_with_a_stricter_aim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--inputs``, the first int8 result misses on the held-out samples (their check made
    strict here): the run steps back as a default run does, choosing again against the stricter
    minimum cosine the miss asks for, and its second result is confirmed. Before, ``--int8-dynamic``
    never stepped back: exit 1."""
    import dataclasses

    from onnx_conv2matmul.quantize import check_publish

    src, out = _saved_chain(tmp_path, -1)
    x = np.random.default_rng(2).standard_normal((40, 5, D)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    real, calls = check_publish.verify_models, []

    def strict_once(original: str, candidate: str, options: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            options = dataclasses.replace(options, min_cosine=0.9999999)  # type: ignore[type-var]
        return real(original, candidate, options)  # type: ignore[arg-type]

    monkeypatch.setattr(check_publish, "verify_models", strict_once)
    code, data = _quantize(src, out, "--inputs", str(tmp_path / "x.npz"))
    assert code == 0, data["error"]
    held = data["accuracy"]["held_out"]
    assert len(calls) == 2 and held["passed"] and len(held["steps"]) == 1
    assert held["chosen_with_min_cosine"] > 0.99
    assert any("held-out" in w or "held out" in w for w in data["warnings"])
    assert _int8_nodes(out) == 4


def test_a_held_out_step_back_with_nothing_left_ends_as_the_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stricter aim leaves int8 nothing to take (a refusal, exit 2 on its own): the run ends as
    the held-out miss it stepped back from, exit 1, and nothing is written."""
    import dataclasses

    from onnx_conv2matmul.errors import ModeRefused
    from onnx_conv2matmul.quantize import check_publish, int8_step

    src, out = _saved_chain(tmp_path, -1)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(2).standard_normal((40, 5, D)).astype(np.float32))
    real_verify, real_choose, chosen = check_publish.verify_models, int8_step.Int8Pass.choose, []

    def strict(original: str, candidate: str, options: object) -> object:
        options = dataclasses.replace(options, min_cosine=0.9999999)  # type: ignore[type-var]
        return real_verify(original, candidate, options)  # type: ignore[arg-type]

    def refuse_again(self: int8_step.Int8Pass) -> object:
        chosen.append(1)
        if len(chosen) > 1:
            raise ModeRefused("int8 dynamic quantization misses the accuracy criterion (test)")
        return real_choose(self)

    monkeypatch.setattr(check_publish, "verify_models", strict)
    monkeypatch.setattr(int8_step.Int8Pass, "choose", refuse_again)
    code, data = _quantize(src, out, "--inputs", str(tmp_path / "x.npz"))
    assert code == 1 and len(chosen) == 2 and not out.exists()
    assert data["accuracy"]["held_out"]["passed"] is False
