"""The int4 bundle of a Parakeet-shaped model: our quantize pipeline against the recipe without it.

Builds nothing itself: it reads the parakeet-size exports made by ``fastconformer.py cache``
(encoder with one ``.data`` file, TDT decoder + joint). Side by side, in one run:

* ours: ``onnx-conv2matmul quantize`` on the encoder (rewrite + MatMulNBits 4 bits, block 64,
  asymmetric, accuracy level 0) and ``quantize --int8-dynamic`` on the decoder/joint;
* baseline: the same recipe without the rewrite, each model through onnxruntime's API as it is
  documented: ``MatMulNBitsQuantizer`` on the fp32 encoder (whole model) and ``quantize_dynamic``
  (int8 weights) on the fp32 decoder/joint, in their own processes.

Every step runs as its own process; wall time and peak RSS are per process (``wait4``). Then, in
this process, on each output model itself: its MatMulNBits, the Convs left, the share of its
weights stored as int4; the cosine of the encoder outputs against fp32, and onnxruntime CPU latency
of each int4 encoder relative to fp32 (B=1, 1000 frames, default optimizations, 2 threads). The
three encoders are timed in rounds, one run of each per round in a rotating order, with sessions
that do not spin (see ``_timing``); each ratio of medians comes with a 95% bootstrap interval over
the rounds.

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

from _timing import interleaved_latency, ratio_interval, ratio_of_medians, timed_session
from onnx_conv2matmul._graphs import count_op, walk_graphs
from onnx_conv2matmul.pipeline import bundle_sizes

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
ENCODER = Path("encoder-dynamo") / "encoder-model.onnx"
DECODER = Path("decoder") / "decoder_joint-model.onnx"
FRAMES = 1000
THREADS = 2
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})

BASELINE_ENCODER_SCRIPT = """
import sys
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
quantizer = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=64, is_symmetric=False,
                                 accuracy_level=0)
quantizer.process()
quantizer.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""

BASELINE_DECODER_SCRIPT = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8)
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


def int4_share(path: Path) -> float:
    """The share of a quantized model's weights that it stores in 4 bits, read from the model.

    Parameters, not bytes: K x N per 4-bit MatMulNBits against those plus every element of
    the float initializers and Constant tensors that remain, except the MatMulNBits scales
    (quantization data, not weights). For an fp32 input this is the share of its fp32 weight
    bytes that became int4. Weights are memory-mapped, not read.
    """
    model = ir.load(str(path))
    int4 = 0
    quantization_data: set[str] = set()
    floats: dict[str, int] = {}
    for graph, _ in walk_graphs(model.graph):
        for node in graph:
            if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
                attrs = node.attributes
                if attrs["bits"].as_int() == 4:
                    int4 += attrs["K"].as_int() * attrs["N"].as_int()
                quantization_data.update(v.name for v in node.inputs[1:5] if v is not None and v.name)
            elif node.op_type == "Constant" and "value" in node.attributes:
                tensor = node.attributes["value"].as_tensor()
                if tensor.dtype in FLOAT_TYPES:
                    floats[node.outputs[0].name or ""] = tensor.size
        for name, value in graph.initializers.items():
            tensor = value.const_value
            if tensor is not None and tensor.dtype in FLOAT_TYPES:
                floats[name] = tensor.size
    float_params = sum(size for name, size in floats.items() if name not in quantization_data)
    return int4 / (int4 + float_params)


def encoder_feeds(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    features = {arg.name: arg for arg in session.get_inputs()}["audio_signal"].shape[1]
    rng = np.random.default_rng(0)
    return {
        "audio_signal": rng.standard_normal((1, features, FRAMES)).astype(np.float32),
        "length": np.array([FRAMES], dtype=np.int64),
    }


def outputs_and_latency(paths: list[Path], runs: int) -> tuple[list[np.ndarray], list[list[float]]]:
    """Each model's encoder output and its latency samples (ms); sample ``i`` is round ``i``."""
    sessions = [timed_session(path, THREADS) for path in paths]
    feeds = encoder_feeds(sessions[0])
    outputs = [sess.run(None, feeds)[0] for sess in sessions]
    return outputs, interleaved_latency(sessions, feeds, runs)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--work", type=Path, default=None, help="where outputs go (default: in --cache)")
    parser.add_argument(
        "--latency-runs",
        type=int,
        default=30,
        help="rounds of timed runs, one run of each encoder per round (default: 30)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.latency_runs < 2:
        parser.error("--latency-runs must be at least 2")
    encoder, decoder = args.cache / ENCODER, args.cache / DECODER
    for path in (encoder, decoder):
        if not path.exists():
            raise SystemExit(f"missing {path}: run `python benchmarks/fastconformer.py cache` first")
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bundle-", dir=args.work or args.cache))
    ours, base = work / "ours", work / "baseline"
    ours.mkdir()
    base.mkdir()
    int4_name, int8_name = "encoder-model.int4.onnx", "decoder_joint-model.int8.onnx"
    try:
        steps = [
            run(
                "ours: encoder int4",
                cli(
                    "quantize",
                    str(encoder),
                    str(ours / int4_name),
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
                    str(ours / int8_name),
                    "--int8-dynamic",
                    "--verify-lengths",
                    "20",
                    "-q",
                ),
            ),
            run(
                "baseline: encoder int4 (MatMulNBitsQuantizer)",
                [sys.executable, "-c", BASELINE_ENCODER_SCRIPT, str(encoder), str(base / int4_name)],
            ),
            run(
                "baseline: decoder int8 (quantize_dynamic)",
                [sys.executable, "-c", BASELINE_DECODER_SCRIPT, str(decoder), str(base / int8_name)],
            ),
        ]
        if any(step.returncode != 0 for step in steps):
            print_steps([asdict(step) for step in steps])
            raise SystemExit("a step failed (its error is above)")
        report = json.loads((work / "ours-encoder.json").read_text())
        folders = {"with the rewrite (ours)": ours, "without the rewrite": base}
        outputs, times = outputs_and_latency(
            [encoder, *(folder / int4_name for folder in folders.values())], args.latency_runs
        )
        predicted = {
            "with the rewrite (ours)": report["weights_with_rewrite"]["share"],
            "without the rewrite": report["weights_without_rewrite"]["share"],
        }
        rows: dict[str, dict[str, Any]] = {}
        for i, (label, folder) in enumerate(folders.items(), start=1):
            int4 = folder / int4_name
            sizes = bundle_sizes(str(folder))
            low, high = ratio_interval(times[0], times[i])
            rows[label] = {
                "bundle_bytes": sum(size for _, size, _ in sizes),
                "encoder_bytes": next(size for name, size, _ in sizes if name.startswith("encoder")),
                "decoder_bytes": next(size for name, size, _ in sizes if name.startswith("decoder")),
                "matmulnbits": count_ops(int4, "MatMulNBits"),
                "conv_left": count_ops(int4, "Conv"),
                "int4_share": int4_share(int4),  # measured on this output
                "int4_share_predicted": predicted[label],  # MatMul weights of the fp32 model
                "cosine": cosine(outputs[0], outputs[i]),
                "latency_ratio": ratio_of_medians(times[0], times[i]),
                "latency_ratio_interval": [low, high],
                "latency_ms": statistics.median(times[i]),
                "latency_samples_ms": times[i],
            }
        low, high = ratio_interval(times[2], times[1])
        result = {
            "cpus": os.cpu_count(),
            "load_average_start": list(load_at_start),
            "load_average_end": list(os.getloadavg()),
            "versions": {"onnx": onnx.__version__, "onnxruntime": ort.__version__},
            "fp32_encoder_bytes": sum(size for name, size, _ in bundle_sizes(str(encoder.parent))),
            "fp32_latency_ms": statistics.median(times[0]),
            "fp32_latency_samples_ms": times[0],
            "latency_rounds": args.latency_runs,
            "ours_vs_baseline_latency": {
                "ratio": ratio_of_medians(times[2], times[1]),
                "interval": [low, high],
            },
            "rows": rows,
            "steps": [asdict(s) for s in steps],
            "ours_encoder_peak_rss_until_saved_mb": report["peak_rss_quantize_bytes"] / 2**20,
        }
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_steps(steps: list[dict[str, Any]]) -> None:
    print("\n| step (own process) | wall s | peak RSS MiB | exit |")
    print("| --- | ---: | ---: | ---: |")
    for step in steps:
        print(
            f"| {step['name']} | {step['seconds']:.1f} | {step['peak_rss_mb']:.0f} | {step['returncode']} |"
        )


def print_table(result: dict[str, Any]) -> None:
    mib = 2**20
    versions = result["versions"]
    start, end = (
        " ".join(f"{x:.2f}" for x in result[key]) for key in ("load_average_start", "load_average_end")
    )
    print(
        f"fp32 encoder {result['fp32_encoder_bytes'] / mib:.1f} MiB, latency "
        f"{result['fp32_latency_ms']:.0f} ms (B=1, {FRAMES} frames, {THREADS} threads, median of "
        f"{result['latency_rounds']} rounds); {result['cpus']} CPUs, load average {start} at the start, "
        f"{end} at the end; onnx {versions['onnx']}, onnxruntime {versions['onnxruntime']}\n"
    )
    print(
        "| recipe | bundle MiB | encoder MiB | decoder/joint MiB | MatMulNBits | Conv left "
        "| int4 share of encoder weights | cosine vs fp32 | int4 latency vs fp32 (95% interval) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, row in result["rows"].items():
        low, high = row["latency_ratio_interval"]
        print(
            f"| {label} | {row['bundle_bytes'] / mib:.1f} | {row['encoder_bytes'] / mib:.1f} | "
            f"{row['decoder_bytes'] / mib:.1f} | {row['matmulnbits']} | {row['conv_left']} | "
            f"{row['int4_share']:.1%} | {row['cosine']:.4f} | "
            f"{row['latency_ratio']:.3f} ({low:.3f}-{high:.3f}); {row['latency_ms']:.0f} ms |"
        )
    versus = result["ours_vs_baseline_latency"]
    low, high = versus["interval"]
    print(
        f"\nint4 latency, with the rewrite over without: {versus['ratio']:.3f} "
        f"(95% bootstrap interval {low:.3f}-{high:.3f})"
    )
    print_steps(result["steps"])
    print(
        "\nours, encoder: peak RSS until the quantized model is saved "
        f"{result['ours_encoder_peak_rss_until_saved_mb']:.0f} MiB; the rest of the peak is the accuracy "
        "check, which runs the fp32 model in onnxruntime"
    )


if __name__ == "__main__":
    main()
