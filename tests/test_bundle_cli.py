"""The bundle command: building from a release folder, the listing under --check, usage errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from click.testing import CliRunner

from onnx_conv2matmul.cli.app import main

SOURCE = Path(__file__).parent / "data" / "parakeet_small"
SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "schema" / "report.schema.json").read_text())


def _invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _validate(data: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(data)


def test_build_prints_one_table_and_a_report_the_schema_takes(tmp_path: Path) -> None:
    out = tmp_path / "int4"
    code, stdout, stderr = _invoke("bundle", SOURCE, out, "--layout", "sherpa-onnx", "--report-json-stdout")
    assert code == 0, stderr
    data = json.loads(stdout)
    _validate(data)
    assert data["command"] == "bundle" and data["input"] == str(SOURCE) and data["output_dir"] == str(out)
    assert [m["role"] for m in data["models"]] == ["encoder", "decoder", "joiner"]
    assert data["split"]["passed"] and data["metadata"]["vocab_size"] == "32"
    for name in ("encoder.int4.onnx", "joiner.int8.onnx", "tokens.txt", "total", "x the source"):
        assert name in stderr
    assert "min cosine" in stderr and "nemo_transducer" in stderr


def test_build_for_onnx_asr_names_the_quantization(tmp_path: Path) -> None:
    out = tmp_path / "q"
    code, stdout, stderr = _invoke("bundle", SOURCE, out, "--quantization", "hybrid", "--report-json-stdout")
    assert code == 0, stderr
    data = json.loads(stdout)
    _validate(data)
    assert data["onnx_asr_quantization"] == "hybrid"
    assert (out / "encoder-model.hybrid.onnx").is_file()
    assert (out / "decoder_joint-model.hybrid.onnx").is_file()
    assert 'quantization="hybrid"' in stderr
    code, stdout, _ = _invoke("bundle", "--check", out, "--report-json-stdout")
    assert code == 0
    assert {m["model"] for m in json.loads(stdout)["models"]} == {
        "encoder-model.hybrid.onnx",
        "decoder_joint-model.hybrid.onnx",
    }


def test_accuracy_below_the_minimum_exits_1_and_writes_nothing(tmp_path: Path) -> None:
    """With settings given, as quantize: a result below the minimum is refused (no search)."""
    out = tmp_path / "b"
    code, stdout, _ = _invoke(
        "bundle",
        SOURCE,
        out,
        "--block-size",
        "64",
        "--min-cosine",
        "0.99999",
        "--no-bench",
        "--report-json-stdout",
    )
    assert code == 1
    data = json.loads(stdout)
    _validate(data)
    assert data["output_dir"] is None and "--min-cosine 0.99999" in data["error"]
    assert not out.exists()


def test_usage_errors(tmp_path: Path) -> None:
    code, _, stderr = _invoke("bundle", SOURCE)
    assert code == 2 and "bundle --check DIR" in stderr
    code, _, stderr = _invoke("bundle", SOURCE, tmp_path / "o", "--manifest", tmp_path / "m.json")
    assert code == 2 and "--manifest goes with --check" in stderr
    code, _, stderr = _invoke("bundle", "--check", SOURCE, SOURCE, tmp_path / "o")
    assert code == 2 and "give no SRC_DIR OUT_DIR" in stderr
    code, _, stderr = _invoke("bundle", tmp_path, tmp_path / "o")
    assert code == 2 and "encoder-model.onnx not found" in stderr
    code, _, stderr = _invoke("bundle", SOURCE, tmp_path / "o", "--quantization", "int*")
    assert code == 2 and "bundle quantization name" in stderr
    assert not (tmp_path / "o").exists()


def test_the_encoder_kernel_is_chosen_by_timing_unless_no_bench(tmp_path: Path) -> None:
    """As quantize does: the encoder's report beside it records the kernel choice and latency."""
    code, _, stderr = _invoke("bundle", SOURCE, tmp_path / "timed", "--bench-rounds", "3", "-q")
    assert code == 0, stderr
    timed = json.loads((tmp_path / "timed" / "encoder-model.int4.report.json").read_text())
    # chosen from per-shape kernel costs (the default --bench shapes), the result timed
    assert timed["kernel_costs"] is not None and timed["latency"] is not None
    code, _, stderr = _invoke("bundle", SOURCE, tmp_path / "plain", "--no-bench", "-q")
    assert code == 0, stderr
    plain = json.loads((tmp_path / "plain" / "encoder-model.int4.report.json").read_text())
    assert plain.get("kernel_choice") is None and plain.get("kernel_costs") is None
    assert plain.get("latency") is None


def test_with_default_settings_the_encoder_below_the_minimum_is_searched_for(tmp_path: Path) -> None:
    """As quantize: below the criterion, the one pass decides a mix that meets it."""
    out = tmp_path / "b"
    code, _, stderr = _invoke("bundle", SOURCE, out, "--min-cosine", "0.99999", "--no-bench")
    assert code == 0, stderr
    encoder = json.loads((out / "encoder-model.int4.report.json").read_text())
    assert encoder["accuracy"]["fallback"] is not None and encoder["one_pass"]["candidates"][-1]["passed"]
    assert min(r["cosine"] for r in encoder["verification"]["results"] if r["cosine"] is not None) >= 0.99999
