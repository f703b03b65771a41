"""Tests written to kill mutants of ``gemm.py`` that survived (docs/mutation.md): the names and
types of what the Gemm rewrite emits, the ops it reports, and the C a beta of 0 leaves unread.

The names matter: ``matmul`` in the report is what a user puts in a quantizer's exclude list,
and every emitted value must carry a name and a type for the saved model to be valid.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_equivalent
from onnx_conv2matmul import ConvertOptions, Status, convert


def _gemm(name: str = "g", *, c_source: str = "initializer", beta: float = 3.0) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    b = numpy_helper.from_array(rng.standard_normal((5, 4)).astype(np.float32), "B")
    c = numpy_helper.from_array(rng.standard_normal((5,)).astype(np.float32), "C")
    nodes = []
    inits = [b]
    if c_source == "constant":
        nodes.append(helper.make_node("Constant", [], ["C"], name="c_const", value=c))
    else:
        inits.append(c)
    nodes.append(
        helper.make_node("Gemm", ["a", "B", "C"], ["y"], name=name, transA=1, transB=1, alpha=2.0, beta=beta)
    )
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, "M"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"a": rng.standard_normal((4, m)).astype(np.float32)} for m in (1, 3, 8)]


EXPECTED = [
    ("Transpose", "g/Transpose", ["a"], ["g/a_transposed"]),
    ("MatMul", "g/MatMul", ["g/a_transposed", "B_matmul"], ["g/matmul"]),
    ("Constant", "g/alpha_const", [], ["g/alpha"]),
    ("Mul", "g/Mul", ["g/matmul", "g/alpha"], ["g/scaled"]),
    ("Constant", "g/beta_const", [], ["g/beta"]),
    ("Mul", "g/Mul_1", ["C", "g/beta"], ["g/c_scaled"]),
    ("Add", "g/Add", ["g/scaled", "g/c_scaled"], ["y"]),
]


def test_every_emitted_node_and_value_has_its_name_and_type() -> None:
    model = _gemm()
    rewritten, report = convert(model, ConvertOptions())
    (entry,) = report.entries
    assert (entry.status, entry.matmul, entry.extra_ops) == (
        Status.CONVERTED,
        "g/MatMul",
        ["Transpose", "Mul", "Mul"],
    )
    assert [(n.op_type, n.name, list(n.input), list(n.output)) for n in rewritten.graph.node] == EXPECTED
    ir_model = ir.serde.deserialize_model(rewritten)
    for node in ir_model.graph:
        for value in node.outputs:
            assert value.type == ir.TensorType(ir.DataType.FLOAT), value
        if node.op_type == "Constant":
            tensor = node.attributes["value"].value
            assert (tensor.dtype, tensor.shape.dims, tensor.name) == (
                ir.DataType.FLOAT,
                (),
                node.outputs[0].name,
            )
            assert node.outputs[0].shape == ir.Shape([])
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, _feeds())


def test_a_gemm_without_a_name_is_named_after_its_output_or_gemm() -> None:
    rewritten, _ = convert(_gemm(name=""), ConvertOptions())
    assert [n.name for n in rewritten.graph.node][:2] == ["y/Transpose", "y/MatMul"]
    model = ir.serde.deserialize_model(_gemm(name=""))
    (gemm,) = model.graph
    gemm.outputs[0].name = None
    model.graph.outputs.clear()
    identity = ir.node("Identity", [gemm.outputs[0]], name="keep")
    identity.outputs[0].name = "y"
    model.graph.append(identity)
    model.graph.outputs.append(identity.outputs[0])
    rewritten_ir, _ = convert(model, ConvertOptions())
    made = [n.name for n in rewritten_ir.graph if n.op_type != "Identity"]
    assert made[:2] == ["Gemm/Transpose", "Gemm/MatMul"], made


def test_beta_zero_drops_a_constant_c_nothing_else_reads() -> None:
    model = _gemm(c_source="constant", beta=0.0)
    rewritten, report = convert(model, ConvertOptions())
    assert report.entries[0].extra_ops == ["Transpose", "Mul"]
    assert "Constant" not in [n.op_type for n in rewritten.graph.node if n.name == "c_const"]
    assert "c_const" not in [n.name for n in rewritten.graph.node]
    assert report.tensors_removed == 2  # B (now B_matmul) and the unread C
    assert_equivalent(model, rewritten, _feeds())


def test_a_converted_gemm_says_what_it_folded() -> None:
    _, report = convert(_gemm(), ConvertOptions())
    assert report.entries[0].detail == "transA, transB, alpha 2, beta 3"
    _, report = convert(_gemm(c_source="constant", beta=0.0), ConvertOptions())
    assert report.entries[0].detail == "transA, transB, alpha 2, beta 0, C not read"


def test_gemms_the_rewrite_cannot_express_say_why() -> None:
    from onnx_conv2matmul import SkipReason

    no_opset = _gemm()
    del no_opset.opset_import[:]
    no_opset.opset_import.append(helper.make_opsetid("other", 1))
    _, report = convert(no_opset, ConvertOptions())
    assert [(e.reason, e.detail) for e in report.entries] == [
        (SkipReason.OPSET_UNSUPPORTED, "model imports no default-domain opset")
    ]
    model = ir.serde.deserialize_model(_gemm())
    (gemm,) = model.graph
    gemm.replace_input_with(1, None)
    _, report = convert(model, ConvertOptions())
    assert [(e.reason, e.detail) for e in report.entries] == [
        (SkipReason.INVALID_ATTRIBUTES, "Gemm without input A or B, or not with one output")
    ]


def test_a_c_of_shape_m_by_1_is_checked_against_the_rows_of_a() -> None:
    """A [3, 4] (M = 3), C [3, 1]: C broadcasts over the columns, so the Gemm converts."""
    rng = np.random.default_rng(2)
    b = numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "B")
    c = numpy_helper.from_array(rng.standard_normal((3, 1)).astype(np.float32), "C")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "B", "C"], ["y"], name="g")],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [b, c],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    rewritten, report = convert(model, ConvertOptions())
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    feeds = [{"a": rng.standard_normal((3, 4)).astype(np.float32)} for _ in range(2)]
    assert_equivalent(model, rewritten, feeds)
