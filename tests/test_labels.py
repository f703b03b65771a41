"""Criteria shaped like the output (verify/labels.py): outputs of class scores found in the graph,
their labels counted per sample or as read from the frames, judged over a whole check with what the
count can promise, in verify, quantize's default run and --auto."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import edit_distance
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.verify.compare import OutputComparison
from onnx_conv2matmul.verify.labels import (
    FRAMES,
    LABELS,
    MIN_AGREEMENT,
    TaskResult,
    _at_most,
    agreement_bound,
    agreement_floor,
    count,
    edits,
    labels_needed,
    output_tasks,
    read_labels,
    task_results,
    unpromisable,
    unpromised,
)
from onnx_conv2matmul.verify.options import VerifyOptions

K = 64


# --------------------------------------------------------------------------- #
# Which outputs hold class scores: decided from the graph
# --------------------------------------------------------------------------- #
def _head(
    op: str, rank: int, *, axis: int | None = None, name: str = "y", opset: int = 17
) -> onnx.ModelProto:
    """x -> op -> name, of ``rank`` with 10 classes on the last axis."""
    shape: list[int | str] = ["N", "T", 10][-rank:] if rank <= 3 else ["N", "T", "U", 10]
    attrs = {} if axis is None else {"axis": axis}
    nodes = [helper.make_node(op, ["x"], [name], **attrs)] if op else []
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(name if op else "x", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_head("Softmax", 2), {"y": LABELS}),
        (_head("Softmax", 3), {"y": FRAMES}),
        (_head("LogSoftmax", 3, axis=2), {"y": FRAMES}),
        (_head("Softmax", 4, axis=-1), {"y": FRAMES}),
        (_head("Softmax", 3, axis=1), {}),  # over the positions, not the classes
        (_head("Softmax", 3, opset=11), {}),  # opset 11's default axis is 1: a flattened softmax
        (_head("Softmax", 2, opset=11), {"y": LABELS}),  # ... which is the last of two
        (_head("Relu", 3), {}),  # features: no evidence
        (_head("Relu", 2, name="logits"), {"logits": LABELS}),  # named as logits
        (_head("Relu", 2, name="cls_Logits_out"), {"cls_Logits_out": LABELS}),
    ],
)
def test_the_graph_decides_which_outputs_hold_class_scores(model: onnx.ModelProto, expected: dict) -> None:
    assert output_tasks(model) == expected
    assert output_tasks(model, "cosine") == {}


def test_a_softmax_spelt_out_marks_its_output_and_a_name_alone_no_map() -> None:
    nodes = [
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
        helper.make_node("Div", ["e", "s"], ["target_label"]),
        helper.make_node("Relu", ["m"], ["logits_map"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 214]),
            helper.make_tensor_value_info("m", TensorProto.FLOAT, ["N", 1, "H", "W"]),
        ],
        [
            helper.make_tensor_value_info("target_label", TensorProto.FLOAT, ["N", 214]),
            helper.make_tensor_value_info("logits_map", TensorProto.FLOAT, ["N", 1, "H", "W"]),
        ],
        [numpy_helper.from_array(np.array([-1], np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert output_tasks(model) == {"target_label": LABELS}


def test_an_argmax_or_topk_over_the_last_axis_marks_its_input_through_identity() -> None:
    for op, attrs, marked in (
        ("ArgMax", {"axis": -1}, True),
        ("ArgMax", {"axis": 2}, True),
        ("ArgMax", {}, False),  # ArgMax's default axis is 0
        ("TopK", {}, True),
    ):
        extra = [helper.make_tensor_value_info("ids", TensorProto.INT64, None)]
        inputs = ["scores"] if op == "ArgMax" else ["scores", "k"]
        nodes = [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Identity", ["r"], ["scores"]),
            helper.make_node(op, inputs, ["ids", "vals"] if op == "TopK" else ["ids"], **attrs),
        ]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 30])],
            [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", "T", 30]), *extra],
            [numpy_helper.from_array(np.array([1], np.int64), "k")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        assert output_tasks(model) == ({"scores": FRAMES} if marked else {}), op


def test_forced_labels_take_every_float_output_that_can_hold_classes() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["x"], ["b"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 5]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 1]),  # one score: no label
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert output_tasks(model) == {}
    assert output_tasks(model, "labels") == {"a": LABELS}


# --------------------------------------------------------------------------- #
# Counting
# --------------------------------------------------------------------------- #
def test_labels_count_every_sample_and_a_non_finite_one_as_changed() -> None:
    ref = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.4], [2.0, 1.0]], np.float32)
    out = np.array([[1.0, 0.1], [0.2, 0.1], [0.5, 0.4], [np.nan, 1.0]], np.float32)
    assert count(ref, out, LABELS) == (4, 2)
    assert count(ref[:, :1], out[:, :1], LABELS) == (0, 0)  # one class: nothing to pick


def _scores(tops: list[list[int]], classes: int = 4) -> np.ndarray:
    """Log-probabilities [sequences, positions, classes] whose top class is ``tops``' (0.7 likely)."""
    top = np.array(tops)
    scores = np.full((*top.shape, classes), np.log(0.3 / (classes - 1)), np.float32)
    np.put_along_axis(scores, top[..., None], np.log(0.7), axis=-1)
    return scores


def test_frames_count_the_labels_read_and_the_edits_between_the_readings() -> None:
    # Blank 0 tops 9 of 16 positions: repeats merged, blanks dropped, fp32 reads 1 2 2 3 | 3 1.
    ref = _scores([[0, 1, 1, 0, 2, 0, 2, 3], [0, 0, 0, 0, 3, 0, 0, 1]])
    assert count(ref, ref, FRAMES) == (6, 0)
    # A run shortened, a blank moved: the same reading.
    same = _scores([[0, 1, 0, 0, 2, 0, 2, 3], [0, 0, 0, 3, 3, 0, 0, 1]])
    assert count(ref, same, FRAMES) == (6, 0)
    # The blank between two 2s turned into 2: they merge (a deletion); a 1 read as 2 (a substitution).
    moved = _scores([[0, 1, 1, 0, 2, 2, 2, 3], [0, 0, 0, 0, 3, 0, 0, 2]])
    assert count(ref, moved, FRAMES) == (6, 2)
    # A candidate that reads more than fp32 is counted against the longer reading.
    noisy = _scores([[1, 2, 1, 2, 1, 2, 1, 2], [0, 0, 0, 0, 3, 0, 0, 1]])
    read = edits(np.array([1, 2, 2, 3]), np.array([1, 2, 1, 2, 1, 2, 1, 2]))
    assert count(ref, noisy, FRAMES) == (8 + 2, read) and read == 5
    # One frame of 16 moved off the blank-free runs: one label of the six read.
    assert count(ref, _scores([[0, 1, 1, 0, 1, 0, 2, 3], [0, 0, 0, 0, 3, 0, 0, 1]]), FRAMES) == (6, 1)


def test_no_label_is_dropped_without_a_blank_and_masked_positions_are_left_out() -> None:
    # No class tops half the positions: nothing dropped, only repeats merged.
    ref = _scores([[1, 1, 2, 3, 0, 0]])
    assert count(ref, ref, FRAMES) == (4, 0)
    # fp32 gives no finite scores at a position (masked): left out of both readings; the
    # candidate's non-finite scores where fp32's are finite read as a label of their own.
    masked = ref.copy()
    masked[0, 3] = np.nan
    out = masked.copy()
    out[0, 3] = 0.0  # finite where fp32 is masked: not read
    assert count(masked, out, FRAMES) == (3, 0)
    out[0, 4] = np.inf
    assert count(masked, out, FRAMES) == (4, 1)  # 1 2 0 -> 1 2 ? 0: one inserted


@given(
    st.lists(st.integers(0, 3), max_size=12),
    st.lists(st.integers(0, 3), max_size=12),
)
@settings(max_examples=200, deadline=None)
def test_edits_is_the_levenshtein_distance(a: list[int], b: list[int]) -> None:
    assert edits(np.array(a, np.int64), np.array(b, np.int64)) == edit_distance(a, b)
    runs = [x for i, x in enumerate(a) if i == 0 or a[i - 1] != x]
    assert list(read_labels(np.array(a, np.int64), None)) == runs


# --------------------------------------------------------------------------- #
# What a count promises
# --------------------------------------------------------------------------- #
def test_the_rule_of_three_and_the_labels_a_promise_needs() -> None:
    assert labels_needed(0.99) == 299
    assert agreement_bound(299, 0) >= 0.99 > agreement_bound(298, 0)
    assert agreement_bound(30, 0) == pytest.approx(0.05 ** (1 / 30))
    assert agreement_bound(0, 0) == 0.0 and agreement_bound(5, 5) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 700), st.sampled_from([0.9, 0.95, 0.98, 0.99, 1.0]))
def test_unpromisable_exactly_when_no_held_out_count_of_changes_could_promise(
    labels: int, floor: float
) -> None:
    """A held-out count is hopeless (known before any search) exactly when even none changed is
    unpromised; and then every number changed is unpromised too."""
    checked = [TaskResult("probs", LABELS, 10, 0, floor)]

    def held(changed: int) -> list[dict[str, object]]:
        entry = TaskResult("probs", LABELS, labels, changed, floor)
        return [{"output": "probs", "labels": labels, "changed": changed, "lower_bound": entry.bound}]

    hopeless = unpromisable(checked, held(0))
    assert (hopeless is not None) is (unpromised(checked, held(0)) is not None)
    assert (hopeless is not None) is (labels < labels_needed(floor) or floor >= 1)
    if hopeless is not None:
        assert f"has {labels} held-out labels" in hopeless
        assert all(
            unpromised(checked, held(c)) is not None for c in range(0, labels + 1, max(1, labels // 7))
        )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400), st.data())
def test_the_bound_is_the_binomial_tail_at_five_percent(n: int, data: st.DataObject) -> None:
    changed = data.draw(st.integers(0, n))
    bound = agreement_bound(n, changed)
    assert 0.0 <= bound <= (n - changed) / n
    if 0 < changed < n:
        # At the bound, seeing this few changes is a 5% event; a little above it, rarer.
        assert _at_most(n, changed, 1 - bound) == pytest.approx(0.05, abs=1e-6)
        assert agreement_bound(n, changed - 1) >= bound


def _row(output: str, labels: int, flips: int, task: str = LABELS) -> OutputComparison:
    row = OutputComparison(1, output, "float32", [labels, 2], 0.0, 0.0, 0.0, 0.999, 1.0, 0, True)
    row.labels, row.label_flips, row.task = labels, flips, task
    return row


def test_a_check_judges_each_outputs_labels_over_all_its_rows() -> None:
    rows = [_row("p", 50, 1), _row("p", 50, 0), _row("f", 1000, 11, FRAMES), _row("other", 0, 0, "")]
    found = {r.output: r for r in task_results(rows, 0.99)}
    assert set(found) == {"p", "f"}
    assert found["p"].labels == 100 and found["p"].passed  # 99% kept: at the limit
    assert not found["f"].passed and found["f"].loss == pytest.approx(1.1)
    assert task_results(rows, None) == [] and task_results(rows, 0.99, report_only=True) == []
    assert all(r.passed for r in task_results(rows, -1.0))  # -1 accepts anything
    assert agreement_floor(0.97) == 0.97 and agreement_floor(0.999) == MIN_AGREEMENT


def test_the_text_says_what_the_count_can_promise() -> None:
    text = TaskResult("prob", LABELS, 40, 0, 0.99).text()
    assert "40 of 40 labels kept" in text and "299 labels" in text and "at least 92.8%" in text
    assert "below 99%" in TaskResult("ctc", FRAMES, 100, 5, 0.99).text()


# --------------------------------------------------------------------------- #
# verify, quantize and --auto on a classifier whose labels hang on small differences
# --------------------------------------------------------------------------- #
def _near_tie_classifier(path: Path, output: str = "logits") -> np.ndarray:
    """x [N, K] -> MatMul W [K, 2] -> logits [N, 2]: both columns nearly the same, so each
    label hangs on a difference far below either score."""
    rng = np.random.default_rng(0)
    first = rng.standard_normal((K, 1)).astype(np.float32)
    w = np.concatenate([first, first + 1e-3 * rng.standard_normal((K, 1)).astype(np.float32)], axis=1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], [output], name="head")],
        "cls",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, ["N", 2])],
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


def _verify(args: list[str], report: Path) -> tuple[int, str, dict]:
    result = CliRunner().invoke(main, [*args, "--report-json", str(report)])
    return result.exit_code, " ".join(result.output.split()), json.loads(report.read_text())["verification"]


def _swapped_verify(tmp_path: Path, output: str = "logits") -> list[str]:
    """``verify`` of the near-tie classifier against itself with its two columns swapped (every
    label moves, the cosine stays), on inputs along the first column, at a minimum cosine of 0.99."""
    original = tmp_path / "cls.onnx"
    w = _near_tie_classifier(original, output)
    candidate = tmp_path / "swapped.onnx"
    model = onnx.load(original)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w[:, ::-1].copy(), "W"))
    onnx.save(model, candidate)
    inputs = _inputs(tmp_path, w)
    return ["verify", str(original), str(candidate), "--inputs", str(inputs), "--min-cosine", "0.99"]


def test_verify_fails_when_labels_move_under_a_met_cosine(tmp_path: Path) -> None:
    args = _swapped_verify(tmp_path)
    code, text, verification = _verify(args, tmp_path / "r.json")
    assert code == 1, text
    (row,) = verification["results"]
    assert row["passed"] and row["worst_cosine" if "worst_cosine" in row else "cosine"] >= 0.99
    (labels,) = verification["labels"]
    assert labels["output"] == "logits" and labels["labels"] == 200 and not labels["passed"]
    assert "First failure: output 'logits'" in text and "labels kept" in text
    assert verification["criterion"]["labels"] == "auto"
    # --criterion cosine: the cosine alone decides, as before.
    code, _, verification = _verify([*args, "--criterion", "cosine"], tmp_path / "c.json")
    assert code == 0 and verification["labels"] == []


def test_verify_passes_and_says_what_the_labels_promise(tmp_path: Path) -> None:
    args = _swapped_verify(tmp_path)
    args[2] = args[1]  # the original against itself
    code, text, verification = _verify(args, tmp_path / "r.json")
    assert code == 0, text
    (labels,) = verification["labels"]
    assert labels["changed"] == 0 and labels["lower_bound"] == pytest.approx(0.05 ** (1 / 200))
    assert "Labels ok: output 'logits': 200 of 200 labels kept" in text and "299 labels" in text


def test_an_unnamed_head_is_judged_when_labels_are_asked_for(tmp_path: Path) -> None:
    args = _swapped_verify(tmp_path, "y")
    assert _verify(args, tmp_path / "a.json")[0] == 0  # no evidence in the graph: cosine alone
    assert _verify([*args, "--criterion", "labels"], tmp_path / "l.json")[0] == 1


def _ort_labels(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0]).argmax(1)


@pytest.mark.parametrize("auto", [False, True], ids=["default", "auto"])
def test_quantize_keeps_the_labels_or_writes_nothing(tmp_path: Path, auto: bool) -> None:
    """int4 on the near-tie head keeps every sample above 0.99 and flips labels: the run goes on
    to settings that keep 99% of them (in onnxruntime, on the inputs), or writes nothing."""
    original = tmp_path / "cls.onnx"
    w = _near_tie_classifier(original)
    inputs = _inputs(tmp_path, w)
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    args = ["quantize", str(original), str(out), "--inputs", str(inputs), "--no-bench"]
    result = CliRunner().invoke(main, [*args, *(["--auto"] if auto else []), "--report-json", str(report)])
    data = json.loads(report.read_text())
    if result.exit_code == 0:
        assert out.exists()
        x = np.load(inputs)["x"]
        changed = float((_ort_labels(original, x) != _ort_labels(out, x)).mean())
        assert changed <= 1 - MIN_AGREEMENT
        (labels,) = data["verification"]["labels"]
        assert labels["passed"] and labels["changed"] == round(changed * 200)
    else:
        assert result.exit_code == 1 and not out.exists()
        assert "labels kept" in result.output


def test_uniform_int4_that_moves_labels_is_refused_with_its_reason(tmp_path: Path) -> None:
    """Settings given (no search below the criterion): the run names the labels that moved."""
    original = tmp_path / "cls.onnx"
    w = _near_tie_classifier(original)
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    args = [
        *("quantize", str(original), str(out), "--inputs", str(_inputs(tmp_path, w))),
        *("--no-bench", "--bits", "4", "--block-size", "32", "--min-cosine", "0.99"),
    ]
    result = CliRunner().invoke(main, [*args, "--report-json", str(report)])
    assert result.exit_code == 1 and not out.exists()
    text = " ".join(result.output.split())
    assert "labels kept" in text and "below 99%" in text
    assert not json.loads(report.read_text())["verification"]["labels"][0]["passed"]


def test_the_options_refuse_an_unknown_labels_mode() -> None:
    with pytest.raises(ValueError, match="labels criterion"):
        VerifyOptions(labels="top5")
    assert math.isclose(agreement_bound(1, 0), 0.05)


@pytest.mark.parametrize("command", ["verify", "quantize"])
def test_a_classifier_on_synthesised_inputs_is_refused_before_any_work(tmp_path: Path, command: str) -> None:
    """The labels of random inputs tell nothing of real ones: exit 2 naming the output and the
    two ways on (--inputs, --criterion cosine); a minimum cosine of -1 asks nothing of them."""
    original = tmp_path / "cls.onnx"
    _near_tie_classifier(original)
    second = str(original) if command == "verify" else str(tmp_path / "q.onnx")
    args = [
        command,
        str(original),
        second,
        "--min-cosine",
        "0.99",
        *(["--no-bench"] if command == "quantize" else []),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "output 'logits' holds a classifier's scores" in text and "--inputs" in text
    assert "--criterion cosine" in text and not (tmp_path / "q.onnx").exists()
    assert CliRunner().invoke(main, [*args, "--criterion", "cosine"]).exit_code == 0
    minus = [a if a != "0.99" else "-1" for a in args]
    assert CliRunner().invoke(main, minus).exit_code == 0


def test_the_search_steers_by_the_labels_too() -> None:
    """The search's target (--auto, the search below the floor) judges the labels as the check
    does: a candidate whose cosine meets the minimum but moves 5% of the labels misses, at five
    times the allowed share, and the unreachable message names the output."""
    from onnx_conv2matmul.quantize.search_options import AutoOptions
    from onnx_conv2matmul.quantize.search_runs import _Measured, _Target, _unreachable

    target = _Target(AutoOptions(min_cosine=0.99), None)
    measured = _Measured(cosine=0.999, labels={"prob": TaskResult("prob", LABELS, 100, 5, 0.0)})
    assert not target.passed(measured) and target.loss(measured) == pytest.approx(5.0)
    assert "output 'prob': 95 of 100 labels kept" in _unreachable(target, measured, 1)
    kept = _Measured(cosine=0.999, labels={"prob": TaskResult("prob", LABELS, 100, 1, 0.0)})
    assert target.passed(kept) and target.loss(kept) == pytest.approx(1.0)
