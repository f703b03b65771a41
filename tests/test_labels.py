"""Class scores whose labels change under a met cosine floor: the check says cosine is the wrong
target and points to --validate (verify/labels.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner
from onnx import helper, numpy_helper

from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.verify.compare import OutputComparison
from onnx_conv2matmul.verify.labels import MAX_FLIPPED, advice, class_scores, label_flips

K = 64


def test_class_scores_are_one_row_of_classes_per_sample() -> None:
    assert class_scores((8, 2), 8) and class_scores((1, 1000), 1)
    assert not class_scores((8, 1), 8)  # one score: no label to pick
    assert not class_scores((8, 4, 2), 8)  # per position, not per sample
    assert not class_scores((4, 2), 8)


def test_label_flips_count_changed_argmax_and_unreadable_rows() -> None:
    ref = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [1.0, 3.0]], np.float32)
    out = np.array([[0.9, 0.1], [0.6, 0.4], [2.0, 1.0], [np.nan, 3.0]], np.float32)
    assert label_flips(ref, out, 4) == (4, 2)
    assert label_flips(ref[:, :1], out[:, :1], 4) is None
    assert label_flips(ref.astype(np.int64), np.nan_to_num(out).astype(np.int64), 4) is None


def _row(labels: int, flips: int, passed: bool = True) -> OutputComparison:
    row = OutputComparison(1, "prob", "float32", [labels, 2], 0.0, 0.0, 0.0, 0.999, 1.0, 0, passed)
    row.labels, row.label_flips = labels, flips
    return row


def test_advice_beyond_one_percent_of_labels_only() -> None:
    assert advice([_row(100, 1)], 0.99) == []  # exactly the limit: 99% kept
    assert MAX_FLIPPED == 0.01
    found = advice([_row(50, 1), _row(50, 1)], 0.99)  # two files of one output: 2 of 100
    assert len(found) == 1 and "wrong target" in found[0] and "--validate" in found[0]
    assert "2 of 100" in found[0]
    assert advice([_row(100, 5, passed=False)], 0.99) == []  # the floor itself failed
    assert advice([_row(100, 5)], None) == []  # no cosine floor: nothing to advise against


def _near_tie_classifier(path: Path) -> np.ndarray:
    """x [N, K] -> MatMul W [K, 2] -> logits [N, 2]: both columns nearly the same, so each
    label hangs on a difference far below either score."""
    rng = np.random.default_rng(0)
    first = rng.standard_normal((K, 1)).astype(np.float32)
    w = np.concatenate([first, first + 1e-3 * rng.standard_normal((K, 1)).astype(np.float32)], axis=1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"], name="head")],
        "cls",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return w


def _inputs(tmp_path: Path, w: np.ndarray) -> Path:
    """Inputs along the first column, so the scores are large and of one sign."""
    rng = np.random.default_rng(1)
    x = (w[:, 0] / np.linalg.norm(w[:, 0]) * 4 + 0.3 * rng.standard_normal((200, K))).astype(np.float32)
    path = tmp_path / "x.npz"
    np.savez(path, x=x)
    return path


def test_verify_says_cosine_is_the_wrong_target_when_labels_flip(tmp_path: Path) -> None:
    original = tmp_path / "cls.onnx"
    w = _near_tie_classifier(original)
    candidate = tmp_path / "swapped.onnx"
    model = onnx.load(original)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w[:, ::-1].copy(), "W"))
    onnx.save(model, candidate)
    inputs = _inputs(tmp_path, w)
    report = tmp_path / "r.json"
    result = CliRunner().invoke(
        main,
        [
            *("verify", str(original), str(candidate), "--inputs", str(inputs), "--min-cosine", "0.99"),
            *("--report-json", str(report)),
        ],
    )
    assert result.exit_code == 0, result.output  # the cosine floor is met
    text = " ".join(result.output.split())
    assert "wrong target" in text and "--validate" in text
    verification = json.loads(report.read_text())["verification"]
    (row,) = verification["results"]
    assert row["labels"] == 200 and row["label_flips"] > 2
    assert any("wrong target" in w for w in verification["warnings"])


def test_verify_is_silent_when_labels_hold(tmp_path: Path) -> None:
    original = tmp_path / "cls.onnx"
    w = _near_tie_classifier(original)
    report = tmp_path / "r.json"
    inputs = _inputs(tmp_path, w)
    args = ["verify", str(original), str(original), "--inputs", str(inputs), "--min-cosine", "0.99"]
    result = CliRunner().invoke(main, [*args, "--report-json", str(report)])
    assert result.exit_code == 0 and "wrong target" not in result.output
    (row,) = json.loads(report.read_text())["verification"]["results"]
    assert row["labels"] == 200 and row["label_flips"] == 0


def test_quantize_writes_and_says_cosine_is_the_wrong_target(tmp_path: Path) -> None:
    """int4 on the near-tie head keeps every sample above 0.99 and flips labels: the model is
    written (the floor is met) with the advice on the terminal and in the report; the flips are
    real in onnxruntime."""
    original = tmp_path / "cls.onnx"
    w = _near_tie_classifier(original)
    inputs = _inputs(tmp_path, w)
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    result = CliRunner().invoke(
        main,
        [
            *(
                "quantize",
                str(original),
                str(out),
                "--inputs",
                str(inputs),
                "--no-bench",
                "--block-size",
                "32",
            ),
            *("--report-json", str(report)),
        ],
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "wrong target" in text and "--validate" in text
    verification = json.loads(report.read_text())["verification"]
    assert any("wrong target" in w for w in verification["warnings"])
    x = np.load(inputs)["x"]
    labels = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0].argmax(1)
        for p in (original, out)
    ]
    assert (labels[0] != labels[1]).mean() > MAX_FLIPPED
