"""Mobile CNNs and a VAD, quantized as a user runs ``quantize`` with each ``--prefer`` choice.

Models (from registry wheels, cached as the tests cache them): the PP-OCRv4 text detector
(rapidocr-onnxruntime 1.4.4; its pointwise convs hold 86% of the weights, each beside a depthwise
conv, so rewriting them adds Transposes) and silero VAD 6.2.3 (its ``sr`` scalar picks the branch
of an ``If``). For each model, each choice (the default, ``--prefer size``, ``--prefer speed``) is
one process running the command a user types, with ``--inputs``:

* detector: two synthetic text pages (dark strokes on a light, noisy background, normalised as
  PP-OCR normalises images), 320 x 320 and 480 x 640;
* silero: one chunk of 512 samples at 16 kHz with the zero state.

Then, in this process:

* size of each output against fp32;
* latency against fp32 at two input sizes, all models interleaved in one measurement (batch 1,
  sessions that do not spin, 10 rounds; detector: pages of 320 x 320 and 640 x 640; silero:
  512 samples at 16 kHz and 256 at 8 kHz), with the 95% interval;
* task-level agreement with fp32 on inputs that neither ``quantize`` nor the timing used:
  detector, the IoU of the text masks (probability > 0.3, DB's threshold) on 6 other pages;
  silero, the share of chunks of a 20 s stream (speech-like bursts in noise, state carried from
  chunk to chunk) whose speech decision (probability > 0.5) matches fp32's, and the largest
  difference of the probabilities.

Usage::

    python benchmarks/bench_cnn.py [--work DIR] [--rounds 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _process import run_measured
from model_cache import FETCHER, Packaged

DETECTOR = Packaged(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
    "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
)
SILERO = Packaged(
    "silero-vad==6.2.3",
    "silero_vad/data/silero_vad.onnx",
    "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
)
CHOICES = {"default": [], "size": ["--prefer", "size"], "speed": ["--prefer", "speed"]}
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def page(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A synthetic text page: lines of dark strokes on a light, noisy background, normalised."""
    image = np.full((height, width, 3), 235, np.float32) + rng.normal(0, 6, (height, width, 3))
    for _ in range(int(rng.integers(6, 14))):
        y, x = int(rng.integers(0, height - 20)), int(rng.integers(0, width - 60))
        tall, wide = int(rng.integers(8, 18)), int(rng.integers(30, min(200, width - x)))
        for k in range(0, wide, int(rng.integers(5, 9))):
            image[y : y + tall, x + k : x + k + int(rng.integers(1, 4))] = rng.integers(10, 80)
    image = np.clip(image, 0, 255) / 255.0
    return ((image - MEAN) / STD).transpose(2, 0, 1)[None].astype(np.float32)


def silero_feed(samples: np.ndarray, sr: int, state: np.ndarray | None = None) -> dict[str, np.ndarray]:
    return {
        "input": samples[None].astype(np.float32),
        "state": np.zeros((2, 1, 128), np.float32) if state is None else state,
        "sr": np.array(sr, np.int64),
    }


def speech_like(rng: np.random.Generator, seconds: float, sr: int = 16000) -> np.ndarray:
    """Noise with bursts of a harmonic, amplitude-modulated tone (voiced-speech-like) in between."""
    t = np.arange(int(seconds * sr)) / sr
    signal = 0.01 * rng.standard_normal(t.size)
    start = 0.5
    while start < seconds - 1:
        length = float(rng.uniform(0.4, 1.5))
        pitch = float(rng.uniform(90, 220))
        part = (t >= start) & (t < start + length)
        tone = sum(np.sin(2 * np.pi * pitch * h * t[part]) / h for h in range(1, 8))
        envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t[part]))
        signal[part] += 0.3 * tone * envelope
        start += length + float(rng.uniform(0.3, 1.2))
    return signal.astype(np.float32)


def run(name: str, argv: list[str]) -> dict[str, Any]:
    """One process: its wall time and peak RSS."""
    print(f"[{name}] {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as log:
        usage = run_measured(argv, stdout=subprocess.DEVNULL, stderr=log)
        seconds = usage.seconds
        code = usage.returncode
        if code != 0:
            log.seek(0)
            raise SystemExit(f"[{name}] failed ({code}): {log.read().decode()[-3000:]}")
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024)}


def session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def detector_agreement(fp32: Path, candidate: Path) -> float:
    """Mean IoU of the text masks (probability > 0.3) against fp32's on 6 pages."""
    rng = np.random.default_rng(7)
    a, b = session(fp32), session(candidate)
    scores = []
    for height, width in ((320, 320), (480, 640), (640, 480)) * 2:
        x = page(rng, height, width)
        mask_a = a.run(None, {"x": x})[0] > 0.3
        mask_b = b.run(None, {"x": x})[0] > 0.3
        union = np.logical_or(mask_a, mask_b).sum()
        scores.append(1.0 if union == 0 else np.logical_and(mask_a, mask_b).sum() / union)
    return float(np.mean(scores))


def silero_agreement(fp32: Path, candidate: Path) -> float:
    """The share of 512-sample chunks of a 20 s stream whose speech decision matches fp32's."""
    audio = speech_like(np.random.default_rng(11), 20.0)
    a, b = session(fp32), session(candidate)
    state_a = state_b = None
    same = []
    for start in range(0, audio.size - 512, 512):
        chunk = audio[start : start + 512]
        prob_a, state_a = a.run(None, silero_feed(chunk, 16000, state_a))
        prob_b, state_b = b.run(None, silero_feed(chunk, 16000, state_b))
        same.append(bool(prob_a.item() > 0.5) == bool(prob_b.item() > 0.5))
    return float(np.mean(same))


def latencies(paths: list[Path], feeds: list[Mapping[str, np.ndarray]], rounds: int) -> list[list[Any]]:
    """Each model's latency against the first at each feed (one interleaved measurement)."""
    from onnx_conv2matmul.speed.timing import TimingOptions, time_models

    options = TimingOptions(rounds=rounds, feeds=tuple((i + 1, f) for i, f in enumerate(feeds)))
    report = time_models([str(p) for p in paths], options)
    return [list(model.latencies) for model in report.models]


def bench_model(
    name: str,
    source: Path,
    work: Path,
    inputs: list[Path],
    timed: list[Mapping[str, np.ndarray]],
    sizes: list[str],
    agreement: Callable[[Path, Path], float],
    rounds: int,
) -> list[dict[str, Any]]:
    outputs, rows = [], []
    for choice, flags in CHOICES.items():
        out = work / f"{name}.{choice}.onnx"
        report = work / f"{name}.{choice}.json"
        argv = [sys.executable, "-m", "onnx_conv2matmul", "quantize", str(source), str(out)]
        argv += [*flags, "--report-json", str(report)]
        for path in inputs:
            argv += ["--inputs", str(path)]
        process = run(f"{name} {choice}", argv)
        data = json.loads(report.read_text())
        trade = data.get("transposes") or {}
        rows.append(
            {
                "model": name,
                "prefer": choice,
                "size_ratio": data["files"]["ratio"],
                "quantized": f"{data['quantized_nodes']} of {data['matmuls']}",
                "with_transposes": trade.get("with_transposes"),
                "worst_cosine": min(
                    r["cosine"] for r in data["verification"]["results"] if r["cosine"] is not None
                ),
                **process,
            }
        )
        outputs.append(out)
    timing = latencies([source, *outputs], timed, rounds)
    for row, lats, out in zip(rows, timing[1:], outputs, strict=True):
        row["latency"] = {
            size: [round(lat.ratio, 3), round(lat.ratio_low, 3), round(lat.ratio_high, 3)]
            for size, lat in zip(sizes, lats, strict=True)
        }
        row["agreement"] = round(agreement(source, out), 4)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="where the outputs go (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from onnx_conv2matmul.speed.timing import cpu_name

    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(3)
        pages = []
        for i, (height, width) in enumerate(((320, 320), (480, 640))):
            path = work / f"page{i}.npz"
            np.savez(path, x=page(rng, height, width))
            pages.append(path)
        sil = work / "silero.npz"
        np.savez(sil, **silero_feed(speech_like(rng, 1.0)[:512], 16000))
        detector, silero = FETCHER.fetch(DETECTOR), FETCHER.fetch(SILERO)
        timed_pages = [{"x": page(rng, n, n)} for n in (320, 640)]
        audio = speech_like(rng, 1.0)
        timed_audio = [silero_feed(audio[:512], 16000), silero_feed(audio[:256], 8000)]
        sizes = ["320", "640"]
        rows = bench_model(
            "PP-OCRv4 det", detector, work, pages, timed_pages, sizes, detector_agreement, args.rounds
        )
        rows += bench_model(
            "silero VAD",
            silero,
            work,
            [sil],
            timed_audio,
            ["512@16k", "256@8k"],
            silero_agreement,
            args.rounds,
        )
    print(f"CPU: {cpu_name()}")
    print(
        "| model | --prefer | size x fp32 | MatMulNBits | Transposes kept | worst cosine (check) |"
        " latency x fp32, small [95%] | latency x fp32, large [95%] | agreement with fp32 | quantize s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = []
        for ratio, low, high in row["latency"].values():
            cells.append(f"{ratio:.2f} [{low:.2f}-{high:.2f}]")
        print(
            f"| {row['model']} | {row['prefer']} | {row['size_ratio']:.3f} | {row['quantized']} |"
            f" {row['with_transposes']} | {row['worst_cosine']:.4f} | {cells[0]} | {cells[1]} |"
            f" {row['agreement']:.4f} | {row['seconds']} |"
        )
    print("latency sizes: detector 320x320 / 640x640 pages; silero 512 samples at 16 kHz / 256 at 8 kHz")
    print("agreement: detector mean IoU of text masks (p > 0.3); silero share of matching speech decisions")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
