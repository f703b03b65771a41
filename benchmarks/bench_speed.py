"""int4 that is faster: fp32, the seed's recipe and the tool's default, latency and accuracy in one table.

Reads the parakeet-size exports made by ``fastconformer.py cache`` (the encoder
``encoder-dynamo`` by default, and the TDT decoder + joint) and runs, each as its own process, the
commands a user types:

* **recipe**: ``quantize ENCODER --block-size 64 --asymmetric --accuracy-level 0 --no-bench`` (the
  seed's recipe: MatMulNBits 4 bits, block 64, asymmetric, accuracy level 0, on the tool's rewrite);
* **default**: ``quantize ENCODER`` with nothing else but ``--bench-lengths``: the block size and
  accuracy level chosen by timing them on this CPU;
* **decoder**: ``quantize DECODER --int8-dynamic --no-bench`` (the same for both bundles);
* ``bench`` on the three encoders at the two lengths (batch 1, interleaved rounds, sessions that do
  not spin), and on the fp32 and int8 decoder/joint at two small lengths (T = U: one decoding step,
  then 10 frames by 10 tokens).

Then, in this process, each encoder's cosine to fp32 (the worst float output, at a third length that
neither timing nor the quantizer's own accuracy check used) and the sizes. One table: size, cosine,
latency ratio to fp32 at each length with its 95% interval, and the wall time and peak RSS of each
quantize step; the CPU named above it.

Usage::

    python benchmarks/bench_speed.py [--cache DIR] [--encoder SUBDIR] [--work DIR]
                                     [--lengths 200,1000] [--rounds 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _process import run_measured

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
ENCODER = "encoder-model.onnx"
DECODER = Path("decoder") / "decoder_joint-model.onnx"
COSINE_LENGTH = 333  # frames: a length neither the timing nor the accuracy check uses
DECODER_LENGTHS = "1,10"


def run(name: str, argv: list[str], stdout: bool = False) -> tuple[dict[str, Any], str]:
    """One process: its wall time and peak RSS (of that child alone), and its stdout when asked."""
    print(f"[{name}] {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as log, tempfile.TemporaryFile() as out:
        usage = run_measured(argv, stdout=out if stdout else subprocess.DEVNULL, stderr=log)
        seconds = usage.seconds
        code = usage.returncode
        if code != 0:
            log.seek(0)
            raise SystemExit(f"[{name}] failed ({code}): {log.read().decode()[-3000:]}")
        out.seek(0)
        text = out.read().decode()
    return {"name": name, "seconds": round(seconds, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024)}, text


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "onnx_conv2matmul", *map(str, args)]


def files_bytes(path: Path) -> int:
    from onnx_conv2matmul.files.paths import model_file_bytes

    return model_file_bytes(str(path))


def worst_cosine(fp32: Path, candidate: Path) -> float:
    from onnx_conv2matmul.verify.check import VerifyOptions, verify_models

    report = verify_models(
        str(fp32), str(candidate), VerifyOptions(lengths=(COSINE_LENGTH,), report_only=True)
    )
    return min(r.cosine for r in report.results if r.cosine is not None)


def measure(encoder: Path, decoder: Path, work: Path, lengths: str, rounds: int) -> dict[str, Any]:
    recipe, default = (
        work / "recipe" / "encoder-model.int4.onnx",
        work / "default" / "encoder-model.int4.onnx",
    )
    decoder_int8 = work / "decoder" / "decoder_joint-model.int8.onnx"
    for path in (recipe, default, decoder_int8):
        path.parent.mkdir(parents=True)
    steps = []
    step, _ = run(
        "recipe",
        cli(
            "quantize",
            encoder,
            recipe,
            "--block-size",
            "64",
            "--asymmetric",
            "--accuracy-level",
            "0",
            "--no-bench",
            "-q",
        ),
    )
    steps.append(step)
    report_path = work / "default.report.json"
    step, _ = run(
        "default",
        cli(
            "quantize", encoder, default, "--bench-lengths", lengths, "--bench-rounds", rounds, "-q",
            "--report-json", report_path,
        ),
    )  # fmt: skip
    steps.append(step)
    step, _ = run(
        "decoder int8",
        cli("quantize", decoder, decoder_int8, "--int8-dynamic", "--no-bench", "--verify-lengths", "8", "-q"),
    )
    steps.append(step)
    _, text = run(
        "bench encoders",
        cli(
            "bench", encoder, recipe, default, "--bench-lengths", lengths, "--bench-rounds", rounds,
            "--report-json-stdout", "-q",
        ),
        stdout=True,
    )  # fmt: skip
    encoders = json.loads(text)
    _, text = run(
        "bench decoder",
        cli(
            "bench", decoder, decoder_int8, "--bench-lengths", DECODER_LENGTHS, "--bench-rounds", rounds,
            "--report-json-stdout", "-q",
        ),
        stdout=True,
    )  # fmt: skip
    decoders = json.loads(text)
    chosen = json.loads(report_path.read_text())
    rows = []
    for label, path, model in zip(
        ("fp32", "recipe", "default"), (encoder, recipe, default), encoders["models"], strict=True
    ):
        rows.append(
            {
                "model": f"encoder {label}",
                "bytes": files_bytes(path),
                "cosine": None if label == "fp32" else worst_cosine(encoder, path),
                "latencies": model["latencies"],
            }
        )
    for label, path, model in zip(("fp32", "int8"), (decoder, decoder_int8), decoders["models"], strict=True):
        rows.append({"model": f"decoder/joint {label}", "bytes": files_bytes(path), "cosine": None, **model})
    return {
        "cpu": encoders["cpu"],
        "lengths": encoders["lengths"]["used"],
        "decoder_lengths": decoders["lengths"]["used"],
        "rounds": rounds,
        "chosen": chosen_kernel(chosen),
        "rows": rows,
        "steps": steps,
        "warnings": encoders["warnings"] + decoders["warnings"],
    }


def chosen_kernel(report: dict[str, Any]) -> dict[str, Any]:
    """What the default's report says it chose: from whole-model timings (``kernel_choice``, with
    ``--bench full`` or a retry) or, by default, from per-shape costs (``kernel_costs``)."""
    choice, costs = report.get("kernel_choice"), report.get("kernel_costs")
    if choice:
        candidates = [
            {
                "name": c["name"],
                "detail": f"cosine {c['cosine']:.5f} meets {c['meets_target']}",
                "speed": c["speed"],
            }
            for c in choice.get("candidates", [])
        ]
        return {"winner": choice["winner"], "reason": choice["reason"], "candidates": candidates}
    if costs:
        candidates = [
            {
                "name": f"block {c['block_size']} level {c['accuracy_level']}",
                "detail": "MatMuls' cost per shape, x float's",
                "speed": c["x_float"],
            }
            for c in costs["candidates"]
        ]
        winner = candidates[costs["winner"]]["name"] if candidates else None
        return {"winner": winner, "reason": costs["reason"], "candidates": candidates}
    return {"winner": None, "reason": None, "candidates": []}


def ratio_text(latency: dict[str, Any]) -> str:
    if latency["ratio"] is None:
        return f"{latency['median_ms']:.0f} ms"
    low, high = latency["ratio_interval"]
    return f"{latency['ratio']:.2f} [{low:.2f}, {high:.2f}]"


def print_table(result: dict[str, Any]) -> None:
    print(f"CPU: {result['cpu']}; batch 1, {result['rounds']} interleaved rounds, medians")
    print(f"encoder lengths {result['lengths']} frames; decoder/joint T = U = {result['decoder_lengths']}")
    print(f"default chose: {result['chosen']['winner']} ({result['chosen']['reason']})")
    for candidate in result["chosen"]["candidates"]:
        speed = "-" if candidate["speed"] is None else f"{candidate['speed']:.3f}"
        print(f"  {candidate['name']:30s} {candidate['detail']}: {speed}")
    lengths = result["lengths"]
    header = [
        "model",
        "MiB",
        f"cosine@{COSINE_LENGTH}",
        *(f"x fp32 at {n} / T=U={u}" for n, u in zip(lengths, result["decoder_lengths"], strict=False)),
    ]
    print(" | ".join(header))
    for row in result["rows"]:
        cosine = "-" if row["cosine"] is None else f"{row['cosine']:.5f}"
        cells = [row["model"], f"{row['bytes'] / 2**20:.1f}", cosine, *map(ratio_text, row["latencies"])]
        print(" | ".join(cells))
    for step in result["steps"]:
        print(f"quantize {step['name']}: {step['seconds']} s, peak RSS {step['peak_rss_mib']} MiB")
    for warning in result["warnings"]:
        print(f"warning: {warning}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--encoder", default="encoder-dynamo", help="encoder directory in the cache")
    parser.add_argument(
        "--decoder", type=Path, default=None, help="decoder/joint model (default: in the cache)"
    )
    parser.add_argument("--work", type=Path, default=None, help="where outputs go (default: in --cache)")
    parser.add_argument("--lengths", default="200,1000", help="encoder lengths in frames (default: 200,1000)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    encoder = args.cache / args.encoder / ENCODER
    decoder = args.decoder or args.cache / DECODER
    for path in (encoder, decoder):
        if not path.exists():
            raise SystemExit(f"missing {path}: run `python benchmarks/fastconformer.py cache` first")
    work = Path(tempfile.mkdtemp(prefix="speed-", dir=args.work or args.cache))
    try:
        load = os.getloadavg()
        result = measure(encoder, decoder, work, args.lengths, args.rounds)
        result["load_average"] = [list(load), list(os.getloadavg())]
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
