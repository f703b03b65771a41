"""Bundles in the runtimes people run them with: onnx-asr and sherpa-onnx.

The small release-shaped fixture (``tests/data/parakeet_small``, made by
``benchmarks/fastconformer.py release --size small --decisive-joint``) has a joint that emits
a fixed token chain by wide margins, so its text is the same whatever the quantization
noise; a bundle that a runtime loads wrongly (files, metadata, vocabulary, the split decoder
and joiner) gives another text or no text. Each runtime transcribes the same synthetic
waveform with the float release and with the bundle; the texts must be equal.

sherpa-onnx ends the process on a model it cannot use, so it runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnx_conv2matmul.bundle import layouts
from onnx_conv2matmul.bundle.build import BundleOptions, build_bundle, model_facts, read_source
from onnx_conv2matmul.bundle.split import split_decoder_joint
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files.publish import set_metadata

SOURCE = Path(__file__).parent / "data" / "parakeet_small"
SAMPLE_RATE = 16000
# The fixture's token chain, as both runtimes print it (ids 1, 2, 3, ... with a word start
# on every odd id).
CHAIN_TEXT = "ab cd ef gh"


def waveform() -> np.ndarray:
    """Two seconds: two tones and a little noise."""
    t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
    noise = 0.02 * np.random.default_rng(0).standard_normal(t.size)
    tones = 0.3 * np.sin(2 * np.pi * 440 * t) * (t < 0.7) + 0.2 * np.sin(2 * np.pi * 1200 * t) * (t > 1.1)
    return (tones + noise).astype(np.float32)


@pytest.fixture(scope="module")
def onnx_asr() -> object:
    return pytest.importorskip("onnx_asr", reason="onnx-asr is not installed (pip install onnx-asr)")


@pytest.fixture(scope="module")
def sherpa() -> object:
    return pytest.importorskip("sherpa_onnx", reason="sherpa-onnx is not installed (pip install sherpa-onnx)")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    out = {}
    for layout in layouts.LAYOUTS:
        report = build_bundle(SOURCE, root / layout, BundleOptions(layout=layout))
        assert report.passed, report.to_dict()
        out[layout] = root / layout
    return out


def test_onnx_asr_bundle_transcribes_as_the_float_release(onnx_asr: Any, bundles: dict[str, Path]) -> None:
    wave = waveform()
    texts = []
    for path, quantization in ((SOURCE, None), (bundles[layouts.ONNX_ASR], layouts.DEFAULT_TAG)):
        model = onnx_asr.load_model("nemo-parakeet-tdt-0.6b-v3", path=path, quantization=quantization)
        texts.append(model.recognize(wave, sample_rate=SAMPLE_RATE))
    assert texts[0].startswith(CHAIN_TEXT)
    assert texts[1] == texts[0]


def test_onnx_asr_needs_the_bundles_quantization(onnx_asr: Any, bundles: dict[str, Path]) -> None:
    """The bundle is loaded with the quantization docs/bundles.md gives, not by default."""
    with pytest.raises(FileNotFoundError, match="encoder-model"):
        onnx_asr.load_model("nemo-parakeet-tdt-0.6b-v3", path=bundles[layouts.ONNX_ASR])


SHERPA_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import sherpa_onnx
    folder, encoder, decoder, joiner, wave = sys.argv[1:6]
    recognizer = sherpa_onnx.OfflineRecognizer.from_transducer(
        encoder=f"{folder}/{encoder}", decoder=f"{folder}/{decoder}", joiner=f"{folder}/{joiner}",
        tokens=f"{folder}/tokens.txt", model_type="nemo_transducer", num_threads=1,
    )
    stream = recognizer.create_stream()
    stream.accept_waveform(16000, np.load(wave))
    recognizer.decode_stream(stream)
    print(json.dumps(stream.result.text))
    """
)


def _sherpa_text(folder: Path, files: tuple[str, str, str], wave: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", SHERPA_SCRIPT, str(folder), *files, str(wave)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, f"sherpa-onnx exited {result.returncode}: {result.stderr[-2000:]}"
    text: str = json.loads(result.stdout.strip().splitlines()[-1])
    return text


def _float_sherpa_folder(folder: Path) -> tuple[str, str, str]:
    """The float release laid out for sherpa-onnx: encoder with metadata, split models, tokens."""
    folder.mkdir()
    source = read_source(str(SOURCE))
    for name in (layouts.SOURCE_ENCODER, layouts.SOURCE_ENCODER + ".data"):
        shutil.copyfile(SOURCE / name, folder / name)
    set_metadata(str(folder / layouts.SOURCE_ENCODER), layouts.sherpa_metadata(model_facts(source)))
    parts = split_decoder_joint(_io.load_model(str(SOURCE / layouts.SOURCE_DECODER_JOINT)).model)
    _output.save(parts.decoder, str(folder / "decoder.onnx"), None)
    _output.save(parts.joiner, str(folder / "joiner.onnx"), None)
    (folder / "tokens.txt").write_text(source.vocab.text(), encoding="utf-8")
    return layouts.SOURCE_ENCODER, "decoder.onnx", "joiner.onnx"


def test_sherpa_onnx_bundle_transcribes_as_the_float_models(
    sherpa: Any, bundles: dict[str, Path], tmp_path: Path
) -> None:
    wave = tmp_path / "wave.npy"
    np.save(wave, waveform())
    float_files = _float_sherpa_folder(tmp_path / "float")
    expected = _sherpa_text(tmp_path / "float", float_files, wave)
    bundle = bundles[layouts.SHERPA_ONNX]
    names = sorted(os.listdir(bundle))
    files = tuple(next(n for n in names if n.startswith(f"{role}.") and n.endswith(".onnx")) for role in
                  ("encoder", "decoder", "joiner"))  # fmt: skip
    assert files == ("encoder.int4.onnx", "decoder.int8.onnx", "joiner.int8.onnx")
    assert expected.startswith(CHAIN_TEXT)
    assert _sherpa_text(bundle, files, wave) == expected


def test_sherpa_onnx_ends_the_process_without_the_metadata(
    sherpa: Any, bundles: dict[str, Path], tmp_path: Path
) -> None:
    """Why the build writes the metadata: without it sherpa-onnx exits (the test would see it)."""
    folder = tmp_path / "bare"
    shutil.copytree(bundles[layouts.SHERPA_ONNX], folder)
    import onnx

    proto = onnx.load(str(folder / "encoder.int4.onnx"), load_external_data=False)
    del proto.metadata_props[:]
    onnx.save_model(proto, str(folder / "encoder.int4.onnx"))
    wave = tmp_path / "wave.npy"
    np.save(wave, waveform())
    result = subprocess.run(
        [sys.executable, "-c", SHERPA_SCRIPT, str(folder), "encoder.int4.onnx", "decoder.int8.onnx",
         "joiner.int8.onnx", str(wave)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "vocab_size" in result.stderr
