"""The Transpose cleanup: chains at graph outputs, in subgraphs, and pairs that do not cancel."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import ALL, all_nodes, assert_equivalent, assert_matmul_weights_2d, op_types
from onnx_conv2matmul import ConvertOptions, Status, convert
from onnx_conv2matmul.rewrite.cleanup import cancel_transposes
from onnx_conv2matmul.rewrite.layout import channels_last_perms, compose

C, M = 6, 5
# Distinct sizes on every axis, so that a wrong permutation changes the output's shape.
DIMS = {"N": 2, "d0": 3, "d1": 4, "d2": 7}


def _dims(rank: int) -> list[str]:
    return [f"d{i}" for i in range(rank - 2)]


def _weight(name: str, rank: int, out: int = M, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array(rng.standard_normal((out, C, *[1] * (rank - 2))).astype(np.float32), name)


def _bias(name: str, out: int = M) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(1).standard_normal(out).astype(np.float32), name)


def _channels_last_conv(
    rank: int, *, bias: bool = True, between: Sequence[str] = (), also_read: bool = False
) -> onnx.ModelProto:
    """``x`` channels-last -> Transpose -> Conv -> [elementwise ops] -> Transpose -> ``y``.

    Keras' Conv1D (rank 3) and NHWC / NDHWC models (rank 4, 5) export convs so.
    ``also_read``: ``y`` is also read by a Sigmoid whose output is a second graph output.
    """
    to_first = channels_last_perms(rank)[1]
    to_last = channels_last_perms(rank)[0]
    inputs = ["t", "W", "B"] if bias else ["t", "W"]
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="to_first", perm=to_first),
        helper.make_node("Conv", inputs, ["c0"], name="pw"),
    ]
    for i, op in enumerate(between):
        nodes.append(helper.make_node(op, [f"c{i}"], [f"c{i + 1}"], name=f"{op.lower()}{i}"))
    nodes.append(helper.make_node("Transpose", [f"c{len(between)}"], ["y"], name="to_last", perm=to_last))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *_dims(rank), M])]
    if also_read:
        nodes.append(helper.make_node("Sigmoid", ["y"], ["z"], name="reader"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", *_dims(rank), M]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *_dims(rank), C])],
        outputs,
        [_weight("W", rank), _bias("B")] if bias else [_weight("W", rank)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(shape: list[str], seed: int = 0, **fixed: np.ndarray) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for scale in (1, 2):
        dims = [C if d == "C" else DIMS[d] * scale if d != "N" else DIMS[d] + scale for d in shape]
        out.append({"x": rng.standard_normal(dims).astype(np.float32), **fixed})
    return out


def _output_types(model: onnx.ModelProto) -> list[str]:
    return [o.SerializeToString().hex() for o in model.graph.output]


@pytest.mark.parametrize("rank", [3, 4, 5], ids=["keras-conv1d", "nhwc", "ndhwc"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_transposes_around_a_conv_that_feeds_a_graph_output_all_cancel(rank: int, bias: bool) -> None:
    model = _channels_last_conv(rank, bias=bias)
    rewritten, report = convert(model, ConvertOptions())  # by default: it removes two Transposes
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert op_types(rewritten) == (["MatMul", "Add"] if bias else ["MatMul"])
    assert (report.transposes_before, report.transposes_after, report.transposes_cancelled) == (2, 0, 4)
    # The graph output keeps its name, type and shape; the value that took it over is MatMul's or Add's.
    assert _output_types(rewritten) == _output_types(model)
    assert rewritten.graph.node[-1].output[0] == "y"
    assert_matmul_weights_2d(rewritten, 1)
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, _feeds(["N", *_dims(rank), "C"]))


@pytest.mark.parametrize("rank", [3, 4])
def test_across_elementwise_ops_to_a_graph_output(rank: int) -> None:
    """Transpose -> Conv -> Relu -> Tanh -> Transpose -> y: the Tanh output becomes ``y``."""
    model = _channels_last_conv(rank, between=["Relu", "Tanh"])
    rewritten, report = convert(model, ConvertOptions())
    assert op_types(rewritten) == ["MatMul", "Add", "Relu", "Tanh"]
    assert report.transposes_after == 0
    assert _output_types(rewritten) == _output_types(model)
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, _feeds(["N", *_dims(rank), "C"]))


def test_a_graph_output_that_is_also_read() -> None:
    model = _channels_last_conv(4, also_read=True)
    rewritten, report = convert(model, ConvertOptions())
    assert op_types(rewritten) == ["MatMul", "Add", "Sigmoid"]
    assert report.transposes_after == 0
    sigmoid = next(n for n in rewritten.graph.node if n.op_type == "Sigmoid")
    assert list(sigmoid.input) == ["y"]
    assert _output_types(rewritten) == _output_types(model)
    assert_equivalent(model, rewritten, _feeds(["N", "d0", "d1", "C"]))


def test_a_graph_output_that_is_also_the_conv_output_keeps_its_transpose() -> None:
    """``c0`` (the conv's output) is a graph output too: the chain stops there."""
    model = _channels_last_conv(3)
    model.graph.output.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, ["N", M, "d0"]))
    forced, report = convert(model, ALL)
    # In: cancels (-1). Out: ours stays for c0, the model's stays for y (+1).
    assert report.transposes_after == report.transposes_before == 2
    assert [o.name for o in forced.graph.output] == ["y", "c0"]
    assert_equivalent(model, forced, _feeds(["N", "d0", "C"]))


def _body(rank: int, inputs: list[onnx.ValueInfoProto], x: str, out: str) -> onnx.GraphProto:
    """Transpose -> Conv (outer weight) -> Transpose, ending at the subgraph output ``out``."""
    to_first, to_last = channels_last_perms(rank)[1], channels_last_perms(rank)[0]
    return helper.make_graph(
        [
            helper.make_node("Transpose", [x], [f"{out}_t"], perm=to_first),
            helper.make_node("Conv", [f"{out}_t", "W", "B"], [f"{out}_c"], name=f"{out}_pw"),
            helper.make_node("Transpose", [f"{out}_c"], [out], perm=to_last),
        ],
        f"{out}_body",
        inputs,
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", *_dims(rank), C])],
    )


def _subgraph_names(model: onnx.ModelProto) -> list[list[str]]:
    return [
        [o.name for o in attr.g.output]
        for node in model.graph.node
        for attr in node.attribute
        if attr.type == 5
    ]


@pytest.mark.parametrize("rank", [3, 4])
def test_in_if_branches_the_subgraph_output_takes_over(rank: int) -> None:
    x = ["N", *_dims(rank), "C"]
    then_branch = _body(rank, [], "x", "then_y")
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["else_y"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, ["N", *_dims(rank), C])],
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["cond"], ["y"], name="if0", then_branch=then_branch, else_branch=else_branch
            )
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [d if d != "C" else C for d in x]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *_dims(rank), C])],
        [_weight("W", rank, out=C), _bias("B", out=C)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, report = convert(model, ConvertOptions())
    assert [(e.status, e.scope) for e in report.entries] == [(Status.CONVERTED, "if0/then_branch")]
    assert op_types(rewritten) == ["If", "Neg", "MatMul", "Add"]  # else_branch, then_branch
    assert _subgraph_names(rewritten) == _subgraph_names(model)
    then_out = next(a.g for a in rewritten.graph.node[0].attribute if a.name == "then_branch").output[0]
    assert then_out == then_branch.output[0], "the branch output keeps its name, type and shape"
    assert_matmul_weights_2d(rewritten, 1)
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = [f for cond in (True, False) for f in _feeds(x, cond=np.array(cond))]
    assert_equivalent(model, rewritten, feeds)


def test_in_a_loop_body_the_carried_output_takes_over() -> None:
    rank = 4
    body = _body(
        rank,
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", "d0", "d1", C]),
        ],
        "h",
        "h_next",
    )
    body.node.insert(0, helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body.output.insert(0, helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []))
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trip", "", "x"], ["y"], name="loop0", body=body)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "d0", "d1", C]),
            helper.make_tensor_value_info("trip", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "d0", "d1", C])],
        [_weight("W", rank, out=C), _bias("B", out=C)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, report = convert(model, ConvertOptions())
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert op_types(rewritten) == ["Loop", "Identity", "MatMul", "Add"]
    new_body = rewritten.graph.node[0].attribute[0].g
    assert list(new_body.output) == list(body.output)
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = [
        {**f, "trip": np.array(trip, dtype=np.int64)}
        for trip in (0, 1, 3)
        for f in _feeds(["N", "d0", "d1", "C"])
    ]
    assert_equivalent(model, rewritten, feeds)


# Transposes next to ours whose composition with ours is not the identity: they merge
# into one, which must keep the composed permutation (cancelling them would change the
# output's shape).
def _conv_then(perm: list[int], rank: int, after: str | None = "Relu") -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="pw"),
        helper.make_node("Transpose", ["c"], ["t"], name="theirs", perm=perm),
    ]
    out = "t"
    if after is not None:
        nodes.append(helper.make_node(after, ["t"], ["y"]))
        out = "y"
    canonical: list[str | int] = ["N", M, *_dims(rank)]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, *_dims(rank)])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [canonical[i] for i in perm])],
        [_weight("W", rank), _bias("B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _then_conv(perm: list[int], rank: int) -> onnx.ModelProto:
    """``x`` -> Transpose(perm) -> Conv -> ``y``, ``perm`` giving channels-first."""
    inverse = [perm.index(i) for i in range(rank)]
    canonical: list[str | int] = ["N", C, *_dims(rank)]
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="theirs", perm=perm),
            helper.make_node("Conv", ["t", "W", "B"], ["y"], name="pw"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [canonical[i] for i in inverse])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", M, *_dims(rank)])],
        [_weight("W", rank), _bias("B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _transpose_perms(model: onnx.ModelProto) -> list[list[int]]:
    return [list(n.attribute[0].ints) for n in all_nodes(model.graph) if n.op_type == "Transpose"]


def _canonical_feeds(model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    shape = [d.dim_param or "C" for d in model.graph.input[0].type.tensor_type.shape.dim]
    return _feeds(shape)


@pytest.mark.parametrize(
    ("rank", "perm", "after"),
    [
        (4, [0, 2, 1, 3], "Relu"),  # NCHW -> NHCW
        (4, [0, 1, 3, 2], None),  # swaps H and W, ends at the graph output
        (3, [2, 0, 1], "Relu"),  # NCT -> TNC
        (5, [0, 2, 3, 1, 4], None),
    ],
)
def test_a_transpose_after_ours_that_does_not_cancel_merges_with_it(
    rank: int, perm: list[int], after: str | None
) -> None:
    model = _conv_then(perm, rank, after)
    rewritten, report = convert(model, ALL)
    expected = ["Transpose", "MatMul", "Add", "Transpose"] + ([after] if after else [])
    assert op_types(rewritten) == expected
    out_perm = channels_last_perms(rank)[1]
    assert _transpose_perms(rewritten) == [channels_last_perms(rank)[0], compose(out_perm, perm)]
    assert report.transposes_after == report.transposes_before + 1 == 2
    assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
    assert_equivalent(model, rewritten, _canonical_feeds(model))


@pytest.mark.parametrize(("rank", "perm"), [(4, [0, 2, 1, 3]), (3, [1, 2, 0]), (5, [0, 4, 1, 3, 2])])
def test_a_transpose_before_ours_that_does_not_cancel_merges_with_it(rank: int, perm: list[int]) -> None:
    model = _then_conv(perm, rank)
    rewritten, report = convert(model, ALL)
    assert op_types(rewritten) == ["Transpose", "MatMul", "Add", "Transpose"]
    assert _transpose_perms(rewritten) == [
        compose(perm, channels_last_perms(rank)[0]),
        channels_last_perms(rank)[1],
    ]
    assert report.transposes_after == report.transposes_before + 1 == 2
    assert_equivalent(model, rewritten, _canonical_feeds(model))


def test_without_ours_every_transpose_counts_and_chains_compose() -> None:
    """``cancel_transposes`` on its own: Transpose chains of any model, outputs kept."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 3, 1]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Transpose", ["b"], ["c"], perm=[0, 3, 1, 2]),  # undoes the first
        helper.make_node("Transpose", ["c"], ["d"], perm=[0, 2, 1, 3]),
        helper.make_node("Sigmoid", ["d"], ["e"]),
        helper.make_node("Transpose", ["e"], ["y"], perm=[0, 1, 3, 2]),  # not the inverse
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "d0", "d1"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "d0", "d1", "C"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ir_model = ir.serde.deserialize_model(model)
    assert cancel_transposes(ir_model, every=True) == 3
    rewritten = ir.serde.serialize_model(ir_model)
    assert op_types(rewritten) == ["Relu", "Sigmoid", "Transpose"]
    assert _transpose_perms(rewritten) == [[0, 2, 3, 1]]
    assert rewritten.graph.output[0] == model.graph.output[0]
    rng = np.random.default_rng(0)
    assert_equivalent(model, rewritten, [{"x": rng.standard_normal((2, 3, 4, 5)).astype(np.float32)}])


def test_a_graph_output_taken_over_keeps_its_doc_string() -> None:
    """The value taking over ``y`` gets its doc string too (mutation testing)."""
    model = _channels_last_conv(3)
    model.graph.output[0].doc_string = "the encoder output"
    rewritten, report = convert(model, ConvertOptions())
    assert report.transposes_after == 0
    assert rewritten.graph.output[0].doc_string == "the encoder output"
    assert _output_types(rewritten) == _output_types(model)
    assert_equivalent(model, rewritten, _feeds(["N", "d0", "C"]))


@pytest.mark.parametrize("source", ["graph input", "graph output"])
def test_an_identity_chain_to_a_graph_output_keeps_a_transpose_when_its_input_cannot_take_over(
    source: str,
) -> None:
    """x [-> Relu -> r, a graph output] -> T -> T (undoing it) -> y. The value the chain
    reads is a graph input or output: it cannot become ``y`` too, so one Transpose (an
    identity) stays and every output keeps its name (mutation testing: ``_can_take_over``)."""
    nodes = []
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "C", "d0", "d1"])]
    start = "x"
    if source == "graph output":
        nodes.append(helper.make_node("Relu", ["x"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", "C", "d0", "d1"]))
        start = "r"
    nodes += [
        helper.make_node("Transpose", [start], ["a"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["a"], ["y"], perm=[0, 3, 1, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "d0", "d1"])],
        outputs,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ir_model = ir.serde.deserialize_model(model)
    assert cancel_transposes(ir_model, every=True) == 1
    rewritten = ir.serde.serialize_model(ir_model)
    assert _transpose_perms(rewritten) == [[0, 1, 2, 3]]
    assert [i.name for i in rewritten.graph.input] == ["x"]
    assert list(rewritten.graph.output) == list(model.graph.output)
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(0)
    assert_equivalent(model, rewritten, [{"x": rng.standard_normal((2, 3, 4, 5)).astype(np.float32)}])


def test_elementwise_ops_the_transposes_move_across_lose_their_stale_shapes() -> None:
    """Transpose -> Conv -> Relu -> Tanh -> Transpose -> y, with the Relu's channels-first
    shape recorded: once the Relu runs channels-last, that shape is dropped (mutation
    testing: ``_Chain.between``)."""
    model = _channels_last_conv(3, between=["Relu", "Tanh"])
    model.graph.value_info.append(helper.make_tensor_value_info("c1", TensorProto.FLOAT, ["N", M, "d0"]))
    rewritten, report = convert(model, ConvertOptions())
    assert op_types(rewritten) == ["MatMul", "Add", "Relu", "Tanh"]
    assert report.transposes_after == 0
    relu = next(n for n in rewritten.graph.node if n.op_type == "Relu")
    for info in rewritten.graph.value_info:
        if info.name == relu.output[0]:
            assert not info.type.tensor_type.HasField("shape")
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, _feeds(["N", "d0", "C"]))


def test_a_chain_ending_in_an_elementwise_op_reads_through_the_transpose_above() -> None:
    """x -> T (a graph output too) -> T (its inverse) -> Relu -> y, every Transpose counted:
    the second T goes and the Relu reads x (mutation testing: ``outcome``)."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["t"], ["u"], perm=[0, 3, 1, 2]),
        helper.make_node("Relu", ["u"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "d0", "d1"])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "C", "d0", "d1"]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N", "d0", "d1", "C"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ir_model = ir.serde.deserialize_model(model)
    assert cancel_transposes(ir_model, every=True) == 1
    rewritten = ir.serde.serialize_model(ir_model)
    assert op_types(rewritten) == ["Transpose", "Relu"]
    relu = rewritten.graph.node[1]
    assert list(relu.input) == ["x"]
    assert list(rewritten.graph.output) == list(model.graph.output)
    rng = np.random.default_rng(0)
    assert_equivalent(model, rewritten, [{"x": rng.standard_normal((2, 3, 4, 5)).astype(np.float32)}])
