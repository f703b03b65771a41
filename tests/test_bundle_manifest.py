"""bundle --manifest: every file of every model with its size and sha256, and each model's
quantization settings and accuracy from the quantize report beside it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jsonschema
import onnx
import pytest
from click.testing import CliRunner

from helpers import matmul_model, no_bench
from onnx_conv2matmul.bundle import listing
from onnx_conv2matmul.cli.app import main

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "schema" / "report.schema.json").read_text())


def _invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest(tmp_path: Path) -> None:
    src = tmp_path / "mm.onnx"
    onnx.save(matmul_model(), src)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    # The naming convention: the report of MODEL.onnx is MODEL.report.json beside it.
    code, _, stderr = _invoke(
        "quantize", src, bundle / "mm.int4.onnx", "--verify-lengths", "3", "--report-json",
        bundle / "mm.int4.report.json", "-q",
    )  # fmt: skip
    assert code == 0, stderr
    onnx.save(matmul_model(), bundle / "ext.onnx", save_as_external_data=True, location="ext.onnx.data",
              size_threshold=0)  # fmt: skip
    manifest = tmp_path / "manifest.json"
    code, _, stderr = _invoke("bundle", "--check", bundle, "--manifest", manifest)
    assert code == 0, stderr
    data = json.loads(manifest.read_text())
    jsonschema.validate(data, SCHEMA)
    models = {m["model"]: m for m in data["models"]}
    assert models["ext.onnx"]["files"] == [
        {"path": name, "bytes": (bundle / name).stat().st_size, "sha256": _sha256(bundle / name)}
        for name in ("ext.onnx", "ext.onnx.data")
    ]
    assert models["ext.onnx"]["quantization"] is None
    quantized = models["mm.int4.onnx"]
    assert quantized["files"][0]["sha256"] == _sha256(bundle / "mm.int4.onnx")
    q = quantized["quantization"]
    assert q["report"] == "mm.int4.report.json" and q["mode"] == "matmul_nbits"
    assert q["settings"]["bits"] == 4 and q["settings"]["config_version"] == 1
    assert set(q["accuracy"]["min_cosine_per_output"]) == {"y"}
    assert 0.9 < q["accuracy"]["min_cosine"] <= 1 and q["accuracy"]["inputs"] == "synthesised"
    assert data["total_bytes"] == sum(f["bytes"] for m in data["models"] for f in m["files"])
    # Without --manifest the report stays as it was: no hashes.
    code, stdout, _ = _invoke("bundle", "--check", bundle, "--report-json-stdout")
    assert code == 0 and "files" not in json.loads(stdout)["models"][0]


def test_manifest_refuses_a_bad_report_and_a_model_path(tmp_path: Path) -> None:
    onnx.save(matmul_model(), tmp_path / "m.onnx")
    (tmp_path / "m.report.json").write_text('{"command": "convert"}')
    code, _, stderr = _invoke("bundle", "--check", tmp_path, "--manifest", tmp_path / "out.json")
    assert code == 2 and "not a quantize report" in stderr
    (tmp_path / "m.report.json").write_text("{")
    code, _, stderr = _invoke("bundle", "--check", tmp_path, "--manifest", tmp_path / "out.json")
    assert code == 2 and "cannot read the quantize report" in stderr
    code, _, stderr = _invoke("bundle", "--check", tmp_path, "--manifest", tmp_path / "m.onnx")
    assert code == 2 and "would overwrite a model file" in stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("size", [0, 1, (1 << 20) + 7])
def test_streamed_sha256(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    entry = listing._file_entry(str(tmp_path), "f.bin")
    assert entry == {"path": "f.bin", "bytes": size, "sha256": _sha256(path)}


@pytest.mark.parametrize(
    ("names", "warning"),
    [
        (["encoder-model.int4.onnx"], "only an encoder (encoder-model.int4.onnx)"),
        (["decoder_joint-model.int8.onnx"], "no encoder model beside decoder_joint-model.int8.onnx"),
        (["encoder-model.int4.onnx", "decoder_joint-model.int8.onnx"], None),
        (["encoder.onnx", "decoder.onnx", "joiner.onnx"], None),
        (["classifier.onnx"], None),
    ],
    ids=["encoder-only", "decoder-only", "onnx-asr", "sherpa-onnx", "not-speech"],
)
def test_bundle_warns_when_a_speech_model_lacks_its_other_half(
    tmp_path: Path, names: list[str], warning: str | None
) -> None:
    """An encoder without its decoder and joint (or the other way round) is no bundle a
    speech runtime loads: a warning in the table and the report, exit 0 still."""
    for name in names:
        onnx.save(matmul_model(), tmp_path / name)
    code, stdout, stderr = _invoke("bundle", "--check", tmp_path, "--report-json-stdout")
    assert code == 0, stderr
    data = json.loads(stdout)
    jsonschema.validate(data, SCHEMA)
    if warning is None:
        assert data["warnings"] == [] and "warning" not in stderr
    else:
        assert len(data["warnings"]) == 1 and data["warnings"][0].startswith(warning)
        assert f"warning: {warning}" in " ".join(stderr.split())
