"""ConvToMatMulPass: the rewrite as an onnx-ir pass that composes with others."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_equivalent, assert_matmul_weights_2d, conv_feeds, conv_model, op_types
from onnx_conv2matmul import ConvertOptions, SkipReason
from onnx_conv2matmul.rewrite.passes import ConvToMatMulPass, ConvToMatMulResult

CHANNELS = 6


def _wrapped_model() -> onnx.ModelProto:
    """A pointwise conv between the Transposes an exporter of channels-last data writes,
    plus an Identity another pass removes."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((CHANNELS, CHANNELS, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Identity", ["x"], ["x1"], name="id"),
        helper.make_node("Transpose", ["x1"], ["t0"], perm=[0, 2, 1], name="t_in"),
        helper.make_node("Conv", ["t0", "W"], ["c"], name="pw"),
        helper.make_node("Transpose", ["c"], ["y"], perm=[0, 2, 1], name="t_out"),
    ]
    graph = helper.make_graph(
        nodes,
        "wrapped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", CHANNELS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", CHANNELS])],
        [numpy_helper.from_array(w, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _channels_last_feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(4)
    return [
        {"x": rng.standard_normal((b, t, CHANNELS)).astype(np.float32)} for b, t in ((1, 1), (2, 9), (3, 64))
    ]


def test_pass_manager_runs_it_with_other_passes(tmp_path: Path) -> None:
    """Case 1: in a PassManager after onnx-ir's own passes, on a model from ``ir.load``."""
    original = tmp_path / "m.onnx"
    onnx.save(_wrapped_model(), original)
    model = ir.load(original)
    rewrite = ConvToMatMulPass()
    manager = ir.passes.PassManager(
        [common_passes.IdentityEliminationPass(), rewrite, common_passes.RemoveUnusedNodesPass()]
    )
    result = manager(model)
    assert result.model is model and result.modified
    assert rewrite.report is not None and len(rewrite.report.converted) == 1
    out = tmp_path / "o.onnx"
    ir.save(model, out)
    proto = onnx.load(out)
    # The exporter's Transposes cancel with ours; the Identity went with the first pass.
    assert op_types(proto) == ["MatMul"]
    assert_matmul_weights_2d(proto, 1)
    assert_equivalent(str(original), str(out), _channels_last_feeds())


def test_the_documented_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 6: the pass example of docs/api.md, as written, on a model named as it names it."""
    page = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```python\n")[1:]]
    (example,) = [b for b in blocks if "ConvToMatMulPass" in b]
    monkeypatch.chdir(tmp_path)
    onnx.save(_wrapped_model(), "encoder.onnx")
    exec(compile(example, "docs/api.md", "exec"), {})
    assert op_types(onnx.load("encoder.matmul.onnx")) == ["Identity", "MatMul"]
    assert_equivalent("encoder.onnx", "encoder.matmul.onnx", _channels_last_feeds())


def test_call_returns_the_report() -> None:
    """Case 2: called directly, the result carries the report, and modified says whether
    anything changed."""
    model = ir.serde.deserialize_model(conv_model(spatial=2, in_channels=4, out_channels=3))
    result = ConvToMatMulPass(ConvertOptions(allow_added_transposes=True))(model)
    assert isinstance(result, ConvToMatMulResult) and result.modified
    assert result.report.totals()["converted"] == 1
    unchanged = ir.serde.deserialize_model(conv_model(spatial=1, kernel=[3]))
    result = ConvToMatMulPass()(unchanged)
    assert isinstance(result, ConvToMatMulResult) and not result.modified
    assert [e.reason for e in result.report.entries] == [SkipReason.KERNEL_NOT_POINTWISE]


def test_rewrite_through_the_pass_is_exact(tmp_path: Path) -> None:
    """Case 3: the pass's output equals the original in onnxruntime at several lengths."""
    proto = conv_model(spatial=1, in_channels=CHANNELS, out_channels=4)
    model = ir.serde.deserialize_model(proto)
    ConvToMatMulPass(ConvertOptions(allow_added_transposes=True))(model)
    rewritten = ir.serde.serialize_model(model)
    assert_matmul_weights_2d(rewritten, 1)
    assert_equivalent(proto, rewritten, conv_feeds(CHANNELS, 1))


def test_the_nodes_it_makes_are_marked() -> None:
    """Case 4: the cleanup finds the rewrite's nodes by a mark on node.meta."""
    from onnx_conv2matmul._graphs import is_created

    model = ir.serde.deserialize_model(conv_model(spatial=1))
    ConvToMatMulPass(ConvertOptions(allow_added_transposes=True))(model)
    made = [node.op_type for node in model.graph if is_created(node)]
    assert sorted(made) == ["Add", "MatMul", "Transpose", "Transpose"]


def test_requires_refuses_what_it_cannot_run_on() -> None:
    """Case 5: input validation happens before anything changes."""
    with pytest.raises(ir.passes.PreconditionError, match=r"expected an onnx_ir\.Model"):
        ConvToMatMulPass()(conv_model())  # type: ignore[arg-type]
    model = ir.serde.deserialize_model(conv_model())
    model.opset_imports[""] = 0
    before = onnx.printer.to_text(ir.serde.serialize_model(model))
    with pytest.raises(ir.passes.PreconditionError, match="invalid opset version 0"):
        ConvToMatMulPass()(model)
    assert onnx.printer.to_text(ir.serde.serialize_model(model)) == before
