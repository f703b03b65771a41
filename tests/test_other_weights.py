"""--other-weights int8: large float tensors MatMulNBits does not take, stored as int8.

Each stored tensor is read through a per-axis DequantizeLinear; the graph must compute
exactly what dequantizing in numpy gives, in every scope.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import all_nodes, examples, run
from onnx_conv2matmul.quantize.other_weights import (
    MIN_BYTES,
    KeptReason,
    dequantize_int8,
    quantize_data_int8,
    quantize_other_weights,
)

RNG = np.random.default_rng(7)


def _model(nodes, inputs, outputs, initializers, opset: int = 17) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _table_model(opset: int = 17, dtype: type = np.float32, rows: int = 300) -> onnx.ModelProto:
    """A relative positional table [1, rows, 64] sliced by length, then added: a NeMo-like use."""
    table = RNG.standard_normal((1, rows, 64)).astype(dtype)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    nodes = [
        helper.make_node("Shape", ["x"], ["shape3"]),
        helper.make_node("Slice", ["shape3", "one", "two"], ["shape"]),
        helper.make_node("Slice", ["T", "zero", "shape", "one"], ["t"]),
        helper.make_node("Add", ["x", "t"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(table, "T"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", elem, [1, "T", 64])],
        [helper.make_tensor_value_info("y", elem, [1, "T", 64])],
        inits,
        opset,
    )


def _gather_conv_model() -> onnx.ModelProto:
    """An embedding read by Gather feeding a 3-tap Conv whose weight stays a Conv."""
    emb = RNG.standard_normal((500, 64)).astype(np.float32)
    conv = (0.1 * RNG.standard_normal((96, 64, 3))).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["e"]),
        helper.make_node("Unsqueeze", ["e", "axes"], ["e3"]),
        helper.make_node("Transpose", ["e3"], ["et"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["et", "W"], ["y"], pads=[1, 1]),
    ]
    inits = [
        numpy_helper.from_array(emb, "E"),
        numpy_helper.from_array(conv, "W"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 96, "T"])],
        inits,
    )


def _same_shape_table(opset: int) -> onnx.ModelProto:
    """A table added to an input of its own shape (no broadcast, no Slice: valid at any opset)."""
    table = RNG.standard_normal((300, 64)).astype(np.float32)
    return _model(
        [helper.make_node("Add", ["x", "T"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [300, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [300, 64])],
        [numpy_helper.from_array(table, "T")],
        opset,
    )


def _conv_model(opset: int) -> onnx.ModelProto:
    """A 3-tap Conv whose weight stays a Conv (a plain Conv: valid from opset 1)."""
    conv = (0.1 * RNG.standard_normal((96, 64, 3))).astype(np.float32)
    return _model(
        [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 96, "T"])],
        [numpy_helper.from_array(conv, "W")],
        opset,
    )


def _subgraph_model() -> onnx.ModelProto:
    """A table inside each branch of an If, and one in the main graph read from a branch."""
    inner = RNG.standard_normal((128, 160)).astype(np.float32)
    outer = RNG.standard_normal((128, 160)).astype(np.float32)

    def branch(name: str, op: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, [f"{name}_table", "Outer"], [f"{name}_out"])],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [128, 160])],
            [numpy_helper.from_array(inner if name == "then" else -inner, f"{name}_table")],
        )

    nodes = [
        helper.make_node(
            "If", ["c"], ["z"], then_branch=branch("then", "Add"), else_branch=branch("else", "Sub")
        ),
        helper.make_node("Mul", ["z", "x"], ["y"]),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 160]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 160])],
        [numpy_helper.from_array(outer, "Outer")],
    )


def _quantized(model: onnx.ModelProto) -> tuple[onnx.ModelProto, object]:
    ir_model = ir.serde.deserialize_model(onnx.ModelProto.FromString(model.SerializeToString()))
    result = quantize_other_weights(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, result


def _dequantized_in_numpy(array: np.ndarray, axis: int) -> np.ndarray:
    q, scales = quantize_data_int8(array, axis)
    return dequantize_int8(q, scales, axis)


def _dequantized_in_graph(proto: onnx.ModelProto, name: str) -> np.ndarray:
    """The DequantizeLinear output named ``name``, computed by onnxruntime (main graph)."""
    probe = onnx.ModelProto.FromString(proto.SerializeToString())
    probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    feeds = {}
    for value in probe.graph.input:
        dims = [d.dim_value or 5 for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.INT64:
            feeds[value.name] = np.arange(int(np.prod(dims)), dtype=np.int64).reshape(dims)
        elif value.type.tensor_type.elem_type == TensorProto.BOOL:
            feeds[value.name] = np.array(True)
        else:
            feeds[value.name] = np.zeros(dims, np.float32)
    return run(probe, feeds)[-1]


@pytest.mark.parametrize("opset", [12, 11, 7])
@pytest.mark.parametrize(("build", "name", "axis"), [(_same_shape_table, "T", 0), (_conv_model, "W", 0)])
def test_below_opset_13_the_int8_data_is_read_through_cast_and_mul(
    build: Callable[..., onnx.ModelProto], name: str, axis: int, opset: int
) -> None:
    """Where DequantizeLinear has no axis: Mul(Cast(int8), scales shaped along the axis), which
    onnxruntime computes bit for bit as numpy's dequantization; the opset stays as it was."""
    model = build(opset)
    original = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))
    proto, result = _quantized(model)
    stored = {t.name: t for t in result.stored}  # type: ignore[attr-defined]
    assert stored[name].axis == axis and result.kept == []  # type: ignore[attr-defined]
    assert proto.opset_import[0].version == model.opset_import[0].version
    np.testing.assert_array_equal(_dequantized_in_graph(proto, name), _dequantized_in_numpy(original, axis))
    ops = [n.op_type for n in proto.graph.node]
    assert "DequantizeLinear" not in ops
    (mul,) = [n for n in proto.graph.node if n.output[0] == name]
    (cast,) = [n for n in proto.graph.node if n.output[0] == mul.input[0]]
    assert mul.op_type == "Mul" and cast.op_type == "Cast"
    assert ops.index("Cast") < ops.index("Mul")  # in order: the graph is sorted
    inits = {i.name: i for i in proto.graph.initializer}
    assert inits[cast.input[0]].data_type == TensorProto.INT8
    scales = numpy_helper.to_array(inits[mul.input[1]])
    assert scales.ndim == original.ndim and scales.shape[axis] == original.shape[axis]
    assert stored[name].bytes_after == original.size + scales.nbytes


@pytest.mark.parametrize(
    ("build", "name", "axis"),
    [
        (_table_model, "T", 1),
        (_gather_conv_model, "E", 0),
        (_gather_conv_model, "W", 0),
        (_subgraph_model, "Outer", 0),
    ],
)
def test_dequantized_graph_equals_numpy(build: Callable[[], onnx.ModelProto], name: str, axis: int) -> None:
    """Tables get a scale per row, conv weights per output channel, embeddings per gathered row;
    onnxruntime's DequantizeLinear gives bit for bit what numpy's dequantization gives."""
    model = build()
    original = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))
    proto, result = _quantized(model)
    stored = {t.name: t for t in result.stored}  # type: ignore[attr-defined]
    assert stored[name].axis == axis
    expected = _dequantized_in_numpy(original, axis)
    np.testing.assert_array_equal(_dequantized_in_graph(proto, name), expected)
    dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == name]
    assert len(dq) == 1 and helper.get_attribute_value(dq[0].attribute[0]) == axis
    inits = {i.name: i for i in proto.graph.initializer}
    assert inits[dq[0].input[0]].data_type == TensorProto.INT8


def test_rounding_is_onnxruntime_int8_weight_quantization() -> None:
    """Per slice, the int8 values and scales are onnxruntime's quantize_data (symmetric int8)."""
    from onnxruntime.quantization.quant_utils import quantize_data

    array = RNG.standard_normal((6, 40)).astype(np.float32)
    array[2] = 0.0  # a slice of zeros: scale 1, values 0
    q, scales = quantize_data_int8(array, 0)
    for row in range(6):
        zero_point, scale, values = quantize_data(array[row], TensorProto.INT8, True)
        assert zero_point == 0
        np.testing.assert_array_equal(q[row], values)
        assert scales[row] == scale
    assert np.abs(q).max() <= 127


def test_bytes_saved_per_tensor() -> None:
    """Each stored tensor's bytes before and after; int8 plus one float32 scale per row."""
    proto, result = _quantized(_table_model(rows=400))
    (stored,) = result.stored  # type: ignore[attr-defined]
    assert stored.bytes_before == 400 * 64 * 4
    assert stored.bytes_after == 400 * 64 + 400 * 4
    assert stored.saved_bytes == stored.bytes_before - stored.bytes_after
    assert result.saved_bytes == stored.saved_bytes  # type: ignore[attr-defined]
    assert (
        len(proto.SerializeToString())
        < len(_table_model(rows=400).SerializeToString()) - stored.saved_bytes + 4096
    )


def test_accuracy_with_a_big_table() -> None:
    """A NeMo-like table [1, 4000, 64] sliced by length: the output keeps its cosine."""
    model = _table_model(rows=4000)
    proto, result = _quantized(model)
    assert [t.name for t in result.stored] == ["T"]  # type: ignore[attr-defined]
    for length in (17, 200, 4000):
        feeds = {"x": RNG.standard_normal((1, length, 64)).astype(np.float32)}
        (ref,), (out,) = run(model, feeds), run(proto, feeds)
        cosine = float(np.dot(ref.ravel(), out.ravel()) / (np.linalg.norm(ref) * np.linalg.norm(out)))
        assert cosine > 0.9999
        assert np.abs(ref - out).max() < 0.02


def test_subgraph_tables_are_stored_in_their_scope() -> None:
    """Initializers of If branches get their DequantizeLinear inside the branch; both branches stay exact."""
    model = _subgraph_model()
    proto, result = _quantized(model)
    assert sorted(t.name for t in result.stored) == ["Outer", "else_table", "then_table"]  # type: ignore[attr-defined]
    if_node = next(n for n in proto.graph.node if n.op_type == "If")
    for attr in if_node.attribute:
        ops = [n.op_type for n in attr.g.node]
        assert ops[0] == "DequantizeLinear"
        assert {i.data_type for i in attr.g.initializer} == {TensorProto.INT8, TensorProto.FLOAT}
    inner = {i.name: numpy_helper.to_array(i) for i in all_initializers_of(model)}
    x = RNG.standard_normal((128, 160)).astype(np.float32)
    for cond in (True, False):
        table = _dequantized_in_numpy(inner["then_table" if cond else "else_table"], 0)
        outer = _dequantized_in_numpy(inner["Outer"], 0)
        expected = (table + outer if cond else table - outer) * x
        (out,) = run(proto, {"c": np.array(cond), "x": x})
        np.testing.assert_array_equal(out, expected)


def all_initializers_of(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    found = list(model.graph.initializer)
    for node in all_nodes(model.graph):
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found.extend(attr.g.initializer)
    return found


@dataclasses.dataclass
class KeptExample:
    id: str
    build: Callable[[], onnx.ModelProto]
    name: str


def _graph_input_table() -> onnx.ModelProto:
    model = _table_model()
    model.graph.input.append(helper.make_tensor_value_info("T", TensorProto.FLOAT, [1, 300, 64]))
    return model


def _bias_model(dims: list[int]) -> onnx.ModelProto:
    bias = RNG.standard_normal(dims).astype(np.float32)
    return _model(
        [helper.make_node("Add", ["x", "B"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
        [numpy_helper.from_array(bias, "B")],
    )


def _with_inf() -> onnx.ModelProto:
    model = _table_model()
    table = numpy_helper.to_array(model.graph.initializer[0]).copy()
    table[0, 3, 5] = np.inf
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(table, "T"))
    return model


def _double_table() -> onnx.ModelProto:
    table = RNG.standard_normal((300, 64))
    return _model(
        [helper.make_node("Add", ["x", "T"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [300, 64])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [300, 64])],
        [numpy_helper.from_array(table, "T")],
    )


def _function_constant() -> onnx.ModelProto:
    table = RNG.standard_normal((300, 64)).astype(np.float32)
    function = helper.make_function(
        "local",
        "AddTable",
        ["a"],
        ["b"],
        [
            helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(table, "t")),
            helper.make_node("Add", ["a", "t"], ["b"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    graph = helper.make_graph(
        [helper.make_node("AddTable", ["x"], ["y"], domain="local")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [300, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [300, 64])],
    )
    return helper.make_model(
        graph,
        functions=[function],
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
    )


KEPT: dict[KeptReason, list[KeptExample]] = {
    KeptReason.OPSET_BELOW_7: [
        KeptExample("table-opset-6", lambda: _same_shape_table(opset=6), "T"),
        KeptExample("table-opset-5", lambda: _same_shape_table(opset=5), "T"),
    ],
    KeptReason.UNSUPPORTED_DTYPE: [
        KeptExample("float16-below-19", lambda: _table_model(dtype=np.float16, rows=600), "T"),
        KeptExample("double", _double_table, "T"),
    ],
    KeptReason.ONE_DIMENSIONAL: [
        KeptExample("bias", lambda: _bias_model([20000]), "B"),
        KeptExample("long-bias", lambda: _bias_model([40000]), "B"),
    ],
    KeptReason.GRAPH_INPUT: [
        KeptExample("overridable-table", _graph_input_table, "T"),
        KeptExample(
            "overridable-bias-2d", lambda: _with_input(_bias_model([200, 100]), "B", [200, 100]), "B"
        ),
    ],
    KeptReason.NOT_FINITE: [
        KeptExample("inf", _with_inf, "T"),
        KeptExample("nan", lambda: _with_value(_table_model(), np.nan), "T"),
    ],
    KeptReason.IN_FUNCTION: [
        KeptExample("function-constant", _function_constant, "t"),
        KeptExample("function-constant-again", _function_constant, "t"),
    ],
}


def _with_input(model: onnx.ModelProto, name: str, dims: list[int]) -> onnx.ModelProto:
    model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
    return model


def _with_value(model: onnx.ModelProto, value: float) -> onnx.ModelProto:
    table = numpy_helper.to_array(model.graph.initializer[0]).copy()
    table[0, 1, 2] = value
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(table, "T"))
    return model


def test_every_kept_reason_has_examples() -> None:
    # opset_below_13 is no longer given (below 13 the weights are read through Cast and Mul)
    assert set(KEPT) == set(KeptReason) - {KeptReason.OPSET_BELOW_13}
    assert all(len(examples) >= 2 for examples in KEPT.values())
    assert all(reason.description for reason in KeptReason)


@pytest.mark.parametrize(
    ("reason", "example"),
    [(reason, example) for reason, examples in KEPT.items() for example in examples],
    ids=[example.id for examples in KEPT.values() for example in examples],
)
def test_kept_reason(reason: KeptReason, example: KeptExample) -> None:
    """The tensor stays as it was, listed with its reason; the model is unchanged."""
    model = example.build()
    ir_model = ir.serde.deserialize_model(model)
    result = quantize_other_weights(ir_model)
    assert result.stored == []
    assert [(t.name, t.reason) for t in result.kept] == [(example.name, reason)]
    assert "DequantizeLinear" not in [n.op_type for n in ir_model.graph]


def test_small_tensors_and_nbits_weights_are_left_alone() -> None:
    """Below 64 KiB nothing is listed; a 2-D MatMul weight left float on purpose stays float."""
    small = RNG.standard_normal((MIN_BYTES // 4 - 1,)).astype(np.float32).reshape(1, -1)
    weight = RNG.standard_normal((256, 256)).astype(np.float32)
    model = _model(
        [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "S"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(small[:, :256], "S")],
    )
    result = quantize_other_weights(ir.serde.deserialize_model(model))
    assert result.stored == [] and result.kept == []


def test_cli_other_weights_reports_saved_bytes(tmp_path: Path) -> None:
    """quantize --other-weights int8: the JSON report lists each stored tensor and its saving."""
    import json

    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    source = tmp_path / "table.onnx"
    onnx.save(_gather_conv_model(), source)
    report = tmp_path / "r.json"
    result = CliRunner().invoke(
        main,
        [
            "quantize",
            str(source),
            str(tmp_path / "q.onnx"),
            "--other-weights",
            "int8",
            "-q",
            "--report-json",
            str(report),
            "--verify-lengths",
            "7,30",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(report.read_text())
    stored = {t["name"]: t for t in data["other_weights"]["stored"]}
    assert set(stored) == {"E", "W"}
    assert stored["E"]["saved_bytes"] == 500 * 64 * 3 - 500 * 4
    assert data["options"]["quantize"]["other_weights"] == "int8"
    assert data["verification"]["passed"]


def test_matmulnbits_scales_are_not_other_weights() -> None:
    """After MatMulNBits quantization its float scales (here 64 KiB and more) stay as they are."""
    from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits
    from onnx_conv2matmul.quantize.options import QuantizeOptions

    weight = RNG.standard_normal((512, 1024)).astype(np.float32)
    model = _model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])],
        [numpy_helper.from_array(weight, "W")],
    )
    ir_model = ir.serde.deserialize_model(model)
    quantize_matmul_nbits(ir_model, QuantizeOptions(block_size=16))
    scales = [v for v in ir_model.graph.initializers.values() if v.const_value.dtype == ir.DataType.FLOAT]
    assert scales and scales[0].const_value.nbytes >= MIN_BYTES
    result = quantize_other_weights(ir_model)
    assert result.stored == [] and result.kept == []


@st.composite
def _tables(draw: st.DrawFn) -> tuple[np.ndarray, str]:
    """A float32 table of rank 2-4 (at least 64 KiB) and the op that reads it."""
    rank = draw(st.integers(2, 4))
    dims = [draw(st.integers(1, 6)) for _ in range(rank - 2)]
    rows = draw(st.integers(2, 300))
    cols = max(2, -(-MIN_BYTES // (4 * rows * int(np.prod(dims or [1])))))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    table = (scale * rng.standard_normal([*dims, rows, cols])).astype(np.float32)
    if draw(st.booleans()):
        table[..., draw(st.integers(0, rows - 1)), :] = 0.0  # a row of zeros: scale 1
    return table, draw(st.sampled_from(["Add", "Mul"]))


@settings(max_examples=examples(25))
@given(case=_tables())
def test_property_dequantized_graph_equals_numpy(case: tuple[np.ndarray, str]) -> None:
    """Any float32 table read by an elementwise op, per row: onnxruntime computes exactly the
    numpy dequantization of onnxruntime's own int8 values, at batch sizes 1 and 3."""
    table, op = case
    elem = TensorProto.FLOAT
    model = _model(
        [helper.make_node(op, ["x", "T"], ["y"])],
        [helper.make_tensor_value_info("x", elem, ["N", *table.shape])],
        [helper.make_tensor_value_info("y", elem, ["N", *table.shape])],
        [numpy_helper.from_array(table, "T")],
    )
    proto, result = _quantized(model)
    (stored,) = result.stored  # type: ignore[attr-defined]
    assert stored.axis == table.ndim - 2
    expected = _dequantized_in_numpy(table, table.ndim - 2)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, *table.shape)).astype(np.float32)
        (out,) = run(proto, {"x": x})
        np.testing.assert_array_equal(out, x + expected if op == "Add" else x * expected)


def test_no_matmulnbits_node_leaves_no_kernel_setting_to_retry(tmp_path: Path) -> None:
    """A result measured slower than the original where nothing became MatMulNBits (only the
    other weights stored as int8): the other accuracy levels are not tried, the outcome is kept."""
    from types import SimpleNamespace
    from typing import Any, cast

    from onnx_conv2matmul.files.progress import NullProgress
    from onnx_conv2matmul.quantize import kernel
    from onnx_conv2matmul.quantize.options import QuantizeOptions
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.verify.check import VerifyOptions

    path = tmp_path / "table.onnx"
    onnx.save(_gather_conv_model(), path)
    staged = cast(Any, SimpleNamespace(onnx_path=str(path)))
    outcome = kernel.SpeedOutcome(kernel.Variant(32, staged, None), None, None, cast(Any, None), 1)
    step = kernel.SpeedStep(str(path), ConvertOptions(), VerifyOptions(), NullProgress())
    kept = kernel.retry_levels(step, outcome, QuantizeOptions(), SpeedOptions(), (0, 4))
    assert kept is outcome and kept.choice is None


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_cache_gives_the_same_int8_without_quantizing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_disk: bool
) -> None:
    """The search builds several models from the same weights: with the cache, the second build's
    other weights are read back (onnxruntime's quantize_data is not called again) and the model is
    byte for byte the first's; a tensor kept in float is kept again."""
    from onnx_conv2matmul.quantize import other_weights
    from onnx_conv2matmul.quantize.blockwise import BlockCache, MemoryBlockCache

    source = _gather_conv_model()
    calls: list[int] = []
    real = other_weights.quantize_data_int8

    def counted(array: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(1)
        return real(array, axis)

    monkeypatch.setattr(other_weights, "quantize_data_int8", counted)
    cache = BlockCache(str(tmp_path / "blocks")) if on_disk else MemoryBlockCache()
    built, counts = [], []
    for _ in range(2):
        model = ir.serde.deserialize_model(onnx.ModelProto.FromString(source.SerializeToString()))
        result = quantize_other_weights(model, cache=cache)
        built.append((ir.serde.serialize_model(model).SerializeToString(), result))
        counts.append(len(calls))
    first = counts[0]
    assert first == len(built[0][1].stored) > 0 and counts[1] == first  # none the second time
    assert built[0][0] == built[1][0]
    assert built[0][1].stored == built[1][1].stored and built[0][1].kept == built[1][1].kept
    model = ir.serde.deserialize_model(onnx.ModelProto.FromString(source.SerializeToString()))
    quantize_other_weights(model)  # without a cache: quantized again
    assert len(calls) == 2 * first
