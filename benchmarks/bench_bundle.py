"""The int4 bundle of a Parakeet-shaped model: the recipe by hand against ``quantize``, ``--auto`` included.

Reads the parakeet-size exports made by ``fastconformer.py cache``: by default the encoder that
keeps its relative positional table ``[1, 9999, 1024]`` as an initializer, as a NeMo export does
(``encoder-dynamo-table``), and the TDT decoder + joint. Four bundles, in one run:

* **recipe**: the tool's rewrite of every pointwise conv (``convert --extended-conv1x1
  --allow-non-unit-dilation --allow-added-transposes``), then onnxruntime's ``MatMulNBitsQuantizer``
  on it as documented (whole model, 4 bits, block 64, asymmetric) and ``quantize_dynamic`` (int8
  weights) on the decoder/joint;
* **quantize defaults**: ``onnx-conv2matmul quantize`` on the encoder, ``quantize --int8-dynamic``
  on the decoder/joint (this decoder is shared by the rows below);
* **--auto at the recipe's cosine**: ``quantize --auto --min-cosine C`` where C is the recipe
  encoder's worst cosine to fp32 on the tool's own default check inputs, measured here first;
* **--auto 0.99**: ``quantize --auto --min-cosine 0.99``.

Every step runs as its own process; wall time and peak RSS are per process (``wait4``); a row's
wall time is the sum of its steps and its peak RSS their maximum (the shared decoder step counts
in every row that uses it). Then, in this process: the cosine of each encoder's outputs against
fp32 at B=1, 1000 frames (``encoded_lengths`` must be equal), and the latency of each encoder
relative to fp32 (B=1, 1000 frames, default optimizations, 2 threads), timed in interleaved
rounds with sessions that do not spin (see ``_timing``), each ratio of medians with a 95%
bootstrap interval over the rounds.

Usage::

    python benchmarks/bench_bundle.py [--cache DIR] [--encoder SUBDIR] [--work DIR]
                                      [--latency-runs N] [--json FILE]
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from _process import run_measured
from _timing import interleaved_latency, ratio_interval, ratio_of_medians, timed_session
from onnx_conv2matmul._graphs import count_op
from onnx_conv2matmul.bundle.listing import bundle_sizes
from onnx_conv2matmul.verify.check import VerifyOptions, verify_models

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
DEFAULT_ENCODER_DIR = "encoder-dynamo-table"
ENCODER_NAME = "encoder-model.onnx"
DECODER = Path("decoder") / "decoder_joint-model.onnx"
FRAMES = 1000
THREADS = 2
HIGH_COSINE = 0.99
INT4_NAME, INT8_NAME = "encoder-model.int4.onnx", "decoder_joint-model.int8.onnx"

RECIPE_ENCODER_SCRIPT = """
import sys
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
quantizer = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=64, is_symmetric=False,
                                 accuracy_level=0)
quantizer.process()
quantizer.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""

RECIPE_DECODER_SCRIPT = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8)
"""


@dataclass
class Step:
    name: str
    seconds: float
    cpu_seconds: float
    peak_rss_mb: float
    returncode: int


def run(name: str, argv: list[str]) -> Step:
    """Run one process; its wall time and peak RSS (ru_maxrss of that child only)."""
    print(f"[{name}] ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as log:  # a pipe would fill up and block the child
        usage = run_measured(argv, stdout=subprocess.DEVNULL, stderr=log)
        seconds = usage.seconds
        code = usage.returncode
        if code != 0:
            log.seek(0)
            print(f"[{name}] failed: {log.read().decode()[-2000:]}", file=sys.stderr)
    step = Step(name, seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, code)
    if code != 0:
        print_steps([asdict(step)])
        raise SystemExit(f"step {name!r} failed (its error is above)")
    return step


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnx_conv2matmul", *args]


def encoder_feeds(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    features = {arg.name: arg for arg in session.get_inputs()}["audio_signal"].shape[1]
    rng = np.random.default_rng(0)
    return {
        "audio_signal": rng.standard_normal((1, features, FRAMES)).astype(np.float32),
        "length": np.array([FRAMES], dtype=np.int64),
    }


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def check_cosine(fp32: Path, candidate: Path) -> float:
    """The candidate's worst float-output cosine on the tool's own default check inputs."""
    report = verify_models(str(fp32), str(candidate), VerifyOptions(report_only=True))
    return min(r.cosine for r in report.results if r.cosine is not None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--encoder",
        default=DEFAULT_ENCODER_DIR,
        help=f"encoder directory in the cache (default: {DEFAULT_ENCODER_DIR}; encoder-dynamo computes"
        " its positional table in the graph)",
    )
    parser.add_argument("--work", type=Path, default=None, help="where outputs go (default: in --cache)")
    parser.add_argument(
        "--latency-runs",
        type=int,
        default=20,
        help="rounds of timed runs, one run of each encoder per round (default: 20)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.latency_runs < 2:
        parser.error("--latency-runs must be at least 2")
    encoder, decoder = args.cache / args.encoder / ENCODER_NAME, args.cache / DECODER
    for path in (encoder, decoder):
        if not path.exists():
            raise SystemExit(f"missing {path}: run `python benchmarks/fastconformer.py cache` first")
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bundle-", dir=args.work or args.cache))
    try:
        result = measure(encoder, decoder, work, args.latency_runs)
        result["load_average_start"] = list(load_at_start)
        result["load_average_end"] = list(os.getloadavg())
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(encoder: Path, decoder: Path, work: Path, latency_runs: int) -> dict[str, Any]:
    folders = {label: work / label for label in ("recipe", "defaults", "auto-recipe", "auto-high")}
    for folder in folders.values():
        folder.mkdir()
    rewritten = work / "rewritten" / ENCODER_NAME
    rewritten.parent.mkdir()
    steps: dict[str, list[Step]] = {}
    rewrite_flags = ["--extended-conv1x1", "--allow-non-unit-dilation", "--allow-added-transposes"]
    steps["recipe"] = [
        run("recipe: rewrite (convert)", cli("convert", str(encoder), str(rewritten), *rewrite_flags, "-q")),
        run(
            "recipe: encoder MatMulNBitsQuantizer",
            [sys.executable, "-c", RECIPE_ENCODER_SCRIPT, str(rewritten), str(folders["recipe"] / INT4_NAME)],
        ),
        run(
            "recipe: decoder quantize_dynamic",
            [sys.executable, "-c", RECIPE_DECODER_SCRIPT, str(decoder), str(folders["recipe"] / INT8_NAME)],
        ),
    ]
    shutil.rmtree(rewritten.parent)
    recipe_cosine = check_cosine(encoder, folders["recipe"] / INT4_NAME)
    # The search must reach the recipe's cosine as printed (and so measured) to 5 decimals.
    target = float(f"{recipe_cosine:.5f}")
    reports = {label: work / f"{label}.json" for label in folders if label != "recipe"}
    decoder_step = run(
        "quantize --int8-dynamic: decoder",
        cli(
            "quantize",
            str(decoder),
            str(folders["defaults"] / INT8_NAME),
            "--int8-dynamic",
            "-q",
        ),
    )
    for label in ("auto-recipe", "auto-high"):
        shutil.copy(folders["defaults"] / INT8_NAME, folders[label] / INT8_NAME)
    encoder_args = {
        "defaults": [],
        "auto-recipe": ["--auto", "--min-cosine", f"{target}"],
        "auto-high": ["--auto", "--min-cosine", f"{HIGH_COSINE}"],
    }
    for label, extra in encoder_args.items():
        step = run(
            f"quantize {' '.join(extra) or '(defaults)'}: encoder",
            cli(
                "quantize",
                str(encoder),
                str(folders[label] / INT4_NAME),
                *extra,
                "-q",
                "--report-json",
                str(reports[label]),
            ),
        )
        steps[label] = [step, decoder_step]
    encoders = [encoder, *(folder / INT4_NAME for folder in folders.values())]
    print("[latency] ...", file=sys.stderr, flush=True)
    sessions = [timed_session(path, THREADS) for path in encoders]
    feeds = encoder_feeds(sessions[0])
    outputs = [session.run(None, feeds) for session in sessions]
    times = interleaved_latency(sessions, feeds, latency_runs)
    del sessions
    recipe_bytes = sum(size for _, size, _ in bundle_sizes(str(folders["recipe"])))
    rows: dict[str, dict[str, Any]] = {}
    for index, (label, folder) in enumerate(folders.items(), start=1):
        sizes = bundle_sizes(str(folder))
        bundle = sum(size for _, size, _ in sizes)
        low, high = ratio_interval(times[0], times[index])
        report = json.loads(reports[label].read_text()) if label in reports else None
        search = report["auto"] if report else None
        rows[label] = {
            "bundle_bytes": bundle,
            "ratio_to_recipe": bundle / recipe_bytes,
            "encoder_bytes": next(size for name, size, _ in sizes if name.startswith("encoder")),
            "decoder_bytes": next(size for name, size, _ in sizes if name.startswith("decoder")),
            "matmulnbits": count_op(onnx_ir_load(folder / INT4_NAME), "MatMulNBits"),
            "cosine_outputs": cosine(outputs[0][0], outputs[index][0]),
            "encoded_lengths_equal": bool(np.array_equal(outputs[0][1], outputs[index][1])),
            "check_cosine": recipe_cosine if label == "recipe" else check_cosine(encoder, folder / INT4_NAME),
            "latency_ratio": ratio_of_medians(times[0], times[index]),
            "latency_ratio_interval": [low, high],
            "latency_ms": statistics.median(times[index]),
            "seconds": sum(step.seconds for step in steps[label]),
            "peak_rss_mb": max(step.peak_rss_mb for step in steps[label]),
            "min_cosine": None if search is None else search["min_cosine"],
            "search_seconds": None if search is None else search["seconds"],
            "full_evaluations": None if search is None else search["full_evaluations"],
            "settings": None if search is None else search["settings"],
            "other_weights_saved_bytes": (
                report["other_weights"]["saved_bytes"] if report and report["other_weights"] else 0
            ),
        }
    all_steps = [asdict(step) for label_steps in steps.values() for step in label_steps]
    unique = list({step["name"]: step for step in all_steps}.values())
    return {
        "cpus": os.cpu_count(),
        "versions": {"onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "encoder": str(encoder),
        "fp32_encoder_bytes": sum(size for _, size, _ in bundle_sizes(str(encoder.parent))),
        "fp32_latency_ms": statistics.median(times[0]),
        "latency_rounds": latency_runs,
        "recipe_check_cosine": recipe_cosine,
        "auto_target": target,
        "rows": rows,
        "steps": unique,
    }


def onnx_ir_load(path: Path) -> Any:
    import onnx_ir as ir

    return ir.load(str(path))  # weights stay memory-mapped, unread


def print_steps(steps: list[dict[str, Any]]) -> None:
    print("\n| step (own process) | wall s | CPU s | peak RSS MiB | exit |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for step in steps:
        print(
            f"| {step['name']} | {step['seconds']:.1f} | {step['cpu_seconds']:.1f} "
            f"| {step['peak_rss_mb']:.0f} | {step['returncode']} |"
        )


LABELS = {
    "recipe": "recipe (rewrite + MatMulNBitsQuantizer, int8 dynamic decoder)",
    "defaults": "`quantize` defaults",
    "auto-recipe": "`quantize --auto` at the recipe's cosine",
    "auto-high": f"`quantize --auto --min-cosine {HIGH_COSINE}`",
}


def print_table(result: dict[str, Any]) -> None:
    mib = 2**20
    versions = result["versions"]
    start, end = (
        " ".join(f"{x:.2f}" for x in result[key]) for key in ("load_average_start", "load_average_end")
    )
    print(
        f"fp32 encoder {result['fp32_encoder_bytes'] / mib:.1f} MiB ({result['encoder']}), latency "
        f"{result['fp32_latency_ms']:.0f} ms (B=1, {FRAMES} frames, {THREADS} threads, median of "
        f"{result['latency_rounds']} rounds); {result['cpus']} CPUs, load average {start} at the start, "
        f"{end} at the end; onnx {versions['onnx']}, onnxruntime {versions['onnxruntime']}; "
        f"recipe's worst cosine on the default check inputs: {result['recipe_check_cosine']:.5f},"
        f" so --auto --min-cosine {result['auto_target']}\n"
    )
    print(
        "| bundle | MiB | vs recipe | cosine `outputs` (1000 frames) | `encoded_lengths` "
        "| cosine, check input | int4 encoder latency vs fp32 (95% interval) | wall s | peak RSS MiB "
        "| search: evaluations, s |"
    )
    print("| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: |")
    for label, row in result["rows"].items():
        low, high = row["latency_ratio_interval"]
        search = (
            "-"
            if row["full_evaluations"] is None
            else f"{row['full_evaluations']}, {row['search_seconds']:.0f}"
        )
        print(
            f"| {LABELS[label]} | {row['bundle_bytes'] / mib:.1f} | {row['ratio_to_recipe']:.3f} | "
            f"{row['cosine_outputs']:.4f} | {'equal' if row['encoded_lengths_equal'] else 'DIFFER'} | "
            f"{row['check_cosine']:.4f} | {row['latency_ratio']:.3f} ({low:.3f}-{high:.3f}) | "
            f"{row['seconds']:.0f} | {row['peak_rss_mb']:.0f} | {search} |"
        )
    print()
    for label, row in result["rows"].items():
        if row["settings"]:
            chosen = ", ".join(f"{count} x {name}" for name, count in row["settings"].items())
            saved = row["other_weights_saved_bytes"] / mib
            print(f"- {LABELS[label]}: {chosen}; other weights int8: {saved:.1f} MiB saved")
    print_steps(result["steps"])


if __name__ == "__main__":
    main()
