"""Convs inside If/Loop bodies with outer-scope weights, and shared weights."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    ALL,
    all_initializers,
    all_nodes,
    assert_equivalent,
    assert_matmul_weights_2d,
    op_types,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert

RNG = np.random.default_rng(7)
C = 8


def _w(name: str, m: int = C, c: int = C) -> onnx.TensorProto:
    return numpy_helper.from_array(RNG.standard_normal((m, c, 1)).astype(np.float32), name)


def _if_loop_model() -> onnx.ModelProto:
    """If(cond) -> then: Conv(W_outer) / else: Conv(Constant W); then Loop n times Conv(W_outer)."""
    then_g = helper.make_graph(
        [helper.make_node("Conv", ["x", "W_outer", "B_outer"], ["then_y"], name="then_conv")],
        "then",
        [],
        [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, None)],
    )
    else_g = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W_inner"], value=_w("W_inner")),
            helper.make_node("Conv", ["x", "W_inner"], ["else_y"], name="else_conv"),
            # a nested If inside the else branch, also converting an outer weight
            helper.make_node(
                "If",
                ["cond"],
                ["nested_y"],
                name="nested_if",
                then_branch=helper.make_graph(
                    [helper.make_node("Conv", ["else_y", "W_outer"], ["n_then"], name="nested_conv")],
                    "nt",
                    [],
                    [helper.make_tensor_value_info("n_then", TensorProto.FLOAT, None)],
                ),
                else_branch=helper.make_graph(
                    [helper.make_node("Identity", ["else_y"], ["n_else"])],
                    "ne",
                    [],
                    [helper.make_tensor_value_info("n_else", TensorProto.FLOAT, None)],
                ),
            ),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("nested_y", TensorProto.FLOAT, None)],
    )
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Conv", ["h", "W_loop"], ["h_conv"], name="loop_conv"),
            helper.make_node("Tanh", ["h_conv"], ["h_next"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_next", TensorProto.FLOAT, None),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["cond"], ["branch_y"], name="if0", then_branch=then_g, else_branch=else_g
            ),
            helper.make_node("Loop", ["trip", "", "branch_y"], ["loop_y"], name="loop0", body=body),
        ],
        "main",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, "T"]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("trip", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("loop_y", TensorProto.FLOAT, ["N", C, "T"])],
        [
            _w("W_outer"),
            numpy_helper.from_array(RNG.standard_normal(C).astype(np.float32), "B_outer"),
            _w("W_loop"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_convs_in_if_and_loop_bodies_are_converted() -> None:
    original = _if_loop_model()
    onnx.checker.check_model(original)
    rewritten, report = convert(original, ALL)
    onnx.checker.check_model(rewritten, full_check=True)
    by_name = {e.name: e for e in report.entries}
    assert set(by_name) == {"then_conv", "else_conv", "nested_conv", "loop_conv"}
    assert all(e.status is Status.CONVERTED for e in report.entries)
    assert by_name["then_conv"].scope == "if0/then_branch"
    assert by_name["nested_conv"].scope == "if0/else_branch/nested_if/then_branch"
    assert by_name["loop_conv"].scope == "loop0/body"
    assert "Conv" not in op_types(rewritten)
    # W_outer is shared by two convs in different scopes: transposed once.
    inits = all_initializers(rewritten.graph)
    assert "W_outer_matmul" in {i.name for i in rewritten.graph.initializer}
    assert not any(name.startswith("W_outer_matmul_") for name in inits)
    assert "W_outer" not in inits and "W_loop" not in inits
    # The Constant-node weight becomes an initializer of the branch that held it.
    assert "Constant" not in op_types(rewritten)
    assert_matmul_weights_2d(rewritten, 4)
    names = [n.name for n in all_nodes(rewritten.graph) if n.name]
    assert len(names) == len(set(names))

    feeds = []
    for cond in (True, False):
        for trip in (0, 1, 3):
            for batch, length in ((1, 5), (2, 17), (3, 64)):
                feeds.append(
                    {
                        "x": RNG.standard_normal((batch, C, length)).astype(np.float32),
                        "cond": np.array(cond),
                        "trip": np.array(trip, dtype=np.int64),
                    }
                )
    assert_equivalent(original, rewritten, feeds)


def test_generated_names_do_not_collide_with_subgraph_names() -> None:
    original = _if_loop_model()
    # A subgraph already uses the name the rewrite would give the shared weight.
    then_g = next(a.g for a in original.graph.node[0].attribute if a.name == "then_branch")
    then_g.node.append(helper.make_node("Identity", ["then_y"], ["W_outer_matmul"]))
    then_g.output[0].name = "W_outer_matmul"
    rewritten, _ = convert(original, ALL)
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = [
        {
            "x": RNG.standard_normal((2, C, 9)).astype(np.float32),
            "cond": np.array(c),
            "trip": np.array(2, dtype=np.int64),
        }
        for c in (True, False)
    ]
    assert_equivalent(original, rewritten, feeds)


def test_shared_weight_is_transposed_once() -> None:
    w = _w("W")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W"], ["a"], name="c1"),
            helper.make_node("Conv", ["a", "W"], ["b"], name="c2"),
            helper.make_node("Conv", ["b", "W"], ["c"], name="padded", pads=[1, 1]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, "T"])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", C, "T2"])],
        [w],
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # Strict mode leaves the padded conv, so converting c1/c2 would store W twice: all stay.
    _, strict = convert(original, ALL)
    assert [e.reason for e in strict.entries] == [
        SkipReason.WEIGHT_SHARED,
        SkipReason.WEIGHT_SHARED,
        SkipReason.NEEDS_EXTENDED_MODE,
    ]
    rewritten, report = convert(original, ConvertOptions(allow_added_transposes=True, extended=True))
    assert [e.status for e in report.entries] == [Status.CONVERTED] * 3
    assert set(all_initializers(rewritten.graph)) == {"W_matmul"}
    assert op_types(rewritten).count("MatMul") == 3
    feeds = [{"x": RNG.standard_normal((b, C, t)).astype(np.float32)} for b, t in ((1, 3), (2, 40))]
    assert_equivalent(original, rewritten, feeds)


def test_transpose_sinks_through_relu_and_merges() -> None:
    """Conv2D 1x1 -> Relu -> Transpose[0,2,1,3]: our output Transpose merges into the last one."""
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W"], ["c"], name="pw"),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "H", C, "W"])],
        [numpy_helper.from_array(RNG.standard_normal((C, C, 1, 1)).astype(np.float32), "W")],
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, report = convert(original, ALL)
    onnx.checker.check_model(rewritten, full_check=True)
    assert op_types(rewritten) == ["Transpose", "MatMul", "Relu", "Transpose"]
    assert report.transposes_after == report.transposes_before + 1
    feeds = [
        {"x": RNG.standard_normal((b, C, h, w)).astype(np.float32)} for b, h, w in ((1, 3, 5), (2, 8, 1))
    ]
    assert_equivalent(original, rewritten, feeds)
