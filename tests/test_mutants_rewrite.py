"""Tests written to kill mutants of ``rewrite/`` that survived (docs/mutation.md).

The names of what a rewrite emits matter: ``matmul`` in the report is what a user puts in a
quantizer's exclude list, and every emitted node and value needs a name of its own for the saved
model to be valid and readable. Each test that rewrites a model runs it against the original in
onnxruntime.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from helpers import assert_equivalent, conv_feeds, conv_model
from onnx_conv2matmul import ConvertOptions, Status, convert

EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)


def _nodes(model: onnx.ModelProto) -> list[tuple[str, str, list[str], list[str]]]:
    return [(n.op_type, n.name, list(n.input), list(n.output)) for n in model.graph.node]


def _grouped(base: str, out: str) -> list[tuple[str, str, list[str], list[str]]]:
    return [
        ("Transpose", f"{base}/Transpose", ["x"], [f"{base}/channels_last"]),
        ("Split", f"{base}/Split", [f"{base}/channels_last"], [f"{base}/group0", f"{base}/group1"]),
        ("MatMul", f"{base}/MatMul", [f"{base}/group0", "W_matmul_group0"], [f"{base}/matmul0"]),
        ("MatMul", f"{base}/MatMul_1", [f"{base}/group1", "W_matmul_group1"], [f"{base}/matmul1"]),
        ("Concat", f"{base}/Concat", [f"{base}/matmul0", f"{base}/matmul1"], [f"{base}/matmul"]),
        ("Add", f"{base}/Add", [f"{base}/matmul", "B"], [f"{base}/biased"]),
        ("Transpose", f"{base}/Transpose_1", [f"{base}/biased"], [out]),
    ]


@pytest.mark.parametrize(("name", "base"), [("gc", "gc"), ("", "y")])
def test_a_grouped_conv_emits_named_nodes_and_values(name: str, base: str) -> None:
    """Named after the conv, else after its output: the Split, each group's part and MatMul."""
    model = conv_model(group=2, in_channels=6, out_channels=4, name=name)
    rewritten, report = convert(model, EXTENDED)
    (entry,) = report.entries
    assert (entry.status, entry.matmul, entry.extra_ops) == (
        Status.CONVERTED,
        f"{base}/MatMul",
        ["Split", "Concat"],
    )
    assert _nodes(rewritten) == _grouped(base, "y")
    onnx.checker.check_model(rewritten, full_check=True)
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(1, 5)))


def test_a_grouped_conv_without_any_name_is_named_after_conv() -> None:
    """Only a model built in memory has an unnamed conv output; the new nodes still get names."""
    original = conv_model(group=2, in_channels=6, out_channels=4, name="")
    model = ir.serde.deserialize_model(original)
    (conv,) = model.graph
    conv.outputs[0].name = None
    model.graph.outputs.clear()
    identity = ir.node("Identity", [conv.outputs[0]], name="keep")
    identity.outputs[0].name = "y"
    model.graph.append(identity)
    model.graph.outputs.append(identity.outputs[0])
    rewritten, report = convert(model, EXTENDED)
    assert [(e.status, e.matmul) for e in report.entries] == [(Status.CONVERTED, "Conv/MatMul")]
    assert isinstance(rewritten, ir.Model)
    made = _nodes(ir.serde.serialize_model(rewritten))
    assert made[-1][:2] == ("Identity", "keep")
    expected = _grouped("Conv", "Conv/transposed")
    assert [m[:3] for m in made[:-1]] == [e[:3] for e in expected]
    assert [m[3] for m in made[:-2]] == [e[3] for e in expected[:-1]]
    assert_equivalent(original, ir.serde.serialize_model(rewritten), conv_feeds(6, 1, lengths=(1, 5)))
