"""The int4 bundle of a Parakeet-shaped model: our quantize pipeline against the recipe without it.

Builds nothing itself: it reads the parakeet-size exports made by ``fastconformer.py cache``
(encoder with one ``.data`` file, TDT decoder + joint). Side by side, in one run:

* ours: ``onnx-conv2matmul quantize`` on the encoder (rewrite + MatMulNBits 4 bits, block 64,
  asymmetric, accuracy level 0) and ``quantize --int8-dynamic`` on the decoder/joint;
* baseline: the same recipe without the rewrite, i.e. onnxruntime's ``MatMulNBitsQuantizer`` on the
  fp32 encoder as its API is documented (whole model), and the same int8 decoder.

Every step runs as its own process; wall time and peak RSS are per process (``wait4``). Then, in
this process: cosine of the encoder outputs against fp32 and onnxruntime CPU latency of each int4
encoder relative to fp32 (B=1, 1000 frames, default optimizations, 2 threads).

Usage::

    python benchmarks/bench_bundle.py [--cache DIR] [--work DIR] [--latency-runs N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnx_conv2matmul._graphs import count_op
from onnx_conv2matmul.pipeline import bundle_sizes

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
ENCODER = Path("encoder-dynamo") / "encoder-model.onnx"
DECODER = Path("decoder") / "decoder_joint-model.onnx"
FRAMES = 1000

BASELINE_SCRIPT = """
import sys
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
quantizer = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=64, is_symmetric=False,
                                 accuracy_level=0)
quantizer.process()
quantizer.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""


@dataclass
class Step:
    name: str
    seconds: float
    peak_rss_mb: float
    returncode: int


def run(name: str, argv: list[str]) -> Step:
    """Run one process; its wall time and peak RSS (ru_maxrss of that child only)."""
    with tempfile.TemporaryFile() as log:  # a pipe would fill up and block the child
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            log.seek(0)
            print(f"[{name}] failed: {log.read().decode()[-2000:]}", file=sys.stderr)
    return Step(name, seconds, usage.ru_maxrss / 1024, code)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnx_conv2matmul", *args]


def count_ops(path: Path, op_type: str) -> int:
    return count_op(ir.load(str(path)), op_type)  # weights stay memory-mapped, unread


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def encoder_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "audio_signal": rng.standard_normal((1, 128, FRAMES)).astype(np.float32),
        "length": np.array([FRAMES], dtype=np.int64),
    }


def outputs_and_latency(paths: list[Path], runs: int) -> tuple[list[np.ndarray], list[float]]:
    """Each model's encoder output and median latency, runs interleaved so load hits all alike."""
    sessions = [session(path) for path in paths]
    feeds = encoder_feeds()
    outputs = [sess.run(None, feeds)[0] for sess in sessions]  # also the warm-up
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for sess, record in zip(sessions, times, strict=True):
            start = time.perf_counter()
            sess.run(None, feeds)
            record.append(time.perf_counter() - start)
    return outputs, [statistics.median(t) for t in times]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--work", type=Path, default=None, help="where outputs go (default: in --cache)")
    parser.add_argument("--latency-runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    encoder, decoder = args.cache / ENCODER, args.cache / DECODER
    for path in (encoder, decoder):
        if not path.exists():
            raise SystemExit(f"missing {path}: run `python benchmarks/fastconformer.py cache` first")
    work = Path(tempfile.mkdtemp(prefix="bundle-", dir=args.work or args.cache))
    ours, base = work / "ours", work / "baseline"
    ours.mkdir()
    base.mkdir()
    try:
        steps = [
            run(
                "ours: encoder int4",
                cli(
                    "quantize",
                    str(encoder),
                    str(ours / "encoder-model.int4.onnx"),
                    "--verify-lengths",
                    "200",
                    "-q",
                    "--report-json",
                    str(work / "ours-encoder.json"),
                ),
            ),
            run(
                "ours: decoder int8",
                cli(
                    "quantize",
                    str(decoder),
                    str(ours / "decoder_joint-model.int8.onnx"),
                    "--int8-dynamic",
                    "--verify-lengths",
                    "20",
                    "-q",
                ),
            ),
            run(
                "baseline: encoder int4",
                [sys.executable, "-c", BASELINE_SCRIPT, str(encoder), str(base / "encoder-model.int4.onnx")],
            ),
        ]
        shutil.copy(ours / "decoder_joint-model.int8.onnx", base / "decoder_joint-model.int8.onnx")
        report = json.loads((work / "ours-encoder.json").read_text())
        folders = {"with the rewrite (ours)": ours, "without the rewrite": base}
        outputs, latencies = outputs_and_latency(
            [encoder, *(folder / "encoder-model.int4.onnx" for folder in folders.values())], args.latency_runs
        )
        rows: dict[str, dict[str, Any]] = {}
        for i, (label, folder) in enumerate(folders.items(), start=1):
            int4 = folder / "encoder-model.int4.onnx"
            sizes = bundle_sizes(str(folder))
            rows[label] = {
                "bundle_bytes": sum(size for _, size, _ in sizes),
                "encoder_bytes": next(size for name, size, _ in sizes if name.startswith("encoder")),
                "matmulnbits": count_ops(int4, "MatMulNBits"),
                "conv_left": count_ops(int4, "Conv"),
                "cosine": cosine(outputs[0], outputs[i]),
                "latency_ratio": latencies[i] / latencies[0],
                "latency_ms": 1000 * latencies[i],
            }
        rows["with the rewrite (ours)"]["int4_share"] = report["weights_with_rewrite"]["share"]
        rows["without the rewrite"]["int4_share"] = report["weights_without_rewrite"]["share"]
        result = {
            "cpus": os.cpu_count(),
            "versions": {"onnx": onnx.__version__, "onnxruntime": ort.__version__},
            "fp32_encoder_bytes": sum(size for name, size, _ in bundle_sizes(str(encoder.parent))),
            "fp32_latency_ms": 1000 * latencies[0],
            "rows": rows,
            "steps": [asdict(s) for s in steps],
            "ours_encoder_peak_rss_until_saved_mb": report["peak_rss_quantize_bytes"] / 2**20,
        }
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(result: dict[str, Any]) -> None:
    mib = 2**20
    print(
        f"fp32 encoder {result['fp32_encoder_bytes'] / mib:.1f} MiB, latency "
        f"{result['fp32_latency_ms']:.0f} ms (B=1, {FRAMES} frames, 2 threads); {result['cpus']} CPUs, "
        f"onnx {result['versions']['onnx']}, onnxruntime {result['versions']['onnxruntime']}\n"
    )
    print(
        "| recipe | bundle MiB | encoder MiB | MatMulNBits | Conv left | int4 share of encoder weights "
        "| cosine vs fp32 | int4 latency vs fp32 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, row in result["rows"].items():
        print(
            f"| {label} | {row['bundle_bytes'] / mib:.1f} | {row['encoder_bytes'] / mib:.1f} | "
            f"{row['matmulnbits']} | {row['conv_left']} | {row['int4_share']:.1%} | {row['cosine']:.4f} | "
            f"{row['latency_ratio']:.2f}x ({row['latency_ms']:.0f} ms) |"
        )
    print("\n| step | wall s | peak RSS MiB | exit |")
    print("| --- | ---: | ---: | ---: |")
    for step in result["steps"]:
        print(
            f"| {step['name']} | {step['seconds']:.1f} | {step['peak_rss_mb']:.0f} | {step['returncode']} |"
        )
    print(
        "\nours, encoder: peak RSS until the quantized model is saved "
        f"{result['ours_encoder_peak_rss_until_saved_mb']:.0f} MiB; the rest of the peak is the accuracy "
        "check, which runs the fp32 model in onnxruntime"
    )


if __name__ == "__main__":
    main()
