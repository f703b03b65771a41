"""Coverage as a figure (issue 42, item 5): the share of the original's float weight bytes the
result stores quantized, by the kind of node that used each weight in the original."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize.inspection import coverage, coverage_text, weight_kinds

DATA = Path(__file__).parent / "data"


def _every_kind() -> onnx.ModelProto:
    """MatMul, Gemm, a pointwise and a 3x3 Conv, a Gather (embedding) and a weight two MatMuls
    share, one of them in a Constant node."""
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    constant = helper.make_node("Constant", [], ["Wc"], value=w("Wc_value", 64, 64))
    nodes = [
        constant,
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
        helper.make_node("MatMul", ["h1", "W1"], ["h2"], name="mm_shared"),
        helper.make_node("MatMul", ["h2", "Wc"], ["h3"], name="mm_const"),
        helper.make_node("Gemm", ["h3", "W2", "b2"], ["y"], name="gemm"),
        helper.make_node("Conv", ["img", "K1"], ["c1"], name="pointwise"),
        helper.make_node("Conv", ["c1", "K3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("Gather", ["E", "ids"], ["emb"], name="embed"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64]),
            helper.make_tensor_value_info("img", TensorProto.FLOAT, ["N", 16, 8, 8]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32]),
            helper.make_tensor_value_info("c3", TensorProto.FLOAT, ["N", 32, 8, 8]),
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["N", 16]),
        ],
        [
            w("W1", 64, 64),
            w("W2", 64, 32),
            w("b2", 32),
            w("K1", 32, 16, 1, 1),
            w("K3", 32, 32, 3, 3),
            w("E", 100, 16),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_every_weight_counts_once_by_the_kind_of_its_first_user() -> None:
    kinds = weight_kinds(ir.serde.deserialize_model(_every_kind()))
    four = 4
    assert kinds.total == {
        "MatMul": (64 * 64 + 64 * 64) * four,  # W1 once (shared), the Constant's
        "Gemm": 64 * 32 * four,
        "pointwise Conv": 32 * 16 * four,
        "other Conv": 32 * 32 * 9 * four,
        "Gather": 100 * 16 * four,
        "other": 32 * four,  # the Gemm's bias
    }
    assert kinds.matmul_bytes == {"mm1": 16384, "mm_shared": 16384, "mm_const": 16384}


def test_coverage_follows_the_rewrite_to_the_matmul_it_made() -> None:
    kinds = weight_kinds(ir.serde.deserialize_model(_every_kind()))

    class Entry:
        def __init__(self, op_type: str, matmul: str, weight_bytes: int) -> None:
            self.op_type, self.matmul, self.weight_bytes = op_type, matmul, weight_bytes

    entries = [Entry("Conv", "pointwise/MatMul", 2048), Entry("Gemm", "gemm/MatMul", 8192)]
    section = coverage(kinds, entries, ["mm1", "pointwise/MatMul", "gemm/MatMul"], {"E": 6400})
    by_kind = section["by_kind"]
    assert by_kind["MatMul"]["quantized_bytes"] == 16384 and by_kind["MatMul"]["share"] == 0.5
    assert by_kind["pointwise Conv"]["share"] == 1.0 and by_kind["Gemm"]["share"] == 1.0
    assert by_kind["Gather"]["share"] == 1.0 and by_kind["other Conv"]["share"] == 0.0
    total = section["total"]
    assert total["quantized_bytes"] == 16384 + 2048 + 8192 + 6400
    # mm1 and mm_shared read the same weight: quantized by both, it counts once.
    shared = coverage(kinds, [], ["mm1", "mm_shared"])["by_kind"]["MatMul"]
    assert shared["quantized_bytes"] == 16384 and shared["share"] == 0.5
    assert coverage_text(section).startswith(f"{total['share']:.0%} of ")


def test_the_report_gives_coverage_by_kind(tmp_path: Path) -> None:
    src = str(DATA / "conformer_small.onnx")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(
        main, ["quantize", src, str(tmp_path / "q.onnx"), "--no-bench", "--report-json", str(report)]
    )
    assert result.exit_code == 0, result.output
    section = json.loads(report.read_text())["coverage"]
    assert section["total"]["quantized_bytes"] == sum(
        r["quantized_bytes"] for r in section["by_kind"].values()
    )
    assert section["by_kind"]["pointwise Conv"]["share"] > 0.9  # the rewrite's doing
    assert section["by_kind"]["MatMul"]["share"] == 1.0 and section["by_kind"]["other Conv"]["share"] == 0.0
    assert "weights stored quantized, by kind" in result.output


def test_other_weights_stored_as_int8_count_by_their_kind(tmp_path: Path) -> None:
    """A Paddle-style model, weights in Constant nodes: its 80 KiB 5x5 conv's weight, stored as int8
    by --other-weights, counts as another conv's."""
    from test_constants import constant_weights_model

    onnx.save(constant_weights_model(13), tmp_path / "m.onnx")
    report = tmp_path / "r.json"
    args = ["quantize", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--other-weights", "int8"]
    result = CliRunner().invoke(
        main, [*args, "--no-bench", "--min-cosine", "0.9", "--report-json", str(report)]
    )
    assert result.exit_code == 0, result.output
    section = json.loads(report.read_text())["coverage"]
    assert section["by_kind"]["other Conv"]["quantized_bytes"] >= 80 * 1024


def test_int8_dynamic_reports_no_coverage(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    args = ["quantize", str(DATA / "conformer_small.onnx"), str(tmp_path / "q.onnx"), "--int8-dynamic"]
    result = CliRunner().invoke(
        main, [*args, "--no-bench", "--min-cosine", "0.9", "--report-json", str(report)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["coverage"] is None


def test_inspect_gives_what_could_be_quantized(tmp_path: Path) -> None:
    onnx.save(_every_kind(), tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "m.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    section = json.loads(result.output[result.output.index("{") :])["coverage"]
    by_kind = section["by_kind"]
    # Every MatMul weight and the Gemm's once rewritten; not the 3x3 conv's, nor the pointwise
    # conv's, whose rewrite would add Transposes beside that channels-first 3x3 conv.
    assert by_kind["MatMul"]["share"] == 1.0 and by_kind["Gemm"]["share"] == 1.0
    assert by_kind["pointwise Conv"]["share"] == 0.0 and by_kind["other Conv"]["share"] == 0.0
