"""Gemm with a constant weight becomes MatMul (+ Mul) (+ Add), exactly.

Each rewrite is run against the original in onnxruntime (optimizations off) at several
values of M, in float32 and float16, and the graph is checked: no Gemm left, each MatMul
reads a 2-D initializer at input B, an Add exactly when C is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    GEMM_C_SHAPES,
    NP_TYPES,
    all_initializers,
    all_nodes,
    assert_equivalent,
    assert_matmul_weights_2d,
    examples,
    gemm_model,
    no_bench,
    op_types,
    random_feeds,
    run,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert
from onnx_conv2matmul.cli.app import main

FP = [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE]


def _check_rewrite(model: onnx.ModelProto, *, gemms: int = 1) -> tuple[onnx.ModelProto, list[str]]:
    """Convert ``model``, prove it exact on random inputs at several M, check the graph."""
    rewritten, report = convert(model)
    onnx.checker.check_model(rewritten, full_check=True)
    assert [e.status for e in report.entries] == [Status.CONVERTED] * gemms
    assert report.op_type_counts == {"Gemm": {"nodes": gemms, "converted": gemms}}
    ops = op_types(rewritten)
    assert "Gemm" not in ops
    assert_matmul_weights_2d(rewritten, gemms)
    dtype = NP_TYPES[model.graph.input[0].type.tensor_type.elem_type]
    assert_equivalent(model, rewritten, random_feeds(model), dtype=dtype)
    return rewritten, ops


@pytest.mark.parametrize("dtype", FP, ids=["fp32", "fp16", "fp64"])
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"trans_b": False},
        {"trans_a": True},
        {"trans_a": True, "trans_b": False},
        {"c": None},
        *({"c": shape} for shape in GEMM_C_SHAPES),
        {"c": "N", "c_source": "input"},
        {"alpha": 0.5},
        {"alpha": -1.75, "beta": 0.3},
        {"beta": 2.0, "c": "MN"},
        {"alpha": 0.0},
        {"weight_source": "constant"},
        {"weight_source": "constant", "trans_b": False},
        {"k": 1, "n": 1},
        {"k": 33, "n": 17, "trans_a": True, "alpha": 0.1, "beta": -1.0, "c": "M1"},
        {"opset": 7},
        {"opset": 11, "c": None},
    ],
    ids=repr,
)
def test_exact(config: dict[str, object], dtype: int) -> None:
    model = gemm_model(dtype=dtype, **config)  # type: ignore[arg-type]
    rewritten, ops = _check_rewrite(model)
    node = model.graph.node[-1]
    has_c = len(node.input) > 2
    assert ops.count("Add") == int(has_c)
    scaled = [config.get("alpha", 1.0) != 1, has_c and config.get("beta", 1.0) != 1]
    assert ops.count("Mul") == sum(scaled)
    assert ops.count("Transpose") == int(bool(config.get("trans_a")))
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMul")
    assert matmul.name == "fc/MatMul"
    weight = all_initializers(rewritten.graph)[matmul.input[1]]
    k, n = int(config.get("k", 6)), int(config.get("n", 5))  # type: ignore[call-overload]
    assert list(weight.dims) == [k, n]
    assert weight.data_type == dtype


def test_untransposed_initializer_feeds_the_matmul_itself() -> None:
    """transB=0: B is already [K, N]; the MatMul reads it, nothing is copied."""
    model = gemm_model(trans_b=False)
    rewritten, _ = _check_rewrite(model)
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMul")
    assert matmul.input[1] == "B"
    assert sorted(t.name for t in rewritten.graph.initializer) == ["B", "C"]


def test_transposed_weight_replaces_the_original() -> None:
    model = gemm_model(trans_b=True)
    rewritten, report = convert(model)
    assert sorted(t.name for t in rewritten.graph.initializer) == ["B_matmul", "C"]
    assert report.tensors_removed == 1
    w = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_array_equal(numpy_helper.to_array(rewritten.graph.initializer[1]), w.T)


def test_beta_zero_does_not_read_c() -> None:
    """beta 0: onnxruntime's Gemm does not read C (a NaN there does not show), nor does the MatMul form."""
    model = gemm_model(beta=0.0)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(5, np.nan, np.float32), "C"))
    rewritten, ops = _check_rewrite(model)
    assert ops == ["MatMul"]
    assert [t.name for t in rewritten.graph.initializer] == ["B_matmul"]  # C is gone too
    out = run(rewritten, random_feeds(model)[1])[0]
    assert np.isfinite(out).all()


def test_alpha_zero_keeps_nan_of_infinite_inputs() -> None:
    """alpha 0: onnxruntime's Gemm still multiplies (inf * 0 is NaN); the Mul does the same."""
    model = gemm_model(alpha=0.0)
    rewritten, _ = convert(model)
    a = np.ones((2, 6), np.float32)
    a[0, 0] = np.inf
    expected, actual = run(model, {"a": a})[0], run(rewritten, {"a": a})[0]
    np.testing.assert_array_equal(np.isnan(expected), np.isnan(actual))
    assert np.isnan(expected[0]).all() and not np.isnan(expected[1]).any()
    np.testing.assert_array_equal(expected[1], actual[1])


def _two_gemms(trans: tuple[bool, bool], *, reader: str | None = None) -> onnx.ModelProto:
    """Two Gemms reading one initializer B [6, 6], with transB ``trans``; ``reader`` also reads B."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((6, 6)) / 3).astype(np.float32), "B")
    nodes = [
        helper.make_node("Gemm", ["a", "B"], ["h"], name="g1", transB=int(trans[0])),
        helper.make_node("Gemm", ["h", "B"], ["y"], name="g2", transB=int(trans[1])),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 6])]
    if reader is not None:
        nodes.append(helper.make_node(reader, ["B"], ["r"], name="reader"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", 6])], outputs, [w]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_shared_weight_is_transposed_once() -> None:
    model = _two_gemms((True, True))
    rewritten, _ = _check_rewrite(model, gemms=2)
    matmuls = [n for n in rewritten.graph.node if n.op_type == "MatMul"]
    assert matmuls[0].input[1] == matmuls[1].input[1] == "B_matmul"
    assert [t.name for t in rewritten.graph.initializer] == ["B_matmul"]


def test_shared_untransposed_weight_may_feed_nodes_that_stay() -> None:
    """transB=0 reads B as it is: a Relu also reading B costs no second copy."""
    model = _two_gemms((False, False), reader="Relu")
    rewritten, report = convert(model)
    assert [e.status for e in report.entries] == [Status.CONVERTED] * 2
    assert [t.name for t in rewritten.graph.initializer] == ["B"]
    assert_equivalent(model, rewritten, random_feeds(model))


def test_weight_read_both_ways_is_shared() -> None:
    """One Gemm reads B as it is, one transposed: transposing would store B twice."""
    model = _two_gemms((False, True))
    rewritten, report = convert(model)
    assert [(e.name, e.status, e.reason) for e in report.entries] == [
        ("g1", Status.CONVERTED, None),
        ("g2", Status.SKIPPED, SkipReason.WEIGHT_SHARED),
    ]
    assert "g1" in report.entries[1].detail
    assert op_types(rewritten) == ["MatMul", "Gemm"]
    assert_equivalent(model, rewritten, random_feeds(model))


def test_trans_a_transpose_cancels_against_the_exporters() -> None:
    """An exporter's Transpose [1, 0] into a Gemm with transA=1: both go."""
    model = gemm_model(trans_a=True)
    model.graph.node.insert(0, helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0], name="t"))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 6]))
    rewritten, report = convert(model)
    assert op_types(rewritten) == ["MatMul", "Add"]
    assert (report.transposes_before, report.transposes_after) == (1, 0)
    assert_equivalent(model, rewritten, random_feeds(model))


def test_trans_a_transpose_stays_when_the_input_is_read_elsewhere() -> None:
    """The exporter's Transpose output is also a graph output: it stays, ours reads through it."""
    model = gemm_model(trans_a=True)
    model.graph.node.insert(0, helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0], name="t"))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 6]))
    model.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [6, "M"]))
    rewritten, report = convert(model)
    assert op_types(rewritten) == ["Transpose", "MatMul", "Add"]
    matmul = rewritten.graph.node[1]
    assert matmul.input[0] == "x"  # read through the exporter's Transpose
    assert (report.transposes_before, report.transposes_after) == (1, 1)
    assert_equivalent(model, rewritten, random_feeds(model))


def test_trans_a_transpose_of_a_reshape_stays() -> None:
    """A 2-D Transpose after a Reshape: nothing to cancel, the one Transpose stays."""
    model = gemm_model(trans_a=True, k=4)
    shape = numpy_helper.from_array(np.array([4, -1], np.int64), "shape")
    model.graph.initializer.append(shape)
    model.graph.node.insert(0, helper.make_node("Reshape", ["x", "shape"], ["a"]))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, "M"]))
    rewritten, report = convert(model)
    assert op_types(rewritten) == ["Reshape", "Transpose", "MatMul", "Add"]
    assert report.transposes_after == 1
    feeds = [{"x": np.random.default_rng(m).standard_normal((2, 2, m)).astype(np.float32)} for m in (1, 5)]
    assert_equivalent(model, rewritten, feeds)


def _if_model() -> onnx.ModelProto:
    """An If whose branches hold Gemms: the then-branch reads a main-graph weight (transB=1),
    the else-branch its own initializer (transB=0, alpha 0.5, no C)."""
    rng = np.random.default_rng(0)
    outer = numpy_helper.from_array(rng.standard_normal((5, 6)).astype(np.float32), "W_outer")
    inner = numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "W_inner")
    bias = numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "bias")
    out_info = helper.make_tensor_value_info
    then_branch = helper.make_graph(
        [helper.make_node("Gemm", ["a", "W_outer", "bias"], ["t_out"], name="then_fc", transB=1)],
        "then",
        [],
        [out_info("t_out", TensorProto.FLOAT, ["M", 5])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Gemm", ["a", "W_inner"], ["e_out"], name="else_fc", alpha=0.5)],
        "else",
        [],
        [out_info("e_out", TensorProto.FLOAT, ["M", 5])],
        [inner],
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["cond"], ["y"], name="if0", then_branch=then_branch, else_branch=else_branch
            )
        ],
        "g",
        [out_info("a", TensorProto.FLOAT, ["M", 6]), out_info("cond", TensorProto.BOOL, [])],
        [out_info("y", TensorProto.FLOAT, ["M", 5])],
        [outer, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_gemms_in_if_branches() -> None:
    model = _if_model()
    rewritten, report = convert(model)
    onnx.checker.check_model(rewritten, full_check=True)
    assert [(e.scope, e.name, e.status) for e in report.entries] == [
        ("if0/else_branch", "else_fc", Status.CONVERTED),  # the attributes' order
        ("if0/then_branch", "then_fc", Status.CONVERTED),
    ]
    assert "Gemm" not in op_types(rewritten)
    assert_matmul_weights_2d(rewritten, 2)
    # The transposed outer weight lives in the main graph, where the original was.
    assert [t.name for t in rewritten.graph.initializer] == ["bias", "W_outer_matmul"]
    rng = np.random.default_rng(2)
    feeds = [
        {"a": rng.standard_normal((m, 6)).astype(np.float32), "cond": np.array(c)}
        for m in (1, 4, 17)
        for c in (True, False)
    ]
    assert_equivalent(model, rewritten, feeds)


def test_gemm_option_off_leaves_gemms_unreported() -> None:
    model = gemm_model()
    rewritten, report = convert(model, ConvertOptions(gemm=False))
    assert report.entries == []
    assert op_types(rewritten) == ["Gemm"]
    assert report.options["gemm"] is False


def test_gemm_with_convs_counts_per_op_type(tmp_path: Path) -> None:
    """The CLI's JSON counts Gemms beside convs; --no-gemm leaves them out."""
    from helpers import conv_model

    model = conv_model(spatial=1, in_channels=6, out_channels=6)
    for tensor in gemm_model(k=6, n=6).graph.initializer:
        tensor.name = f"fc_{tensor.name}"
        model.graph.initializer.append(tensor)
    model.graph.node.append(helper.make_node("Gemm", ["flat", "fc_B", "fc_C"], ["z"], name="fc", transB=1))
    model.graph.node.insert(1, helper.make_node("ReduceMean", ["y"], ["flat"], axes=[2], keepdims=0))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 6]))
    source = tmp_path / "m.onnx"
    onnx.save(model, source)

    def run_cli(*flags: str) -> dict[str, object]:
        args = [str(source), str(tmp_path / "out.onnx"), "--allow-added-transposes", "--verify"]
        result = CliRunner().invoke(main, [*args, *flags, "--report-json-stdout"])
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        assert isinstance(data, dict)
        assert ("By op type" in result.stderr) == ("--no-gemm" not in flags)
        return data

    data = run_cli()
    assert data["totals"]["by_op_type"] == {  # type: ignore[index]
        "Conv": {"nodes": 1, "converted": 1},
        "Gemm": {"nodes": 1, "converted": 1},
    }
    assert [n["op_type"] for n in data["nodes"]] == ["Conv", "Gemm"]  # type: ignore[attr-defined]
    assert "Gemm" not in op_types(onnx.load(tmp_path / "out.onnx"))
    data = run_cli("--no-gemm")
    assert data["options"]["gemm"] is False  # type: ignore[index]
    assert data["totals"]["by_op_type"] == {"Conv": {"nodes": 1, "converted": 1}}  # type: ignore[index]
    assert op_types(onnx.load(tmp_path / "out.onnx")).count("Gemm") == 1


def test_quantize_covers_the_gemms(tmp_path: Path) -> None:
    """After the rewrite every Gemm weight is a MatMulNBits; with --no-gemm none is."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for i in range(3):
        w = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(np.zeros(64, np.float32), f"b{i}"),
        ]
        nodes.append(
            helper.make_node("Gemm", [f"h{i}", f"w{i}", f"b{i}"], [f"h{i + 1}"], name=f"fc{i}", transB=1)
        )
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["M", 64])],
        [helper.make_tensor_value_info("h3", TensorProto.FLOAT, ["M", 64])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    source = tmp_path / "m.onnx"
    onnx.save(model, source)
    for flags, expected in (((), 3), (("--no-gemm",), 0)):
        out = tmp_path / f"q{expected}.onnx"
        args = ["quantize", str(source), str(out), "--block-size", "32", *flags, "--report-json-stdout"]
        result = CliRunner().invoke(main, no_bench(args))
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        ops = [n.op_type for n in all_nodes(onnx.load(out).graph)]
        assert ops.count("MatMulNBits") == data["quantized_nodes"] == expected
        assert ops.count("Gemm") == 3 - expected
        assert data["rewrite"]["by_op_type"].get("Gemm", {}).get("converted", 0) == expected
        assert ("Gemm rewritten" in result.stderr) == bool(expected)


@st.composite
def gemm_configs(draw: st.DrawFn) -> dict[str, object]:
    c = draw(st.sampled_from([None, *GEMM_C_SHAPES]))
    return {
        "k": draw(st.integers(1, 40)),
        "n": draw(st.integers(1, 24)),
        "trans_a": draw(st.booleans()),
        "trans_b": draw(st.booleans()),
        "alpha": draw(st.sampled_from([1.0, 0.5, -2.0, 0.1, 3.0])),
        "beta": draw(st.sampled_from([1.0, 0.0, 0.25, -1.5])),
        "c": c,
        "c_source": draw(st.sampled_from(["initializer", "input"])),
        "dtype": draw(st.sampled_from(FP)),
        "weight_source": draw(st.sampled_from(["initializer", "constant"])),
        "opset": draw(st.sampled_from([7, 11, 13, 17, 21])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=examples(40))
@given(gemm_configs())
def test_any_gemm_rewrites_exactly(config: dict[str, object]) -> None:
    if config["c"] is None and int(config["opset"]) < 11:  # type: ignore[call-overload]
        config["c"] = "N"  # C is optional from opset 11 on
    model = gemm_model(**config)  # type: ignore[arg-type]
    _, ops = _check_rewrite(model)
    reads_c = config["c"] is not None and config["beta"] != 0
    assert ops.count("Add") == int(reads_c)
    assert ops.count("Transpose") == int(bool(config["trans_a"]))


def test_gemm_in_a_loop_body() -> None:
    """A Loop whose body applies a Gemm (main-graph weight, transB=1) to its state."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((6, 6)) / 3).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")
    info = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Gemm", ["h_in", "W", "b"], ["h_out"], name="step", transB=1, alpha=0.5),
        ],
        "body",
        [
            info("i", TensorProto.INT64, []),
            info("cond_in", TensorProto.BOOL, []),
            info("h_in", TensorProto.FLOAT, None),
        ],
        [info("cond_out", TensorProto.BOOL, []), info("h_out", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "a"], ["y"], name="loop", body=body)],
        "g",
        [info("a", TensorProto.FLOAT, ["M", 6]), info("trips", TensorProto.INT64, [])],
        [info("y", TensorProto.FLOAT, ["M", 6])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rewritten, report = convert(model)
    onnx.checker.check_model(rewritten, full_check=True)
    assert [(e.scope, e.status) for e in report.entries] == [("loop/body", Status.CONVERTED)]
    assert "Gemm" not in op_types(rewritten)
    assert_matmul_weights_2d(rewritten, 1)
    feeds = [
        {"a": rng.standard_normal((m, 6)).astype(np.float32), "trips": np.array(t, np.int64)}
        for m, t in ((1, 1), (5, 3), (16, 4))
    ]
    assert_equivalent(model, rewritten, feeds)


@pytest.mark.parametrize("config", [{}, {"alpha": 0.3, "beta": 0.7}, {"alpha": -1.7, "beta": 2.5, "c": "MN"}])
def test_float16_within_the_verification_criterion(config: dict[str, object], tmp_path: Path) -> None:
    """The tool's own check (--verify) passes on a wide fp16 Gemm, alpha and beta included."""
    from onnx_conv2matmul import convert_file
    from onnx_conv2matmul.verify.check import VerifyOptions

    source = tmp_path / "m.onnx"
    onnx.save(gemm_model(k=512, n=256, dtype=TensorProto.FLOAT16, **config), source)  # type: ignore[arg-type]
    report = convert_file(source, tmp_path / "o.onnx", verify=VerifyOptions(lengths=(7,), batch=5))
    assert report.verification is not None and report.verification.passed, report.verification
    assert report.return_code == 0


def test_trans_a_transpose_cancels_across_an_elementwise_op() -> None:
    """Transpose [1, 0] -> Relu -> Gemm(transA=1): the Relu runs on the untransposed input."""
    model = gemm_model(trans_a=True)
    model.graph.node.insert(0, helper.make_node("Relu", ["t"], ["a"], name="relu"))
    model.graph.node.insert(0, helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0], name="t"))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 6]))
    rewritten, report = convert(model)
    assert op_types(rewritten) == ["Relu", "MatMul", "Add"]
    assert report.transposes_cancelled == 2
    assert_equivalent(model, rewritten, random_feeds(model))
