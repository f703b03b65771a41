"""The quantize command without its accuracy check, against MatMulNBitsQuantizer on the whole model.

Reads the Parakeet-shaped encoder made by ``fastconformer.py cache``. Both sides quantize the
same rewritten encoder (MatMulNBits 4 bits, block 64, asymmetric, accuracy level 0):

* ours: ``quantize_file`` run up to the accuracy check (load, checker on the input, rewrite,
  quantize node by node, save, checker on the output), each phase timed; the run stops where
  the accuracy check would start;
* ours with every weight through a protobuf graph and onnxruntime's per-node ``quantize`` (the
  path before weights were quantized from their arrays);
* baseline: onnxruntime's ``MatMulNBitsQuantizer`` as documented: load the rewritten model
  (written once beforehand by ``onnx-conv2matmul convert``), ``process()``, save with external
  data.

Each run is its own process (wall time and peak RSS per process, ``wait4``), in rounds
rotating the order. With ``--profile`` one more run of ours breaks the quantize phase down by
where its time goes (cProfile, cumulative seconds of the main calls).

Usage::

    python benchmarks/bench_quantize_phase.py [--cache DIR] [--rounds N] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _process import run_measured

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
ENCODER = Path("encoder-dynamo") / "encoder-model.onnx"

BASELINE_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
quantizer = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=64, is_symmetric=False, accuracy_level=0)
t1 = time.perf_counter()
quantizer.process()
t2 = time.perf_counter()
quantizer.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
t3 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "quantize": t2 - t1, "save": t3 - t2}))
"""

# Runs quantize_file up to the accuracy check and prints the seconds of each phase.
OURS_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from onnx_conv2matmul.quantize import workflow as pipeline

class Stop(Exception):
    pass

class Phases:
    def __init__(self):
        self.times = {}
        self.current = ("import", t0)
    def phase(self, name):
        now = time.perf_counter()
        label, start = self.current
        self.times[label] = self.times.get(label, 0.0) + now - start
        self.current = (name, now)
        if name == "Measuring accuracy":
            raise Stop
    def advance(self, done, total):
        pass
    def close(self):
        pass

profile = "--profile" in sys.argv[3:]
if "--through-proto" in sys.argv[3:]:
    # Every weight through a protobuf graph and onnxruntime's DefaultWeightOnlyQuantizer.quantize,
    # as before the array path existed.
    from onnx_conv2matmul.quantize import nbits as quantize
    quantize._DIRECT_TYPES = frozenset()
if profile:
    import cProfile, pstats
    original = pipeline.quantize_matmul_nbits
    profiler = cProfile.Profile()
    def profiled(*args, **kwargs):
        profiler.enable()
        try:
            return original(*args, **kwargs)
        finally:
            profiler.disable()
    pipeline.quantize_matmul_nbits = profiled
phases = Phases()
try:
    # search_below off: the path of settings given (quantize, save, check), not the default's one
    # pass (which checks candidates in memory before it saves; bench_onepass.py times that).
    pipeline.quantize_file(sys.argv[1], sys.argv[2], pipeline.Request(progress=phases, search_below=False))
except Stop:
    pass
result = {"phases": phases.times}
if profile:
    stats = pstats.Stats(profiler)
    calls = {}
    for (path, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():
        calls[f"{path.rsplit('/', 2)[-1]}:{name}"] = calls.get(f"{path.rsplit('/', 2)[-1]}:{name}", 0.0) + ct
    result["profile"] = dict(sorted(calls.items(), key=lambda kv: -kv[1])[:40])
print(json.dumps(result))
"""


def run(argv: list[str]) -> tuple[float, float, dict[str, Any]]:
    """One process: wall seconds, peak RSS (MiB) and the JSON it printed."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        usage = run_measured(argv, stdout=out, stderr=err)
        seconds = usage.seconds
        if usage.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{argv[:3]} failed: {err.read().decode()[-2000:]}")
        out.seek(0)
        return seconds, usage.ru_maxrss / 1024, json.loads(out.read().decode().strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    encoder = args.cache / ENCODER
    if not encoder.exists():
        raise SystemExit(f"missing {encoder}: run `python benchmarks/fastconformer.py cache` first")
    with tempfile.TemporaryDirectory(prefix="qphase-", dir=args.cache) as work:
        rewritten = Path(work) / "rewritten.onnx"
        subprocess.run(
            [sys.executable, "-m", "onnx_conv2matmul", str(encoder), str(rewritten), "--extended-conv1x1",
             "--allow-non-unit-dilation", "-q"],
            check=True,
        )  # fmt: skip
        ours_argv = [sys.executable, "-c", OURS_SCRIPT, str(encoder), str(Path(work) / "ours.onnx")]
        base_argv = [sys.executable, "-c", BASELINE_SCRIPT, str(rewritten), str(Path(work) / "base.onnx")]
        proto_argv = [*ours_argv, "--through-proto"]
        results: dict[str, list[tuple[float, float, dict[str, Any]]]] = {
            "ours": [],
            "ours, weights through protobuf": [],
            "baseline": [],
        }
        for index in range(args.rounds):
            order = [
                ("ours", ours_argv),
                ("ours, weights through protobuf", proto_argv),
                ("baseline", base_argv),
            ]
            for name, argv in order[index % 3 :] + order[: index % 3]:
                results[name].append(run(argv))
                for leftover in Path(work).glob("base.onnx*"):
                    leftover.unlink()
        ours_wall = statistics.median(r[0] for r in results["ours"])
        base_wall = statistics.median(r[0] for r in results["baseline"])
        print(f"{'run':<40} {'wall s':>8} {'peak RSS MiB':>13}")
        for name, runs in results.items():
            for seconds, rss, _ in runs:
                print(f"{name:<40} {seconds:8.1f} {rss:13.0f}")
        proto_wall = statistics.median(r[0] for r in results["ours, weights through protobuf"])
        print(f"ours / baseline (median wall): {ours_wall / base_wall:.2f}")
        print(f"ours through protobuf / baseline (median wall): {proto_wall / base_wall:.2f}")
        for name, runs in results.items():
            keys = list(runs[0][2].get("phases", runs[0][2]))
            per = runs[0][2].get("phases", runs[0][2])
            phases = {
                k: statistics.median(r[2].get("phases", r[2])[k] for r in runs) for k in keys if k in per
            }
            print(f"{name} phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
        if args.profile:
            _, _, profiled = run([*ours_argv, "--profile"])
            print("quantize phase, cumulative seconds of the main calls:")
            for call, seconds in profiled["profile"].items():
                print(f"  {seconds:7.2f}  {call}")


if __name__ == "__main__":
    main()
