"""Messages and refusals of quantize, verify and their settings: one clear line, the right hint."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from helpers import no_bench
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize import search as auto
from onnx_conv2matmul.quantize import search_runs, workflow

ENCODER = Path(__file__).parent / "data" / "conformer_small.onnx"
SCHEMA = Path(__file__).resolve().parent.parent / "schema" / "report.schema.json"


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stderr


def test_a_model_run_error_on_real_inputs_names_no_refused_flag(tmp_path: Path) -> None:
    """Inputs that pass the signature check but that the model cannot run on (batch 2 audio,
    3 lengths): the hint points at the files, not at options refused together with --inputs."""
    bad = tmp_path / "batch.npz"
    np.savez(bad, audio_signal=np.zeros((2, 32, 20), np.float32), length=np.full(3, 20, np.int64))
    for extra in ([], ["--algorithm", "gptq"]):
        code, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--inputs", bad, *extra)
        assert code == 2 and "batch.npz" in stderr and "--inputs files" in stderr, stderr
        assert "--verify" not in stderr and "dim values" not in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.onnx").exists()


def test_unreachable_shows_the_worst_cosine_below_the_minimum(tmp_path: Path) -> None:
    """A worst cosine just under 1 is not printed as 1 when the minimum asked is 1."""
    assert search_runs.below(1 - 6e-8, 1.0) == "0.9999999"
    assert search_runs.below(0.5, 0.99) == "0.5"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto.Reference, "worst_cosine", lambda *_args: (1 - 6e-8, ""))
        patch.setattr(workflow, "_weighs_default", lambda plan: False)  # the search alone
        code, stderr = _invoke(
            "quantize", ENCODER, tmp_path / "q.onnx", "--auto", "--min-cosine", "1", "--verify-lengths", "64",
            "--max-evaluations", "2",
        )  # fmt: skip
    assert code == 1 and "minimum cosine similarity of 1 " in stderr and "worst cosine 0.9999999 " in stderr


def test_settings_file_quotes_a_string_where_a_number_belongs(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text('{"config_version": 1, "nodes": {"n": {"bits": "4"}}}')
    code, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--config", config)
    assert code == 2 and "got '4'" in stderr, stderr


def test_a_file_that_is_not_npz_is_named_so(tmp_path: Path) -> None:
    """numpy reads a text file as a pickle and says "pickled (object) data": say what it is."""
    text = tmp_path / "notes.npz"
    text.write_text("not a zip")
    pickled = tmp_path / "obj.npz"
    np.savez(pickled, a=np.array([{"x": 1}], dtype=object))
    code, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--inputs", text)
    assert code == 2 and "notes.npz: not an .npz file" in stderr and "pickled" not in stderr, stderr
    code, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--inputs", pickled)
    assert code == 2 and "obj.npz: array 'a' holds Python objects, which are not read" in stderr, stderr


def test_patterns_that_match_nothing_are_a_warning(tmp_path: Path) -> None:
    """A typo in --include, --exclude or --bits-for is reported, not silently ignored."""
    result = CliRunner().invoke(
        main,
        [
            "quantize", str(ENCODER), str(tmp_path / "q.onnx"), "--include", "node_MatMul_14",
            "--include", "zzz*", "--exclude", "node_MatMul_4*", "--bits-for", "*self_attn*=8",
            "--verify-lengths", "64", "--no-bench", "--report-json-stdout", "-q",
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    warnings = json.loads(result.stdout)["warnings"]
    assert warnings == ["patterns that match no quantizable MatMul: 'zzz*', '*self_attn*'"]


def test_save_config_path_errors_name_the_settings_file(tmp_path: Path) -> None:
    """A --save-config path that cannot be written is refused before any work, called what it is."""
    out = tmp_path / "q.onnx"
    for path, message in (
        (tmp_path / "no" / "c.json", "settings file directory does not exist"),
        (ENCODER, "settings file would overwrite a model file"),
    ):
        args = ["--auto", "--min-cosine", "0.9", "--save-config", path]
        code, stderr = _invoke("quantize", ENCODER, out, *args)
        assert code == 2 and message in stderr and "report" not in stderr, stderr
    assert not out.exists()


def test_int8_dynamic_refuses_matmulnbits_settings_it_would_ignore(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text('{"config_version": 1, "nodes": {"node_MatMul_14": {"bits": 8}}}')
    for args, name in (
        (["--bits-for", "node_*=8"], "--bits-for"),
        (["--algorithm", "k_quant"], "--algorithm"),
        (["--other-weights", "int8"], "--other-weights int8"),
        (["--config", config], "the settings file's nodes"),
        (["--bits", "8"], "--bits"),
        (["--block-size", "32"], "--block-size"),
        (["--symmetric"], "--symmetric/--asymmetric"),
        (["--accuracy-level", "4"], "--accuracy-level"),
    ):
        code, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--int8-dynamic", *args)
        assert code == 2 and f"{name}: a MatMulNBits setting" in stderr, stderr
    assert not (tmp_path / "q.onnx").exists()


def test_reports_of_the_other_algorithms_and_of_refusals_validate(tmp_path: Path) -> None:
    """The JSON of k_quant with per-pattern bits, of gptq on real inputs, and the envelopes of an
    unreachable search and of a refused combination, against schema/report.schema.json."""
    schema = json.loads(SCHEMA.read_text())
    feed = tmp_path / "u.npz"
    rng = np.random.default_rng(5)
    np.savez(feed, audio_signal=rng.standard_normal((1, 32, 24), np.float32), length=np.array([24], np.int64))
    out = tmp_path / "q.onnx"
    runs = (
        (["--algorithm", "k_quant", "--bits-for", "node_linear*=8", "--verify-lengths", "64"], 0),
        (["--algorithm", "gptq", "--inputs", feed], 0),
        (["--auto", "--min-cosine", "0.9", "--max-evaluations", "2", "--verify-lengths", "64"], 1),
        (["--int8-dynamic", "--bits-for", "x=8"], 2),
    )
    for args, expected in runs:
        with pytest.MonkeyPatch.context() as patch:
            if "--auto" in args:  # every candidate below the minimum, float included
                patch.setattr(auto.Reference, "worst_cosine", lambda *_args: (0.5, ""))
                patch.setattr(workflow, "_weighs_default", lambda plan: False)  # the search alone
            result = CliRunner().invoke(
                main, ["quantize", str(ENCODER), str(out), *map(str, args), "--report-json-stdout", "-q"]
            )
        assert result.exit_code == expected, result.stderr
        data = json.loads(result.stdout)
        jsonschema.validate(data, schema)
        assert data["return_code"] == expected


def test_a_model_onnxruntime_cannot_load_gets_no_hint_about_inputs(tmp_path: Path) -> None:
    """No input value, dim or length makes onnxruntime load an op it does not know: the error
    says what failed and suggests no --verify-* option."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Unknown", ["x"], ["y"], domain="nowhere")],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("nowhere", 1)]
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, stderr = _invoke("verify", path, path)
    assert code == 2 and "onnxruntime cannot load the original model" in stderr, stderr
    assert "--verify" not in stderr, stderr


def test_an_integer_output_that_decides_is_named(tmp_path: Path) -> None:
    """Ids computed from floats (``ArgMax`` of a MatMul's logits) as the only output: before, the
    default run ended as an internal error (exit 3) formatting a cosine there was none of; the
    summary now names the output and the agreement that kept every layer in float, and does not
    blame include or exclude patterns nobody gave."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["logits"]),
            helper.make_node("ArgMax", ["logits"], ["ids"], axis=-1, keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 64])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "ids.onnx")
    code, stderr = _invoke("quantize", tmp_path / "ids.onnx", tmp_path / "q.onnx", "--no-bench")
    assert code == 0, stderr
    first = next(line for line in stderr.splitlines() if line.strip())
    assert (
        first.startswith("nothing quantized: the accuracy criterion (ids at length") and "agreement" in first
    )
    assert "include and exclude patterns" not in stderr and "every layer in float" in " ".join(stderr.split())
