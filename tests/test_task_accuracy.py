"""Task accuracy on a trained classifier from the registry, with real held-out data (issue 41):
Magika's file-type classifier on the files of this machine. The labels a quantized model gives
must be fp32's on files no choice of the run saw; a run that cannot show it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from file_features import file_features
from model_cache import FETCHER
from onnx_conv2matmul.cli.app import main
from real_packages import MAGIKA

CALIBRATION = 100
HELD_OUT = 300


def _labels(path: Path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return np.concatenate(
        [session.run(None, {"bytes": x[i : i + 100]})[0].argmax(1) for i in range(0, len(x), 100)]
    )


def _bytes(path: Path) -> int:
    return path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data"))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    model = Path(FETCHER.fetch(MAGIKA))
    folder = tmp_path_factory.mktemp("magika")
    x = file_features(CALIBRATION + HELD_OUT)
    if len(x) < CALIBRATION + HELD_OUT:
        pytest.skip(f"this machine has {len(x)} readable files, {CALIBRATION + HELD_OUT} needed")
    np.savez(folder / "calibration.npz", bytes=x[:CALIBRATION])
    held = x[CALIBRATION:]
    return model, folder, held, _labels(model, held)


def _quantize(model: Path, out: Path, *args: str) -> tuple[int, str, dict]:
    report = out.with_suffix(".json")
    result = CliRunner().invoke(
        main, ["quantize", str(model), str(out), "--no-bench", *args, "--report-json", str(report)]
    )
    return result.exit_code, " ".join(result.output.split()), json.loads(report.read_text())


@pytest.mark.network
def test_defaults_refuse_to_judge_a_classifier_on_synthesised_inputs(data: tuple) -> None:
    model, folder, _, _ = data
    code, text, report = _quantize(model, folder / "defaults.onnx")
    assert code == 2 and not (folder / "defaults.onnx").exists()
    assert "output 'target_label' holds a classifier's scores" in text and "--inputs" in text
    assert "target_label" in json.dumps(report["error"])


@pytest.mark.network
def test_the_labels_hold_on_files_the_run_never_saw(data: tuple) -> None:
    """--inputs, then --auto --inputs: fp32's labels kept on 300 other files, and --auto no
    bigger than the default run on the same inputs."""
    model, folder, held, fp32 = data
    calibration = str(folder / "calibration.npz")
    sizes = {}
    for name, more in (("inputs", []), ("auto", ["--auto"])):
        out = folder / f"{name}.onnx"
        code, text, report = _quantize(model, out, "--inputs", calibration, *more)
        assert code == 0, text
        assert report["accuracy"]["held_out"]["passed"] is True
        assert report["accuracy"]["held_out"]["held_out_samples"] == 30
        agreement = float(np.mean(_labels(out, held) == fp32))
        assert agreement >= 0.99, (name, agreement)
        sizes[name] = _bytes(out)
        assert sizes[name] < 0.9 * _bytes(model)
    assert sizes["auto"] <= sizes["inputs"]
