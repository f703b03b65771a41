"""The seed's quantize commands with default options, accuracy check included: time and memory.

Reads the parakeet-size exports made by ``fastconformer.py cache`` (the TDT decoder + joint
``decoder/decoder_joint-model.onnx``: ``encoder_outputs [B, 1024, T]``, ``targets [B, U]``,
joint logits ``[B, T, U, 8198]``; the encoder ``encoder-dynamo-table/encoder-model.onnx``) and
runs, each as its own process, exactly what a user types:

* ``onnx-conv2matmul quantize decoder_joint-model.onnx OUT --int8-dynamic`` against
  onnxruntime's ``quantize_dynamic`` alone on the same file, in interleaved rounds; the
  tool's wall time over ``quantize_dynamic``'s (ratio of medians) and its peak RSS;
* ``onnx-conv2matmul quantize encoder-model.onnx OUT`` once (niced): its peak RSS over the
  model's size (the ``.onnx`` and its data).

Wall time and peak RSS are per process (``wait4``). The table ends with each limit of issue 23
and whether it holds: decoder at most 1 GB (10^9 bytes) peak RSS and at most 5x the wall time of
``quantize_dynamic``; encoder peak RSS at most 1.2x the model's size.

Usage::

    python benchmarks/bench_check.py [--cache DIR] [--encoder SUBDIR] [--rounds N]
                                     [--no-encoder] [--work DIR] [--json FILE]
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

from _process import run_measured

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
DEFAULT_ENCODER_DIR = "encoder-dynamo-table"
ENCODER = "encoder-model.onnx"
DECODER = Path("decoder") / "decoder_joint-model.onnx"
DECODER_RSS_LIMIT = 10**9
DECODER_TIME_LIMIT = 5.0
ENCODER_RSS_LIMIT = 1.2

QUANTIZE_DYNAMIC = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8)
"""


@dataclass
class Step:
    name: str
    seconds: float
    peak_rss_bytes: int
    returncode: int


def run(name: str, argv: list[str], *, nice: int = 0) -> Step:
    """One process: its wall time and peak RSS (``ru_maxrss`` of that child only)."""
    print(f"[{name}] ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as log:  # a pipe would fill up and block the child
        usage = run_measured(
            argv, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=(lambda: os.nice(nice)) if nice else None
        )
        seconds = usage.seconds
        code = usage.returncode
        if code != 0:
            log.seek(0)
            raise SystemExit(f"step {name!r} failed with exit {code}: {log.read().decode()[-2000:]}")
    return Step(name, seconds, usage.ru_maxrss * 1024, code)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnx_conv2matmul", *args]


def model_bytes(path: Path) -> int:
    """The ``.onnx`` file and every file beside it that is not a model (its external data)."""
    return path.stat().st_size + sum(
        p.stat().st_size for p in path.parent.iterdir() if p.is_file() and p.suffix != ".onnx" and p != path
    )


def measure_decoder(decoder: Path, work: Path, rounds: int) -> dict[str, Any]:
    """Interleaved rounds: quantize_dynamic alone, then the tool with default options."""
    baseline: list[Step] = []
    tool: list[Step] = []
    for number in range(1, rounds + 1):
        out = work / "qd.onnx"
        baseline.append(
            run(
                f"round {number}: quantize_dynamic",
                [sys.executable, "-c", QUANTIZE_DYNAMIC, str(decoder), str(out)],
            )
        )
        out.unlink()
        out = work / "decoder_joint-model.int8.onnx"
        tool.append(
            run(
                f"round {number}: quantize --int8-dynamic",
                cli("quantize", str(decoder), str(out), "--int8-dynamic", "-q"),
            )
        )
        out.unlink()
    base_median = statistics.median(s.seconds for s in baseline)
    tool_median = statistics.median(s.seconds for s in tool)
    return {
        "quantize_dynamic": [asdict(s) for s in baseline],
        "tool": [asdict(s) for s in tool],
        "quantize_dynamic_median_s": base_median,
        "tool_median_s": tool_median,
        "time_ratio": tool_median / base_median,
        "tool_peak_rss_bytes": max(s.peak_rss_bytes for s in tool),
        "quantize_dynamic_peak_rss_bytes": max(s.peak_rss_bytes for s in baseline),
    }


def measure_encoder(encoder: Path, work: Path) -> dict[str, Any]:
    out = work / "encoder-model.int4.onnx"
    report = work / "encoder.report.json"
    step = run(
        "encoder: quantize (defaults)",
        cli("quantize", str(encoder), str(out), "-q", "--report-json", str(report)),
        nice=10,
    )
    size = model_bytes(encoder)
    data = json.loads(report.read_text())
    verification = data["verification"]
    return {
        "step": asdict(step),
        "model_bytes": size,
        "rss_ratio": step.peak_rss_bytes / size,
        "check_lengths": verification["lengths"]["used"],
        "check_runs": verification["lengths"]["runs"],
        "peak_rss_quantize_bytes": data.get("peak_rss_quantize_bytes"),
    }


def print_table(result: dict[str, Any]) -> None:
    mb = 1e6
    print("\n| command (own process, default options) | wall s | peak RSS MB | measure | limit | holds |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    dec = result["decoder"]
    print(
        f"| onnxruntime quantize_dynamic (decoder/joint), median of {len(dec['tool'])} |"
        f" {dec['quantize_dynamic_median_s']:.2f} | {dec['quantize_dynamic_peak_rss_bytes'] / mb:.0f} |"
        " 1.00x | | |"
    )
    time_ok = dec["time_ratio"] <= DECODER_TIME_LIMIT
    rss_ok = dec["tool_peak_rss_bytes"] <= DECODER_RSS_LIMIT
    print(
        f"| quantize decoder --int8-dynamic, median | {dec['tool_median_s']:.2f} |"
        f" {dec['tool_peak_rss_bytes'] / mb:.0f} | {dec['time_ratio']:.2f}x time |"
        f" {DECODER_TIME_LIMIT:.0f}x | {'yes' if time_ok else 'NO'} |"
    )
    print(
        f"| (same) peak RSS | | | {dec['tool_peak_rss_bytes'] / mb:.0f} MB |"
        f" {DECODER_RSS_LIMIT / mb:.0f} MB | {'yes' if rss_ok else 'NO'} |"
    )
    enc = result.get("encoder")
    if enc is not None:
        ok = enc["rss_ratio"] <= ENCODER_RSS_LIMIT
        print(
            f"| quantize encoder ({enc['model_bytes'] / mb:.0f} MB model) | {enc['step']['seconds']:.1f} |"
            f" {enc['step']['peak_rss_bytes'] / mb:.0f} | {enc['rss_ratio']:.2f}x model |"
            f" {ENCODER_RSS_LIMIT:.1f}x | {'yes' if ok else 'NO'} |"
        )
        print(f"\nEncoder check lengths: {enc['check_lengths']}")
    print(f"Load average at start/end: {result['load_average_start']} / {result['load_average_end']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--encoder", default=DEFAULT_ENCODER_DIR, help="encoder directory in the cache")
    parser.add_argument("--rounds", type=int, default=3, help="decoder rounds (default: 3)")
    parser.add_argument("--no-encoder", action="store_true", help="measure the decoder/joint only")
    parser.add_argument("--work", type=Path, default=None, help="where outputs go (default: in --cache)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    decoder, encoder = args.cache / DECODER, args.cache / args.encoder / ENCODER
    for path in [decoder] + ([] if args.no_encoder else [encoder]):
        if not path.exists():
            raise SystemExit(f"missing {path}: run `python benchmarks/fastconformer.py cache` first")
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    work = Path(tempfile.mkdtemp(prefix="check-", dir=args.work or args.cache))
    try:
        result["decoder"] = measure_decoder(decoder, work, args.rounds)
        if not args.no_encoder:
            result["encoder"] = measure_encoder(encoder, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
