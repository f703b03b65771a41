"""inspect agrees with convert on a model holding every node kind the rewrite reaches: a grouped
pointwise conv, a FusedConv, a depthwise conv, a Gemm and a Gemm in an ``If`` branch, under each
rewrite option (``--no-gemm`` included), through the library and through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_equivalent, gemm_model
from onnx_conv2matmul import ConvertOptions, Status, convert
from onnx_conv2matmul.quantize.inspection import inspect_file
from test_inspect import _assert_agree, invoke


def _reach_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / 3).astype(np.float32), name)

    then_branch = helper.make_graph(
        [helper.make_node("Gemm", ["p", "B_branch"], ["o"], name="branch_gemm")],
        "then",
        [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["N", 8])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["p"], ["o_else"], name="identity")],
        "else",
        [],
        [helper.make_tensor_value_info("o_else", TensorProto.FLOAT, ["N", 8])],
    )
    nodes = [
        helper.make_node("Conv", ["x", "W_grouped"], ["g"], name="grouped", group=2),
        helper.make_node(
            "FusedConv",
            ["g", "W_fused"],
            ["f"],
            name="fused",
            domain="com.microsoft",
            activation="LeakyRelu",
            activation_params=[0.1],
        ),
        helper.make_node("Conv", ["f", "W_depthwise"], ["d"], name="depthwise", group=8),
        helper.make_node("ReduceMean", ["d"], ["p"], name="pool", axes=[2], keepdims=0),
        helper.make_node("Gemm", ["p", "B_head", "C_head"], ["y"], name="head", transB=1, alpha=0.5),
        helper.make_node(
            "If", ["cond"], ["z"], name="branch", then_branch=then_branch, else_branch=else_branch
        ),
    ]
    inits = [
        weight("W_grouped", 8, 4, 1),
        weight("W_fused", 8, 8, 1),
        weight("W_depthwise", 8, 1, 1),
        weight("B_head", 4, 8),
        weight("C_head", 4),
        weight("B_branch", 8, 8),
    ]
    graph = helper.make_graph(
        nodes,
        "reach",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, "T"]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 8]),
        ],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


# (options, the same as flags, which nodes convert)
OPTIONS = [
    (ConvertOptions(), [], {"head", "branch_gemm"}),
    (ConvertOptions(gemm=False), ["--no-gemm"], set()),
    (ConvertOptions(extended=True), ["--extended-conv1x1"], {"head", "branch_gemm"}),
    (
        ConvertOptions(extended=True, allow_added_transposes=True),
        ["--extended-conv1x1", "--allow-added-transposes"],
        {"grouped", "fused", "head", "branch_gemm"},
    ),
    (
        ConvertOptions(extended=True, allow_added_transposes=True, gemm=False),
        ["--no-gemm", "--extended-conv1x1", "--allow-added-transposes"],
        {"grouped", "fused"},
    ),
]


@pytest.mark.parametrize(
    ("options", "flags", "converted"), OPTIONS, ids=[" ".join(o[1]) or "default" for o in OPTIONS]
)
def test_inspect_agrees_with_convert(
    options: ConvertOptions, flags: list[str], converted: set[str], tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    path = source / "m.onnx"
    onnx.save(_reach_model(), path)
    _assert_agree(path, options, tmp_path, checker=True)

    code, out, _ = invoke("inspect", str(path), *flags, "--json")
    assert code == 0
    inspected = json.loads(out)
    code, out, _ = invoke(str(path), str(tmp_path / "out.onnx"), *flags, "--report-json-stdout", "-q")
    assert code == 0
    written = json.loads(out)
    keys = ("name", "scope", "op_type", "status", "reason", "matmul", "extra_ops")
    assert [{k: n[k] for k in keys} for n in inspected["convs"]] == [
        {k: n[k] for k in keys} for n in written["nodes"]
    ]
    assert inspected["totals"] == written["totals"]
    assert {n["name"] for n in inspected["convs"] if n["status"] == "converted"} == converted
    gemms = [n["name"] for n in inspected["convs"] if n["op_type"] == "Gemm"]
    assert gemms == ([] if "--no-gemm" in flags else ["head", "branch_gemm"])


def test_every_reached_node_converts_exactly() -> None:
    model = _reach_model()
    rewritten, report = convert(model, OPTIONS[3][0])
    assert len(report.converted) == 4
    rng = np.random.default_rng(1)
    feeds = [
        {"x": rng.standard_normal((n, 8, t)).astype(np.float32), "cond": np.array(cond)}
        for n, t in ((1, 1), (3, 17), (2, 64))
        for cond in (True, False)
    ]
    assert_equivalent(model, rewritten, feeds)


@pytest.mark.parametrize(("above", "counts"), [(False, (0, 1)), (True, (1, 0))], ids=["alone", "cancelled"])
def test_a_trans_a_gemms_transpose_is_in_the_totals_only(
    above: bool, counts: tuple[int, int], tmp_path: Path
) -> None:
    """As docs/rewrite.md says: inspect leaves a Gemm's Transpose cost blank; the totals count it."""
    model = gemm_model(trans_a=True)
    if above:  # an exporter's Transpose [1, 0] into A: both go
        model.graph.node.insert(0, helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0], name="t"))
        model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 6]))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    report = inspect_file(path)
    assert [(n.entry.status, n.transposes_added) for n in report.nodes] == [(Status.CONVERTED, None)]
    assert (report.rewrite.transposes_before, report.rewrite.transposes_after) == counts
