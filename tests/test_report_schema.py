"""Every JSON object the command line prints or writes validates against schema/report.schema.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import onnx
import pytest
from click.testing import CliRunner

from helpers import conv_model, matmul_model, no_bench
from onnx_conv2matmul import api, convert
from onnx_conv2matmul.cli import signals as _entry
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.report import SCHEMA_VERSION, Command, ErrorReport, envelope
from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.verify.check import Criterion, verify_models

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schema" / "report.schema.json"
ENVELOPE = ["schema_version", "tool", "version", "command", "input", "return_code", "error"]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    onnx.save(conv_model(), tmp_path / "m.onnx")
    onnx.save(conv_model(seed=1), tmp_path / "other.onnx")
    onnx.save(conv_model(kernel=[3]), tmp_path / "k3.onnx")
    onnx.save(matmul_model(), tmp_path / "mm.onnx")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    onnx.save(conv_model(), bundle / "a.onnx")
    onnx.save(
        matmul_model(),
        bundle / "b.onnx",
        save_as_external_data=True,
        location="b.onnx.data",
        size_threshold=0,
    )
    return {
        "model": str(tmp_path / "m.onnx"),
        "other": str(tmp_path / "other.onnx"),
        "k3": str(tmp_path / "k3.onnx"),
        "mm": str(tmp_path / "mm.onnx"),
        "missing": str(tmp_path / "missing.onnx"),
        "out": str(tmp_path / "o.onnx"),
        "bundle": str(bundle),
        "report": str(tmp_path / "r.json"),
        "tmp": str(tmp_path),
    }


def _validate(validator: jsonschema.Draft202012Validator, data: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]
    assert errors == [], errors


def _run(files: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, [*no_bench([a.format(**files) for a in args]), "--report-json-stdout"])
    data = json.loads(result.stdout)  # the whole of stdout is one object
    assert isinstance(data, dict)
    assert data["return_code"] == result.exit_code, result.stderr
    return result.exit_code, data


def _assert_envelope(data: dict[str, Any], command: str | None, code: int) -> None:
    inputs_key = "inputs" if command == "verify" else "input"
    assert list(data)[:7] == [inputs_key if k == "input" else k for k in ENVELOPE]
    assert data["schema_version"] == SCHEMA_VERSION and data["tool"] == "onnx-conv2matmul"
    assert data["command"] == command and data["return_code"] == code
    assert (data["error"] is None) == (code == 0)


# ---- convert -------------------------------------------------------------------------------------


def test_convert_with_skipped_entries(files: dict[str, str], validator: Any) -> None:
    _, data = _run(files, "{k3}", "{out}", "--report-json", "{report}", "-q")
    _validate(validator, data)
    _assert_envelope(data, "convert", 0)
    assert data["input"] == files["k3"] and data["verification"] is None
    assert data["totals"]["skipped_by_reason"] == {"kernel_not_pointwise": 1}
    assert [n["reason"] for n in data["nodes"]] == ["kernel_not_pointwise"]
    assert json.loads(Path(files["report"]).read_text()) == data


def test_convert_adds_transposes_skip(files: dict[str, str], validator: Any) -> None:
    _, data = _run(files, "{model}", "{out}", "-q")
    _validate(validator, data)
    assert [n["reason"] for n in data["nodes"]] == ["adds_transposes"]


def test_convert_with_verify(files: dict[str, str], validator: Any) -> None:
    _, data = _run(
        files, "{model}", "{out}", "--allow-added-transposes", "--verify", "--verify-lengths", "3,5", "-q"
    )
    _validate(validator, data)
    _assert_envelope(data, "convert", 0)
    verification = data["verification"]
    assert verification["passed"] is True and data["totals"]["converted"] == 1
    assert verification["criterion"] == {"kind": "scaled_difference", "max_abs": 3e-5, "mean_abs": 2e-6}
    assert verification["options"]["report_only"] is False


def test_convert_with_failed_verification(
    files: dict[str, str], validator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rewrite is compared with another model: verification fails, nothing is written."""
    monkeypatch.setattr(
        api,
        "verify_models",
        lambda original, candidate, options: verify_models(files["other"], candidate, options),
    )
    code, data = _run(
        files, "{model}", "{out}", "--allow-added-transposes", "--verify", "--verify-lengths", "3"
    )
    assert code == 1
    _validate(validator, data)
    _assert_envelope(data, "convert", 1)
    assert data["output"] is None and "verification failed" in data["error"]
    assert data["verification"]["failures"]


def test_convert_in_memory(validator: Any) -> None:
    """The library's report of a model rewritten in memory: no input or output path."""
    _, report = convert(conv_model(kernel=[3]))
    data = report.to_dict()
    _validate(validator, data)
    assert data["input"] is None and data["output"] is None and data["command"] == "convert"


# ---- verify --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("candidate", "code"), [("{model}", 0), ("{other}", 1)], ids=["pass", "fail"])
def test_verify(files: dict[str, str], validator: Any, candidate: str, code: int) -> None:
    got, data = _run(files, "verify", "{model}", candidate, "--verify-lengths", "3", "-q")
    assert got == code
    _validate(validator, data)
    _assert_envelope(data, "verify", code)
    assert data["inputs"] == [files["model"], candidate.format(**files)]
    assert data["verification"]["passed"] is (code == 0)


def test_verify_min_cosine_criterion(files: dict[str, str], validator: Any) -> None:
    _, data = _run(
        files, "verify", "{model}", "{model}", "--verify-lengths", "3", "--min-cosine", "0.5", "-q"
    )
    _validate(validator, data)
    assert data["verification"]["criterion"] == {"kind": "min_cosine", "min_cosine": 0.5, "labels": "auto"}


# ---- quantize ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "mode"), [([], "matmul_nbits"), (["--int8-dynamic"], "int8_dynamic")], ids=["nbits", "int8"]
)
def test_quantize(files: dict[str, str], validator: Any, extra: list[str], mode: str) -> None:
    code, data = _run(files, "quantize", "{mm}", "{out}", "--verify-lengths", "3", *extra, "-q")
    assert code == 0
    _validate(validator, data)
    _assert_envelope(data, "quantize", 0)
    assert data["mode"] == mode and data["quantized_nodes"] >= 1
    # Without --min-cosine the default floor is the criterion, and the JSON says so.
    assert data["verification"]["criterion"] == {
        "kind": Criterion.MIN_COSINE.value,
        "min_cosine": 0.99,
        "labels": "auto",
    }
    assert data["accuracy"]["min_cosine_source"] == "default floor"
    assert data["accuracy"]["inputs"] == "synthesised" and data["accuracy"]["caveat"]


def test_quantize_below_min_cosine(files: dict[str, str], validator: Any) -> None:
    code, data = _run(
        files, "quantize", "{mm}", "{out}", "--verify-lengths", "3", "--bits", "4", "--min-cosine", "1", "-q"
    )
    assert code == 1
    _validate(validator, data)
    assert data["output"] is None and "below --min-cosine" in data["error"]
    assert data["verification"]["criterion"] == {"kind": "min_cosine", "min_cosine": 1.0, "labels": "auto"}


@pytest.mark.parametrize(
    "extra",
    [["--auto", "--min-cosine", "0.9", "--max-evaluations", "3"], ["--other-weights", "int8"]],
    ids=["auto", "other-weights"],
)
def test_quantize_auto_and_other_weights(files: dict[str, str], validator: Any, extra: list[str]) -> None:
    code, data = _run(files, "quantize", "{mm}", "{out}", "--verify-lengths", "3", *extra, "-q")
    assert code == 0
    _validate(validator, data)
    assert (data["auto"] is not None) is ("--auto" in extra)
    assert (data["other_weights"] is not None) is ("--other-weights" in extra)


def test_quantize_with_real_inputs_and_per_node_settings(files: dict[str, str], validator: Any) -> None:
    import numpy as np

    feed = Path(files["tmp"]) / "feed.npz"
    np.savez(feed, x=np.ones((2, 64), np.float32))
    settings = Path(files["tmp"]) / "settings.json"
    settings.write_text(json.dumps({"config_version": 1, "nodes": {"mm": {"bits": 8, "symmetric": True}}}))
    code, data = _run(
        files, "quantize", "{mm}", "{out}", "--inputs", str(feed), "--config", str(settings), "-q"
    )
    assert code == 0
    _validate(validator, data)
    assert data["quantized"] == [{"node": "mm", "bits": 8, "block_size": 64, "symmetric": True}]
    assert data["verification"]["input_files"] == [{"file": str(feed), "shapes": {"x": [2, 64]}}]
    # The report's settings are a settings file, which the schema describes as well.
    config_schema = {**json.loads(SCHEMA_PATH.read_text()), "$ref": "#/$defs/quantize_config"}
    del config_schema["oneOf"]
    jsonschema.Draft202012Validator(config_schema).validate(data["options"]["quantize"])


# ---- bundle --------------------------------------------------------------------------------------


def test_bundle(files: dict[str, str], validator: Any) -> None:
    _, data = _run(files, "bundle", "--check", "{bundle}")
    _validate(validator, data)
    _assert_envelope(data, "bundle", 0)
    assert data["input"] == files["bundle"]
    assert [(m["model"], m["external_data"]) for m in data["models"]] == [
        ("a.onnx", []),
        ("b.onnx", ["b.onnx.data"]),
    ]
    assert data["total_bytes"] == sum(m["bytes"] for m in data["models"])


# ---- error objects -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "command", "inputs", "message"),
    [
        (["{missing}", "{out}"], "convert", "{missing}", "input not found"),
        (["{model}", "{out}", "--no-such-option"], "convert", None, "No such option"),
        ([], "convert", None, "Missing argument"),
        (["verify", "{model}", "{missing}"], "verify", ["{model}", "{missing}"], "input not found"),
        (["verify", "{model}"], "verify", None, "Missing argument"),
        (["quantize", "{model}", "{out}", "--block-size", "512"], "quantize", "{model}", "block size"),
        (["bundle", "--check", "{tmp}/nope"], "bundle", "{tmp}/nope", "not a directory"),
    ],
    ids=["bad-input", "usage", "no-argument", "verify-bad-input", "verify-usage", "bad-option", "bundle"],
)
def test_error_objects(
    files: dict[str, str],
    validator: Any,
    args: list[str],
    command: str,
    inputs: str | list[str] | None,
    message: str,
) -> None:
    code, data = _run(files, *args)
    assert code == 2
    _validate(validator, data)
    _assert_envelope(data, command, 2)
    assert message in data["error"]
    expected = [i.format(**files) for i in inputs] if isinstance(inputs, list) else inputs
    key = "inputs" if command == "verify" else "input"
    assert data[key] == (expected.format(**files) if isinstance(expected, str) else expected)
    assert set(data) == {*ENVELOPE[:4], key, "return_code", "error"}, "an error object is the envelope alone"


def test_internal_error_object(
    files: dict[str, str], validator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(api, "convert_file", boom)
    monkeypatch.delenv("ONNX_CONV2MATMUL_DEBUG", raising=False)
    code, data = _run(files, "{model}", "{out}")
    assert code == 3
    _validate(validator, data)


def test_interrupt_object_of_the_entry_point(validator: Any) -> None:
    """Interrupted while importing: no command known yet, the same builder."""
    data = json.loads(_entry.error_json(None, 130, "interrupted; nothing was written"))
    _validate(validator, data)
    assert data == ErrorReport(None, 130, "interrupted; nothing was written").to_dict()
    assert data["command"] is None and data["input"] is None


# ---- the schema and the builder agree, and both are strict ---------------------------------------


def test_schema_lists_what_the_code_has() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    defs = schema["$defs"]
    assert defs["envelope"]["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert set(defs["envelope"]["properties"]["command"]["enum"]) == {c.value for c in Command} | {None}
    assert defs["skip_reason"]["enum"] == [r.value for r in SkipReason]
    kinds = [option["properties"]["kind"]["const"] for option in defs["criterion"]["oneOf"]]
    assert sorted(kinds) == sorted(c.value for c in Criterion)


@pytest.mark.parametrize(
    "change",
    [
        {"error": None},  # a failure without a message
        {"extra": 1},  # a key the schema does not know
        {"return_code": 0},  # an error object without an error
        {"schema_version": 1},
    ],
)
def test_schema_rejects(validator: Any, change: dict[str, Any]) -> None:
    data = {**ErrorReport("convert", 2, "input not found: x", "x").to_dict(), **change}
    assert not validator.is_valid(data)


def test_builder_refuses_an_inconsistent_object() -> None:
    with pytest.raises(ValueError, match="null exactly when"):
        envelope("convert", inputs="x", return_code=2, error=None)
    with pytest.raises(ValueError, match="null exactly when"):
        envelope("convert", inputs="x", return_code=0, error="oops")
    with pytest.raises(ValueError, match="list of inputs"):
        envelope("verify", inputs="x", return_code=0, error=None)
    with pytest.raises(ValueError, match="repeats envelope keys"):
        envelope("bundle", inputs="d", return_code=0, error=None, body={"return_code": 0})


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{bad}", "{out}"],
        ["quantize", "{bad}", "{out}"],
        ["verify", "{bad}", "{bad}"],
        ["bench", "{bad}"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_requested_report_file_is_written_when_the_run_fails(tmp_path: Path, argv: list[str]) -> None:
    """--report-json FILE holds the error object when the run ends in an error, the case where a
    pipeline most needs it (issue 43, rule 4), as --report-json-stdout prints it."""
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    report = tmp_path / "report.json"
    words = [w.format(bad=bad, out=tmp_path / "out.onnx") for w in argv]
    result = CliRunner().invoke(main, [*words, "--report-json", str(report)])
    assert result.exit_code == 2, result.stderr
    data = json.loads(report.read_text())
    assert data["return_code"] == 2 and data["command"] == argv[0]
    assert "not a valid ONNX" in data["error"] or "cannot load" in data["error"], data["error"]
    assert data["error"] in result.stderr
