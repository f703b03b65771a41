"""Every quantization path runs on every layout the rewrite accepts, or refuses with exit 2 and its
reason; none ends in an internal error (exit 3). Issue 42, item 2: the algorithms and int8 paths
against weights in initializers, in Constant nodes, in external data, in If branches, at opset 12
and 21. The default run takes each path on the Constant-node layout (the one that broke); the slow
set takes the whole table."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from helpers import no_bench, session
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize.weight_only import torch_available
from test_constants import C, _feeds, constant_weights_model


def _initializers(opset: int) -> onnx.ModelProto:
    """The Constant-node model with its weights moved to initializers by onnx's own tools."""
    model = constant_weights_model(opset)
    graph = model.graph
    for node in [n for n in graph.node if n.op_type == "Constant"]:
        tensor = onnx.TensorProto()
        tensor.CopyFrom(node.attribute[0].t)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        graph.node.remove(node)
    onnx.checker.check_model(model)
    return model


def _save_plain(model: onnx.ModelProto, path: Path) -> None:
    onnx.save(model, path)


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # onnx.save turns the tensors it writes out into references, in place
    onnx.save(copy, path, save_as_external_data=True, location=f"{path.name}.data", size_threshold=1024)


LAYOUTS: dict[str, tuple[Callable[[], onnx.ModelProto], Callable[[onnx.ModelProto, Path], None]]] = {
    "constants-opset12": (lambda: constant_weights_model(12), _save_plain),
    "constants-opset21": (lambda: constant_weights_model(21), _save_plain),
    "initializers-opset21": (lambda: _initializers(21), _save_plain),
    "initializers-opset12": (lambda: _initializers(12), _save_plain),
    "external-data": (lambda: _initializers(21), _save_external),
    "if-branches": (lambda: constant_weights_model(21, in_branch=True), _save_plain),
}

PATHS: dict[str, tuple[str, ...]] = {
    "default": (),
    "k_quant": ("--algorithm", "k_quant"),
    "gptq": ("--algorithm", "gptq", "--inputs", "{inputs}"),
    "gptq-without-inputs": ("--algorithm", "gptq"),
    "hqq": ("--algorithm", "hqq"),
    "int8-dynamic": ("--int8-dynamic",),
    "other-weights-int8": ("--other-weights", "int8"),
}

DEFAULT_LAYOUT = "constants-opset12"
CASES = [
    pytest.param(
        layout, path, marks=() if layout == DEFAULT_LAYOUT else pytest.mark.slow, id=f"{layout}-{path}"
    )
    for layout in LAYOUTS
    for path in PATHS
]


def _refusal(path: str) -> str | None:
    """The reason a path must refuse with (exit 2) here, or None when it must run."""
    if path == "gptq-without-inputs":
        return "the gptq algorithm needs calibration inputs"
    if path == "hqq" and not torch_available():
        return "the hqq algorithm needs torch"
    return None


@pytest.mark.parametrize(("layout", "path"), CASES)
def test_each_path_runs_or_refuses_with_its_reason(tmp_path: Path, layout: str, path: str) -> None:
    build, save = LAYOUTS[layout]
    model = build()
    src = tmp_path / "m.onnx"
    save(model, src)
    feeds = _feeds(model)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **feeds[2])  # two samples of 40 steps (and the If's flag)
    args = [a.format(inputs=inputs) for a in PATHS[path]]
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(src), str(out), "--min-cosine", "0.9", *args]
    result = CliRunner().invoke(main, no_bench(argv), catch_exceptions=False)
    assert "internal error" not in result.stderr, result.stderr
    refusal = _refusal(path)
    if refusal is not None:
        assert result.exit_code == 2, result.stderr
        assert refusal in result.stderr
        assert not out.exists()
        return
    assert result.exit_code == 0, result.stderr
    got, ref = session(str(out)), session(model)
    for feed in feeds:
        a, b = ref.run(None, feed)[0], got.run(None, feed)[0]
        assert a.shape == b.shape == (*feed["x"].shape[:2], C)
        assert float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b))) > 0.9


def test_int8_output_is_sorted_again_when_an_if_branch_reads_a_later_node(tmp_path: Path) -> None:
    """onnxruntime's quantize_dynamic left silero VAD 6.2.3's ``If`` before the node whose output
    a branch reads (the checker refused the result, exit 1): the graph is sorted again, and the
    producer and metadata are the input's."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from onnx_conv2matmul.quantize.int8_step import restore_model_fields

    branch = helper.make_graph(
        [helper.make_node("Identity", ["later"], ["out"])],
        "then",
        [],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["later"], ["neg"])],
        "else",
        [],
        [helper.make_tensor_value_info("neg", TensorProto.FLOAT, [2])],
    )
    graph = helper.make_graph(
        [  # the If first, the Relu it reads after it
            helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other),
            helper.make_node("Relu", ["x"], ["later"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    unsorted = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ort")
    path = tmp_path / "q.onnx"
    onnx.save(unsorted, path)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(onnx.load(path))
    source = ir.serde.deserialize_model(unsorted)
    source.producer_name = "exporter"
    source.metadata_props["vocab_size"] = "7"
    restore_model_fields(str(path), source)
    fixed = onnx.load(path)
    onnx.checker.check_model(fixed)
    assert [n.op_type for n in fixed.graph.node] == ["Relu", "If"]
    assert fixed.producer_name == "exporter" and {p.key: p.value for p in fixed.metadata_props} == {
        "vocab_size": "7"
    }
    x = np.array([-1.0, 2.0], np.float32)
    got = session(str(path)).run(None, {"c": np.array(True), "x": x})[0]
    np.testing.assert_array_equal(got, np.maximum(x, 0))
