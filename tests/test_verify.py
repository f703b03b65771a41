"""Verification: passes correct rewrites of any model, fails real differences, gates the output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from helpers import ALL, conv_model, no_bench, stack_model
from onnx_conv2matmul import ConvertOptions, convert, convert_file
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import ModelLoadError
from onnx_conv2matmul.rewrite import apply as rewrite_mod
from onnx_conv2matmul.verify.check import VerifyOptions, VerifyReport, verify_models

RNG = np.random.default_rng(5)
EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)


def _save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, path)
    return str(path)


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _scaled(model: onnx.ModelProto, factor: float) -> onnx.ModelProto:
    first = model.graph.initializer[0]
    array = numpy_helper.to_array(first)
    first.CopyFrom(numpy_helper.from_array((array * factor).astype(array.dtype), first.name))
    return model


def _vad_model() -> onnx.ModelProto:
    """audio [B, T] + state [2, B, 8] + sr scalar; an If on sr picks one of two pointwise convs."""

    def branch(tag: str, scale: float) -> onnx.GraphProto:
        w = numpy_helper.from_array((RNG.standard_normal((8, 4, 1)) * scale).astype(np.float32), f"w_{tag}")
        return helper.make_graph(
            [
                helper.make_node("Constant", [], [f"w_{tag}_c"], value=w),
                helper.make_node("Conv", ["feat", f"w_{tag}_c", "bias"], [f"y_{tag}"], name=f"conv_{tag}"),
            ],
            tag,
            [],
            [helper.make_tensor_value_info(f"y_{tag}", TensorProto.FLOAT, None)],
        )

    nodes = [
        helper.make_node("Unsqueeze", ["audio", "axis1"], ["a3"]),
        helper.make_node("Conv", ["a3", "w_front"], ["feat"], name="front", pads=[1, 1]),
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        helper.make_node(
            "If",
            ["is16k"],
            ["y"],
            name="rate_if",
            then_branch=branch("then", 1.0),
            else_branch=branch("else", 0.5),
        ),
        helper.make_node("ReduceMean", ["y", "axis2"], ["pooled"], keepdims=0),
        helper.make_node("Gather", ["state", "zero"], ["s0"], axis=0),
        helper.make_node("Add", ["pooled", "s0"], ["output"]),
        helper.make_node("Add", ["state", "one"], ["stateN"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(RNG.standard_normal((4, 1, 3)).astype(np.float32), "w_front"),
        numpy_helper.from_array(RNG.standard_normal(8).astype(np.float32), "bias"),
        numpy_helper.from_array(np.array(16000, np.int64), "sr16k"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "vad",
        [
            helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", "samples"]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", 8]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", 8]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _deep_model(layers: int = 40, channels: int = 16) -> onnx.ModelProto:
    """A residual stack of pointwise convs whose outputs reach about 10."""
    nodes, inits = [], []
    h = "x"
    for i in range(layers):
        w = (RNG.standard_normal((channels, channels, 1)) * 0.6 / np.sqrt(channels)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [h, f"w{i}"], [f"c{i}"], name=f"pw{i}"))
        nodes.append(helper.make_node("Add", [h, f"c{i}"], [f"h{i}"]))
        h = f"h{i}"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    graph = helper.make_graph(
        nodes,
        "deep",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", channels, "T"])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_correct_rewrites_pass(tmp_path: Path, spatial: int) -> None:
    src = _save(conv_model(spatial=spatial, attrs={"strides": [2] * spatial}), tmp_path / "m.onnx")
    report = convert_file(
        src, tmp_path / "o.onnx", EXTENDED, verify=VerifyOptions(lengths=(5, 16, 33), batch=2)
    )
    assert report.return_code == 0
    verification = report.verification
    assert verification is not None and verification.passed
    assert {r.length for r in verification.results} == {5, 16, 33}
    assert all(r.shape[0] == 2 for r in verification.results)


def test_several_inputs_state_and_sample_rate(tmp_path: Path) -> None:
    original = _save(_vad_model(), tmp_path / "vad.onnx")
    for sr in (16000, 8000):
        out = tmp_path / f"vad_{sr}.onnx"
        report = convert_file(
            original,
            out,
            EXTENDED,
            verify=VerifyOptions(inputs={"sr": sr}, lengths=(64, 100), batch=3),
        )
        assert report.return_code == 0, report.verification
        assert len(report.converted) == 2  # the k=3 front conv stays
        v = report.verification
        assert v is not None
        assert v.inputs == {
            "audio": "standard normal",
            "state": "zeros (state)",
            "sr": f"fixed {sr}",
        }
        assert [r.output for r in v.results][:2] == ["output", "stateN"]


def test_fp16_passes_with_default_thresholds(tmp_path: Path) -> None:
    """Conv and MatMul round fp16 differently: the limits rise to what fp16 can hold."""
    nodes, inits = [], []
    h = "x"
    for i in range(6):
        w = (RNG.standard_normal((512, 512, 1)) / 16).astype(np.float16)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [h, f"w{i}"], [f"h{i}"], name=f"pw{i}"))
        h = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "fp16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 512, "T"])],
        [helper.make_tensor_value_info(h, TensorProto.FLOAT16, ["N", 512, "T"])],
        inits,
    )
    src = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    report = convert_file(src, tmp_path / "o.onnx", verify=VerifyOptions(batch=2))
    assert report.return_code == 0, report.verification
    # A real fp16 error is still caught.
    assert not verify_models(src, _save(_scaled(onnx.load(src), 1.01), tmp_path / "bad.onnx")).passed


def test_deep_model_with_large_outputs_passes(tmp_path: Path) -> None:
    src = _save(_deep_model(), tmp_path / "deep.onnx")
    report = convert_file(src, tmp_path / "o.onnx", verify=VerifyOptions(batch=2))
    v = report.verification
    assert v is not None and v.passed, v
    assert max(r.max_ref for r in v.results) > 8, "the model is meant to reach ~10"


def _perturbed_candidate(tmp_path: Path, delta: str) -> tuple[str, str]:
    original = _deep_model(layers=8)
    src = _save(original, tmp_path / "deep.onnx")
    rewritten, _ = convert(original, ALL)
    init = next(t for t in rewritten.graph.initializer if t.name == "w3_matmul")
    w = numpy_helper.to_array(init).copy()
    if delta == "ulp":
        w[0, 0] = np.nextafter(w[0, 0], np.float32(np.inf))
    else:
        w[0, 0] += np.float32(1e-2 * (w.max() - w.min()))
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    return src, _save(rewritten, tmp_path / "cand.onnx")


def test_weight_changed_by_one_percent_of_range_fails(tmp_path: Path) -> None:
    src, cand = _perturbed_candidate(tmp_path, "1e-2")
    report = verify_models(src, cand)
    assert not report.passed
    assert report.failures and report.failures[0].max_abs > 3e-5
    code, _, stderr = _invoke("verify", src, cand)
    assert code == 1 and "Verification FAILED" in stderr


def test_weight_changed_by_one_ulp_passes(tmp_path: Path) -> None:
    src, cand = _perturbed_candidate(tmp_path, "ulp")
    assert verify_models(src, cand).passed
    code, _, stderr = _invoke("verify", src, cand, "--cosine")
    assert code == 0 and "Verification PASSED" in stderr and "cosine" in stderr


def test_min_cosine_criterion(tmp_path: Path) -> None:
    src, cand = _perturbed_candidate(tmp_path, "1e-2")
    assert verify_models(src, cand, VerifyOptions(min_cosine=0.99)).passed
    assert not verify_models(src, cand, VerifyOptions(min_cosine=0.9999999)).passed


def test_integer_outputs_must_match_exactly(tmp_path: Path) -> None:
    def model(offset: int) -> onnx.ModelProto:
        graph = helper.make_graph(
            [helper.make_node("Add", ["n", "k"], ["m"])],
            "ints",
            [helper.make_tensor_value_info("n", TensorProto.INT64, ["B"])],
            [helper.make_tensor_value_info("m", TensorProto.INT64, ["B"])],
            [numpy_helper.from_array(np.array(offset, np.int64), "k")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    a, b = _save(model(0), tmp_path / "a.onnx"), _save(model(1), tmp_path / "b.onnx")
    report = verify_models(a, b)
    assert not report.passed and "exact" in report.failures[0].note
    assert verify_models(a, a).passed


def _break_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the rewrite write every transposed weight off by 0.1 in its first element."""
    original = rewrite_mod.transpose_2d

    def wrong(array: np.ndarray) -> np.ndarray:
        out = original(array)
        out[0, 0] += out.dtype.type(0.1)
        return out

    monkeypatch.setattr(rewrite_mod, "transpose_2d", wrong)


def test_failed_verification_writes_nothing_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _save(conv_model(spatial=1), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    report_path = tmp_path / "r.json"
    _break_rewrite(monkeypatch)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, _stdout, stderr = _invoke(
        src, str(out), "--allow-added-transposes", "--verify", "--report-json", str(report_path)
    )
    assert code == 1
    assert "Verification FAILED" in stderr and "nothing was written" in stderr
    data = json.loads(report_path.read_text())
    assert data["verification"]["passed"] is False
    failure = data["verification"]["failures"][0]
    assert failure["output"] == "y" and failure["length"] == 64 and failure["max_abs"] > 3e-5
    assert data["output"] is None and data["return_code"] == 1
    assert data["files"]["external_data"] is False
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "r.json"}
    assert after == before

    # --inplace: the original stays as it was.
    code, _, _ = _invoke(src, "--inplace", "--allow-added-transposes", "--verify", "-q")
    assert code == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "r.json"} == before

    # --keep-on-failure keeps the output aside, never at the target.
    code, _, stderr = _invoke(src, str(out), "--allow-added-transposes", "--verify", "--keep-on-failure")
    assert code == 1 and not out.exists()
    kept = tmp_path / "o.onnx.verify-failed" / "o.onnx"
    assert kept.exists() and "kept for inspection" in stderr
    onnx.checker.check_model(str(kept))


def test_inplace_verify_compares_against_the_original(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    _save(conv_model(spatial=2, attrs={"pads": [1, 1, 0, 0]}), src)
    code, _, stderr = _invoke(
        str(src),
        "--inplace",
        "--extended-conv1x1",
        "--allow-added-transposes",
        "--verify",
        "--verify-lengths",
        "4,9",
        "--verify-batch",
        "2",
    )
    assert code == 0 and "Verification PASSED" in stderr
    model = onnx.load(src)
    onnx.checker.check_model(model)
    assert "Conv" not in [n.op_type for n in model.graph.node]


def test_cli_verify_options_and_exit_2(tmp_path: Path) -> None:
    src = _save(_vad_model(), tmp_path / "vad.onnx")
    out = str(tmp_path / "o.onnx")
    code, stdout, stderr = _invoke(
        src,
        out,
        "--extended-conv1x1",
        "--verify",
        "--verify-input",
        "sr=8000",
        "--verify-dim",
        "samples=50",
        "--verify-batch",
        "2",
        "--verify-seed",
        "3",
        "--verify-output-index",
        "0",
        "--verify-deterministic-cpu",
        "--report-json-stdout",
    )
    assert code == 0, stderr
    v = json.loads(stdout)["verification"]
    assert {r["output"] for r in v["results"]} == {"output"}
    assert v["options"]["dims"] == {"samples": 50} and v["options"]["deterministic"] is True
    # A bad option value or inputs the original cannot run on: exit 2, nothing written.
    k3 = _save(conv_model(spatial=1, kernel=[3]), tmp_path / "k3.onnx")
    for model, args, message in (
        (src, ["--verify-lengths", "a,b"], "comma-separated"),
        (src, ["--verify-input", "sr"], "NAME=VALUE"),
        (src, ["--verify-dim", "samples=0"], "must be >= 1"),
        (k3, ["--verify-lengths", "1"], "cannot run the original model at length 1"),
    ):
        code, _, stderr = _invoke(model, str(tmp_path / "x.onnx"), "--verify", *args)
        assert code == 2, (args, stderr)
        assert message in stderr
        assert "Traceback" not in stderr
        assert not (tmp_path / "x.onnx").exists()


def test_verify_command_rejects_mismatched_models(tmp_path: Path) -> None:
    a = _save(conv_model(spatial=1), tmp_path / "a.onnx")
    b = _save(_deep_model(layers=1), tmp_path / "b.onnx")
    code, _, stderr = _invoke("verify", a, b)
    assert code == 2 and "different" in stderr
    code, _, stderr = _invoke("verify", a, str(tmp_path / "missing.onnx"))
    assert code == 2 and "not found" in stderr


@pytest.mark.parametrize("candidate", ["unknown-op", "not-onnx"])
def test_candidate_that_onnxruntime_cannot_load(tmp_path: Path, candidate: str) -> None:
    """A model this package wrote that onnxruntime cannot load fails its check (convert
    --verify, quantize: exit 1); a file the user names to the verify command is an input
    error (exit 2, one line), as an unloadable original is, not a row "length 0, inf"."""
    original = conv_model(spatial=1)
    src = _save(original, tmp_path / "m.onnx")
    cand = tmp_path / "broken.onnx"
    if candidate == "unknown-op":
        broken = onnx.ModelProto()
        broken.CopyFrom(original)
        broken.graph.node[0].op_type = "NoSuchOp"
        _save(broken, cand)
    else:
        cand.write_text("not a model\n")
    report = verify_models(src, str(cand))
    assert not report.passed and report.failures[0].output == "*"
    assert "cannot load the candidate" in report.failures[0].note
    with pytest.raises(ModelLoadError, match="cannot load the candidate"):
        verify_models(src, str(cand), candidate_given=True)
    code, stdout, stderr = _invoke("verify", src, str(cand), "--report-json-stdout")
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "onnxruntime cannot load the candidate model" in lines[0], stderr
    assert json.loads(stdout)["return_code"] == 2


def test_input_synthesis_rules() -> None:
    from onnx_conv2matmul.verify.check import synthesise_inputs
    from onnx_conv2matmul.verify.roles import InputSpec

    specs = [
        InputSpec("audio", np.float32, ["B", 80, "T"]),
        InputSpec("audio_len", np.int64, ["B"]),
        InputSpec("state", np.float16, [2, "B", 16]),
        InputSpec("mask", np.bool_, [None, "T"]),
        InputSpec("ids", np.int32, ["B", "U"]),
        InputSpec("pcm", np.int16, ["B", "S"]),
        InputSpec("img", np.uint8, ["B", 3, "H", "W"]),
        InputSpec("rate", np.int64, []),
        InputSpec("x64", np.float64, [4]),
    ]
    options = VerifyOptions(batch=2, inputs={"rate": 16000}, dims={"H": 5, "U": 3})
    feeds, how = synthesise_inputs(specs, 37, options)
    assert feeds["audio"].shape == (2, 80, 37) and feeds["audio"].dtype == np.float32
    assert feeds["audio_len"].tolist() == [37, 37] and how["audio_len"] == "length of T per batch row"
    assert feeds["state"].dtype == np.float16 and not feeds["state"].any()
    assert feeds["mask"].shape == (2, 37) and feeds["mask"].dtype == np.bool_
    assert feeds["ids"].shape == (2, 3) and feeds["ids"].dtype == np.int32
    assert feeds["pcm"].shape == (2, 37) and feeds["pcm"].dtype == np.int16
    assert feeds["img"].shape == (2, 3, 5, 37) and feeds["img"].dtype == np.uint8
    assert feeds["rate"].shape == () and int(feeds["rate"]) == 16000
    assert feeds["x64"].shape == (4,) and feeds["x64"].dtype == np.float64
    # Seeded: the same inputs every time, different per length.
    again, _ = synthesise_inputs(specs, 37, options)
    np.testing.assert_array_equal(feeds["audio"], again["audio"])
    other, _ = synthesise_inputs(specs, 38, options)
    assert other["audio"].shape[-1] == 38
    # The signal input is never zeroed, even when its name looks like state.
    named, how = synthesise_inputs(specs, 8, VerifyOptions(signal_input="state"))
    assert named["state"].any() and how["state"] == "standard normal"


def test_rank_1_signal_input_takes_the_lengths(tmp_path: Path) -> None:
    """wave [samples] is a signal, not a batch of one: it takes every verify length."""
    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["wave", "axes"], ["w2"]),
            helper.make_node("Unsqueeze", ["w2", "axes"], ["w3"]),
            helper.make_node("Conv", ["w3", "W"], ["y"], name="pw"),
        ],
        "wave",
        [helper.make_tensor_value_info("wave", TensorProto.FLOAT, ["samples"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, "samples"])],
        [
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
            numpy_helper.from_array(RNG.standard_normal((3, 1, 1)).astype(np.float32), "W"),
        ],
    )
    src = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "w.onnx")
    report = verify_models(src, src, VerifyOptions(lengths=(64, 97)))
    assert [r.shape for r in report.results] == [[1, 3, 64], [1, 3, 97]]


def test_output_index_is_checked_before_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_conv2matmul.verify import check as verify_mod

    src = _save(conv_model(spatial=1), tmp_path / "m.onnx")
    monkeypatch.setattr(verify_mod, "synthesise_inputs", lambda *a: pytest.fail("ran the model"))
    code, _, stderr = _invoke("verify", src, src, "--verify-output-index", "9")
    assert code == 2 and "out of range" in stderr


def _channel_scale_model(factors: list[float]) -> onnx.ModelProto:
    """y = x * k on x [N, C, T], k [C, 1]: a NaN or Inf factor makes that channel non-finite."""
    k = np.array(factors, np.float32).reshape(-1, 1)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", len(factors), "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", len(factors), "T"])],
        [numpy_helper.from_array(k, "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _verify_scales(tmp_path: Path, reference: list[float], candidate: list[float]) -> bool:
    ref = _save(_channel_scale_model(reference), tmp_path / "ref.onnx")
    cand = _save(_channel_scale_model(candidate), tmp_path / "cand.onnx")
    return verify_models(ref, cand, VerifyOptions(lengths=(16,), batch=2)).passed


def _verify_scales_with(
    tmp_path: Path, reference: list[float], candidate: list[float], **options: Any
) -> VerifyReport:
    ref = _save(_channel_scale_model(reference), tmp_path / "ref.onnx")
    cand = _save(_channel_scale_model(candidate), tmp_path / "cand.onnx")
    return verify_models(ref, cand, VerifyOptions(lengths=(16,), batch=2, **options))


CRITERIA: dict[str, dict[str, Any]] = {
    "exact": {},
    "cosine": {"min_cosine": 0.99},
    "report-only": {"report_only": True},
}


@pytest.mark.parametrize("criterion", list(CRITERIA))
def test_nan_and_inf_at_the_same_places_pass_and_the_finite_rest_decides(
    tmp_path: Path, criterion: str
) -> None:
    """Masked frames or padding give NaN or Inf in both models at the same places: the finite
    elements are compared, and the row says how many of each (issue 43, rule 1)."""
    nan, inf = float("nan"), float("inf")
    options = CRITERIA[criterion]
    report = _verify_scales_with(tmp_path, [1.0, nan, 2.0], [1.0, nan, 2.0], **options)
    assert report.passed
    assert all("NaN/Inf at the same 32 places in both; the 64 finite elements compared" in r.note
               for r in report.results)  # fmt: skip
    assert _verify_scales_with(tmp_path, [1.0, inf, nan], [1.0, inf, nan], **options).passed
    # Nothing finite left: nothing was compared, so it cannot pass, whatever the criterion.
    report = _verify_scales_with(tmp_path, [nan, inf, nan], [nan, inf, nan], **options)
    assert not report.passed and "no element is finite in both models" in report.results[0].note
    if criterion != "report-only":  # the finite part still decides
        assert not _verify_scales_with(tmp_path, [1.0, nan, 2.0], [1.0, nan, -2.0], **options).passed
    # Places that differ fail in every criterion.
    assert not _verify_scales_with(tmp_path, [1.0, nan, 2.0], [1.0, 1.0, 2.0], **options).passed


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.5])
def test_outputs_of_small_values_are_held_to_a_relative_error(tmp_path: Path, scale: float) -> None:
    """An output whose values are all small (around 1e-6) that doubles or flips its sign is not
    exact: beside the scaled differences, which are taken against at least 1, the relative error
    must stay within SMALL_OUTPUT_REL_ERR (issue 43, rule 1)."""
    base = [scale, scale / 2, scale * 2]
    assert _verify_scales_with(tmp_path, base, base).passed
    assert _verify_scales_with(tmp_path, base, [float(np.float32(f) * (1 + 2**-22)) for f in base]).passed
    for wrong in ([2 * f for f in base], [-f for f in base], [f * 1.25 for f in base]):
        report = _verify_scales_with(tmp_path, base, wrong)
        assert not report.passed, wrong
        note = report.results[0].note
        assert "above the limits" in note or "relative error" in note, note
    if scale == 1e-6:  # the scaled differences alone pass it: the relative error decides
        note = _verify_scales_with(tmp_path, base, [2 * f for f in base]).results[0].note
        assert "relative error 1 above 0.1 on an output whose values are all below 1" in note, note


def test_verify_command_passes_nan_at_the_same_places_and_fails_where_they_differ(tmp_path: Path) -> None:
    nan = float("nan")
    ref = _save(_channel_scale_model([1.0, nan, 2.0]), tmp_path / "ref.onnx")
    same = _save(_channel_scale_model([1.0, nan, 2.0]), tmp_path / "same.onnx")
    moved = _save(_channel_scale_model([nan, 1.0, 2.0]), tmp_path / "moved.onnx")
    for extra in ((), ("--min-cosine", "0.99")):
        code, _, stderr = _invoke("verify", str(ref), str(same), "--verify-lengths", "16", *extra)
        assert code == 0, stderr
        code, _, stderr = _invoke("verify", str(ref), str(moved), "--verify-lengths", "16", *extra)
        assert code == 1 and "NaN/Inf in one model and not the same in the other" in stderr


def test_nan_or_inf_that_differ_fail(tmp_path: Path) -> None:
    nan, inf = float("nan"), float("inf")
    # NaN everywhere, or where the reference is finite: nothing finite is left to compare.
    assert not _verify_scales(tmp_path, [1.0, 1.0, 1.0], [nan, nan, nan])
    assert not _verify_scales(tmp_path, [1.0, 1.0, 2.0], [1.0, nan, 2.0])
    # A finite value where the reference has NaN, and opposite infinities at the same place.
    assert not _verify_scales(tmp_path, [1.0, nan, 2.0], [1.0, 1.0, 2.0])
    assert not _verify_scales(tmp_path, [1.0, inf, 2.0], [1.0, -inf, 2.0])
    # The finite part is still compared next to matching non-finite values.
    assert not _verify_scales(tmp_path, [1.0, inf, 2.0], [1.0, inf, 2.02])


def test_non_finite_mismatch_is_reported(tmp_path: Path) -> None:
    nan = float("nan")
    ref = _save(_channel_scale_model([1.0, 1.0]), tmp_path / "ref.onnx")
    cand = _save(_channel_scale_model([1.0, nan]), tmp_path / "cand.onnx")
    report = verify_models(ref, cand, VerifyOptions(lengths=(16,)))
    failure = report.failures[0]
    assert failure.mismatches == 16 and "NaN/Inf" in failure.note


def _loud_channel_model(quiet_gain: float = 1.0) -> onnx.ModelProto:
    """A pointwise conv whose output channel 0 is 1000x larger than the others."""
    model = conv_model(spatial=1, in_channels=6, out_channels=5)
    init = next(t for t in model.graph.initializer if t.name == "W")
    w = numpy_helper.to_array(init).copy()
    w[0] *= 1000
    w[3] *= np.float32(quiet_gain)
    init.CopyFrom(numpy_helper.from_array(w, "W"))
    return model


def test_exact_rewrite_with_one_loud_channel_passes(tmp_path: Path) -> None:
    src = _save(_loud_channel_model(), tmp_path / "m.onnx")
    report = convert_file(src, tmp_path / "o.onnx", ALL, verify=VerifyOptions(batch=2))
    v = report.verification
    assert v is not None and v.passed, v
    assert min(r.max_ref for r in v.results) > 1000


def test_error_in_a_quiet_channel_next_to_a_loud_one_fails(tmp_path: Path) -> None:
    """0.25% off in one channel is caught although another channel is 1000x larger."""
    src = _save(_loud_channel_model(), tmp_path / "m.onnx")
    cand = _save(_loud_channel_model(quiet_gain=1.0025), tmp_path / "cand.onnx")
    report = verify_models(src, cand)
    assert not report.passed
    assert all(r.max_abs > 1e-3 for r in report.results)


def test_error_in_a_quiet_time_step_fails() -> None:
    """The same for a slice along any other axis: one quiet time step among loud ones."""
    from onnx_conv2matmul.verify.check import compare_arrays

    ref = (RNG.standard_normal((1, 4, 50)) * 1000).astype(np.float32)
    ref[:, :, 7] /= 1000
    out = ref.copy()
    out[:, :, 7] *= np.float32(1.0025)
    assert compare_arrays(ref, ref.copy(), VerifyOptions(), length=50, name="y").passed
    assert not compare_arrays(ref, out, VerifyOptions(), length=50, name="y").passed


def _string_model(words: list[str]) -> onnx.ModelProto:
    """x [N] float -> y = x, its text (Cast to string) and a constant string tensor."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["y"]),
            helper.make_node("Cast", ["x"], ["text"], to=TensorProto.STRING),
            helper.make_node("Identity", ["words"], ["labels"]),
        ],
        "strings",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"]),
            helper.make_tensor_value_info("text", TensorProto.STRING, ["N"]),
            helper.make_tensor_value_info("labels", TensorProto.STRING, [len(words)]),
        ],
        [helper.make_tensor("words", TensorProto.STRING, [len(words)], [w.encode() for w in words])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_string_outputs_must_match_exactly(tmp_path: Path) -> None:
    ref = _save(_string_model(["speech", "1"]), tmp_path / "ref.onnx")
    report = verify_models(ref, ref, VerifyOptions(lengths=(8,)))
    assert report.passed
    assert [(r.output, r.dtype) for r in report.results] == [
        ("y", "float32"),
        ("text", "string"),
        ("labels", "string"),
    ]
    # "1.0" is not "1", although both read as the same number.
    cand = _save(_string_model(["speech", "1.0"]), tmp_path / "cand.onnx")
    report = verify_models(ref, cand, VerifyOptions(lengths=(8,)))
    assert [r.output for r in report.failures] == ["labels"]
    failure = report.failures[0]
    assert failure.mismatches == 1 and failure.max_abs == 1.0 and "exact" in failure.note


def _sequence_model(gain: float = 1.0, split: list[int] | None = None) -> onnx.ModelProto:
    """A pointwise conv, then SplitToSequence along the channels: a sequence output."""
    model = conv_model(spatial=1, in_channels=6, out_channels=3)
    init = next(t for t in model.graph.initializer if t.name == "W")
    w = numpy_helper.to_array(init).copy()
    w[2] *= np.float32(gain)
    init.CopyFrom(numpy_helper.from_array(w, "W"))
    graph = model.graph
    inputs = ["y"]
    if split is not None:
        graph.initializer.append(numpy_helper.from_array(np.array(split, np.int64), "split"))
        inputs.append("split")
    graph.node.append(helper.make_node("SplitToSequence", inputs, ["parts"], axis=1))
    graph.output.append(helper.make_tensor_sequence_value_info("parts", TensorProto.FLOAT, None))
    return model


def test_sequence_outputs_are_compared_element_by_element(tmp_path: Path) -> None:
    src = _save(_sequence_model(), tmp_path / "m.onnx")
    report = convert_file(src, tmp_path / "o.onnx", ALL, verify=VerifyOptions(lengths=(16, 33)))
    v = report.verification
    assert v is not None and v.passed, v
    parts = [r for r in v.results if r.output == "parts"]
    assert [(r.dtype, r.shape) for r in parts] == [("sequence(float32)", [3])] * 2
    code, _, stderr = _invoke("verify", src, src, "--verify-lengths", "16")
    assert code == 0 and "sequence of 3" in stderr
    # 1% off in the last element only.
    cand = _save(_sequence_model(gain=1.01), tmp_path / "cand.onnx")
    report = verify_models(src, cand, VerifyOptions(lengths=(16,)))
    assert {r.output for r in report.failures} == {"y", "parts"}
    assert "element 2" in next(r.note for r in report.failures if r.output == "parts")
    # A sequence of another length.
    cand = _save(_sequence_model(split=[1, 2]), tmp_path / "two.onnx")
    report = verify_models(src, cand, VerifyOptions(lengths=(16,)))
    assert [r.output for r in report.failures] == ["parts"]
    assert "2 elements" in report.failures[0].note and "reference 3" in report.failures[0].note


def test_unknown_input_and_dim_names_are_refused(tmp_path: Path) -> None:
    """A misspelt name would leave the input random (e.g. the wrong If branch checked)."""
    from onnx_conv2matmul.errors import InputError

    src = _save(_vad_model(), tmp_path / "vad.onnx")
    with pytest.raises(InputError, match=r"'SR'.*audio, state, sr"):
        verify_models(src, src, VerifyOptions(inputs={"SR": 16000}, lengths=(64,)))
    with pytest.raises(InputError, match=r"'sample'.*batch, samples"):
        verify_models(src, src, VerifyOptions(dims={"sample": 50}, lengths=(64,)))
    with pytest.raises(InputError, match=r"'audio_len'.*audio, state, sr"):
        verify_models(src, src, VerifyOptions(length_input="audio_len", lengths=(64,)))
    assert verify_models(src, src, VerifyOptions(inputs={"sr": 8000}, dims={"samples": 50})).passed


def test_cli_refuses_unknown_input_and_dim_names(tmp_path: Path) -> None:
    src = _save(_vad_model(), tmp_path / "vad.onnx")
    out = tmp_path / "o.onnx"
    for args, names in (
        (["--verify-input", "sR=16000"], "audio, state, sr"),
        (["--verify-dim", "T=64"], "batch, samples"),
    ):
        code, _, stderr = _invoke(src, str(out), "--extended-conv1x1", "--verify", *args)
        assert code == 2, stderr
        assert len(stderr.strip().splitlines()) == 1 and names in stderr, stderr
        assert not out.exists()
        code, _, stderr = _invoke("verify", src, src, *args)
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and names in stderr, stderr


def _detector_model(levels: int = 5) -> onnx.ModelProto:
    """A YOLO-like net on images [N, 3, H, W]: ``levels`` stride-2 3x3 convs, a pointwise
    lateral conv on the deepest features, Resize x2, Concat with the features one level up,
    a pointwise head. H and W must be multiples of 2**levels for the Concat to fit."""
    rng = np.random.default_rng(11)
    nodes, inits = [], []
    h, channels = "images", 3
    for i in range(levels):
        out = 8 * (i // 2 + 1)
        w = (rng.standard_normal((out, channels, 3, 3)) / np.sqrt(9 * channels)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"down{i}_w"))
        nodes.append(
            helper.make_node("Conv", [h, f"down{i}_w"], [f"down{i}"], strides=[2, 2], pads=[1, 1, 1, 1])
        )
        nodes.append(helper.make_node("Relu", [f"down{i}"], [f"act{i}"]))
        h, channels = f"act{i}", out
    skip, skip_channels = f"act{levels - 2}", 8 * ((levels - 2) // 2 + 1)
    inits += [
        numpy_helper.from_array(rng.standard_normal((8, channels, 1, 1)).astype(np.float32), "lateral_w"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        numpy_helper.from_array(
            rng.standard_normal((6, 8 + skip_channels, 1, 1)).astype(np.float32), "head_w"
        ),
        numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "head_b"),
    ]
    nodes += [
        helper.make_node("Conv", [h, "lateral_w"], ["lateral"], name="lateral"),
        helper.make_node("Resize", ["lateral", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Concat", ["up", skip], ["merged"], axis=1),
        helper.make_node("Conv", ["merged", "head_w", "head_b"], ["preds"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("preds", TensorProto.FLOAT, ["N", 6, "h", "w"])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_detector_verifies_with_default_options(tmp_path: Path) -> None:
    """Image inputs take sizes that are multiples of 32 by default (80 does not fit stride 32)."""
    src = _save(_detector_model(), tmp_path / "det.onnx")
    report = convert_file(src, tmp_path / "o.onnx", ALL, verify=VerifyOptions())
    v = report.verification
    assert v is not None and v.passed, v
    assert len(report.converted) == 2
    assert v.lengths == [64, 96, 128, 160] and v.lengths_not_run == []
    assert "multiples of 32" in v.lengths_rule
    assert [r.shape for r in v.results] == [[1, 6, n // 16, n // 16] for n in (64, 96, 128, 160)]
    code, _, stderr = _invoke(src, str(tmp_path / "cli.onnx"), "--allow-added-transposes", "--verify")
    assert code == 0 and "Verification PASSED" in stderr, stderr
    assert "Lengths: 64, 96, 128, 160 (default for image inputs: multiples of 32" in stderr
    code, _, stderr = _invoke("quantize", src, str(tmp_path / "q.onnx"))
    assert code == 0 and (tmp_path / "q.onnx").exists(), stderr


def test_lengths_the_original_cannot_run_are_replaced(tmp_path: Path) -> None:
    """A stride-64 net fits 64 and 128 but not 96 or 160: spare sizes take their place."""
    src = _save(_detector_model(levels=6), tmp_path / "det.onnx")
    report = verify_models(src, src)
    assert report.passed
    data = report.to_dict()["lengths"]
    assert data["used"] == [64, 128, 192, 256]
    assert [entry["length"] for entry in data["not_run"]] == [96, 160]
    assert all("Concat" in entry["error"] for entry in data["not_run"]), data
    assert sorted({r.length for r in report.results}) == [64, 128, 192, 256]
    # Lengths given by the user are used as given: no spares.
    from onnx_conv2matmul.verify.check import ModelRunError

    with pytest.raises(ModelRunError, match="at length 96"):
        verify_models(src, src, VerifyOptions(lengths=(64, 96)))


def test_sequence_inputs_keep_the_default_lengths(tmp_path: Path) -> None:
    from onnx_conv2matmul.verify.check import DEFAULT_LENGTHS

    src = _save(conv_model(spatial=1), tmp_path / "m.onnx")
    lengths = verify_models(src, src).to_dict()["lengths"]
    assert lengths["used"] == list(DEFAULT_LENGTHS) and lengths["rule"].startswith("default")
    given = verify_models(src, src, VerifyOptions(lengths=(7, 5))).to_dict()["lengths"]
    assert {k: given[k] for k in ("used", "rule", "not_run")} == {
        "used": [7, 5],
        "rule": "given",
        "not_run": [],
    }


@pytest.mark.parametrize("command", ["verify", "quantize"])
def test_quiet_silences_the_tables_never_the_error_line(tmp_path: Path, command: str) -> None:
    """-q on a run that fails its criterion (exit 1) printed nothing at all, not even the reason
    (issue 43, rule 6): it prints the one error line, and nothing on stdout."""
    ref = _save(_channel_scale_model([1.0, 2.0, 3.0]), tmp_path / "ref.onnx")
    if command == "verify":
        cand = _save(_channel_scale_model([1.0, 2.0, 3.5]), tmp_path / "cand.onnx")
        argv = ["verify", str(ref), str(cand), "--verify-lengths", "16", "-q"]
    else:
        argv = ["quantize", str(_save(stack_model(), tmp_path / "s.onnx")), str(tmp_path / "q.onnx")]
        argv += ["-q", "--min-cosine", "0.99999999", "--bits", "4", "--block-size", "32"]
    code, stdout, stderr = _invoke(*argv)
    assert code == 1
    assert stdout == ""
    lines = [line for line in stderr.splitlines() if not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "verification failed" in lines[0] or "accuracy below" in lines[0], lines[0]
