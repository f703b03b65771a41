"""What making the output durable costs: the rewrite with and without its fsyncs.

The tool fsyncs its output before publishing it (and starts writeback as it writes). This
script times the console entry point on each cached encoder export twice per round, in
alternating order: as shipped, and in a launcher that turns ``os.fsync`` and the early
writeback into no-ops (for this measurement only). It prints the median times and the
median of the per-round differences, the cost of durability on this machine.

Usage::

    python benchmarks/bench_fsync.py [--cache DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "onnx-conv2matmul-bench"
EXPORTS = ("encoder-dynamo", "encoder-legacy")
FLAGS = ["--extended-conv1x1", "--allow-non-unit-dilation", "--max-dilation", "4", "-q"]
AS_SHIPPED = "import sys; from onnx_conv2matmul.cli.entry import run; sys.argv[0] = 'onnx-conv2matmul'; run()"
NO_FSYNC = (
    "import os, sys\n"
    "os.fsync = lambda fd: None\n"
    "from onnx_conv2matmul.files import datafile as _datafile\n"
    "_datafile._start_writeback = lambda *args: None\n"
    "from onnx_conv2matmul.cli.entry import run\n"
    "sys.argv[0] = 'onnx-conv2matmul'\n"
    "run()\n"
)


def timed(code: str, model: Path, work: Path) -> float:
    """One run into a fresh directory, after flushing what earlier runs wrote."""
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    os.sync()
    start = time.perf_counter()
    argv = [sys.executable, "-c", code, str(model), str(out / "model.onnx"), *FLAGS]
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"run failed: {done.stderr.strip().splitlines()[-1:]}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print("| export | with fsync s | without s | cost s (median of per-round differences) | rounds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in EXPORTS:
        model = args.cache.expanduser() / name / "encoder-model.onnx"
        if not model.exists():
            print(f"| {name} | not built: run benchmarks/fastconformer.py cache | | | |")
            continue
        with_fsync: list[float] = []
        without: list[float] = []
        with tempfile.TemporaryDirectory(dir=model.parent.parent) as work:
            for index in range(args.rounds):
                order = [(AS_SHIPPED, with_fsync), (NO_FSYNC, without)]
                for code, times in order if index % 2 == 0 else order[::-1]:
                    times.append(timed(code, model, Path(work)))
        cost = statistics.median(a - b for a, b in zip(with_fsync, without, strict=True))
        print(
            f"| {name} | {statistics.median(with_fsync):.2f} | {statistics.median(without):.2f} "
            f"| {cost:+.2f} | {args.rounds} |",
            flush=True,
        )
    print(f"\nLoad average after the runs: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
