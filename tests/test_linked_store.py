"""A model in a store of content-addressed files, as a Hugging Face cache keeps it (issue 43,
rule 3): ``snapshots/REV/model.onnx`` and its ``model.onnx.data`` are links into ``../../blobs``.
A link is followed once and judged by where it lands: beside the file the model's own link lands
on, it is the model's data; anywhere else it is refused as before."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from onnx_conv2matmul.cli.app import main

ENCODER = Path(__file__).parent / "data" / "conformer_small.onnx"


def _store(root: Path, data_target: Path | None = None) -> Path:
    """The encoder as a cache snapshot: both files links into blobs/ (or the data link to
    ``data_target``)."""
    staging = root / "staging"
    staging.mkdir()
    model = onnx.load(ENCODER)
    onnx.save(
        model,
        staging / "model.onnx",
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    blobs, snapshot = root / "models--x" / "blobs", root / "models--x" / "snapshots" / "rev1"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("model.onnx", "model.onnx.data"):
        data = (staging / name).read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        target = data_target if name.endswith(".data") and data_target is not None else blob
        if target != blob:
            target.write_bytes(data)
        (snapshot / name).symlink_to(target if target != blob else Path("../../blobs") / blob.name)
    return snapshot / "model.onnx"


def _outputs(path: Path) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 32, 64)).astype(np.float32)
    return session.run(None, {"audio_signal": x, "length": np.array([64], np.int64)})


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_a_cache_snapshot_is_read_where_its_links_land(tmp_path: Path, command: str) -> None:
    src = _store(tmp_path)
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    args = [src, out, "--verify"] if command == "convert" else ["quantize", src, out, "--no-bench"]
    result = CliRunner().invoke(main, [*map(str, args), "--report-json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["verification"]["passed"]
    if command == "quantize":
        assert any("links into the store" in w for w in data["warnings"])
    else:  # the rewrite is exact
        for a, b in zip(_outputs(src), _outputs(out), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert not any(p.is_symlink() for p in tmp_path.iterdir())  # the output is plain files


def test_a_data_link_that_lands_outside_the_store_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    src = _store(tmp_path, data_target=elsewhere / "secret.bin")
    result = CliRunner().invoke(main, [str(src), str(tmp_path / "out.onnx")])
    assert result.exit_code == 2 and "outside the model's directory" in result.output
    assert not (tmp_path / "out.onnx").exists()


def test_inspect_reads_a_cache_snapshot(tmp_path: Path) -> None:
    src = _store(tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(src), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert data["checker"] == "skipped" and data["files"]["external_data"] is True


def test_bundle_reads_a_release_folder_kept_as_links(tmp_path: Path) -> None:
    """The speech release folder as a cache snapshot: every file a link into blobs/."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for source in sorted((Path(__file__).parent / "data" / "parakeet_small").iterdir()):
        data = source.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / source.name).symlink_to(Path("../blobs") / blob.name)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bundle", str(snapshot), str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert (out / "encoder-model.int4.onnx").is_file() and (out / "vocab.txt").is_file()
    assert not any(p.is_symlink() for p in out.iterdir())
    # Reports name what the user named (issue 43, rule 4): the folder published, not the hidden
    # staging folder the bundle was written in.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input"] == str(out)
    for report in out.glob("*.report.json"):
        data = json.loads(report.read_text())
        assert data["output"] == str(out / report.name.replace(".report.json", ".onnx"))
        assert ".tmp" not in json.dumps(data), report.name


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_verify_and_bench_read_a_cache_snapshot(tmp_path: Path, command: str) -> None:
    src = str(_store(tmp_path))
    args = (
        ["verify", src, src]
        if command == "verify"
        else ["bench", src, "--bench-rounds", "3", "--bench-lengths", "16"]
    )
    result = CliRunner().invoke(main, [*args, "-q"])
    assert result.exit_code == 0, result.output
