"""The default ``quantize`` against the seed's recipe and against ``--bench full``, side by side.

On the full-size Parakeet-shaped encoder (``fastconformer.py encoder --size parakeet
--positional-table 5000``: the relative positional table kept as NeMo does), in one run:

* **recipe**: ``convert`` (rewrite) then onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 64,
  level 0): the seed's command;
* **default, cold**: ``quantize ENC OUT`` with the kernel-cost cache empty (its own
  ``XDG_CACHE_HOME``);
* **default, warm**: the same command again, the cache filled by the cold run;
* **--bench full**: ``quantize ENC OUT --bench full`` (every candidate quantized and timed whole).

Each is a process of its own (wall time and its peak RSS by ``wait4``). Then the fp32 encoder, the
recipe's result, the default's and ``--bench full``'s are timed together in this process
(``onnx_conv2matmul.speed.timing.time_models``: ``allow_spinning`` 0, interleaved rounds, batch 1)
at 200 and 1000 frames: latency as a multiple of fp32. The table also gives each result's worst
cosine as its report states it, and the CPU with its flags (AVX-512, VNNI, AMX).

Usage::

    nice -n 5 python benchmarks/bench_defaults.py [--encoder PATH] [--rounds N] [--skip-full]
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

DEFAULT_ENCODER = Path("/work/bench-models/encoder-dynamo-table/encoder-model.onnx")
FLAGS = ("avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
TARGETS = {
    "cold wall x recipe": 2.0,
    "warm wall x recipe": 1.2,
    "latency x fp32 at 200": 0.6,
    "latency x fp32 at 1000": 0.8,
    "x --bench full's best": 1.08,
    "peak RSS x model": 1.2,
}

RECIPE_SCRIPT = """
import sys
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
quantizer = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=64, is_symmetric=False, accuracy_level=0)
quantizer.process()
quantizer.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""


def run(name: str, argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """One process: its wall seconds and peak RSS (of that child alone)."""
    print(f"[{name}] {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    with tempfile.TemporaryFile() as log:
        usage = run_measured(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        seconds = usage.seconds
        code = usage.returncode
        if code != 0:
            log.seek(0)
            raise SystemExit(f"[{name}] failed ({code}): {log.read().decode()[-3000:]}")
    print(f"[{name}] {seconds:.1f} s, peak RSS {usage.ru_maxrss / 1024:.0f} MiB", file=sys.stderr, flush=True)
    return {"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024}


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "onnx_conv2matmul", *map(str, args)]


def cpu_flags() -> tuple[str, list[str]]:
    from onnx_conv2matmul.speed.timing import cpu_name

    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return cpu_name(), [flag for flag in FLAGS if flag in flags]


def report_summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    verification = data.get("verification") or {}
    rows = verification.get("results", [])
    cosines = [r["sample_cosine"] if r.get("sample_cosine") is not None else r.get("cosine") for r in rows]
    cosines = [c for c in cosines if c is not None]
    costs = data.get("kernel_costs") or {}
    search = (costs.get("search") or {}).get("summary")
    return {
        "passed": bool(verification.get("passed")) and data.get("output") is not None,
        "worst_cosine": min(cosines) if cosines else None,
        "settings": {k: data["options"]["quantize"].get(k) for k in ("bits", "block_size", "accuracy_level")},
        "searched": data.get("auto") is not None,
        "seconds_by_phase": data.get("seconds_by_phase"),
        "output_bytes": data["files"]["output_bytes"],
        "search": search,
        "warnings": data.get("warnings", []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", type=Path, default=DEFAULT_ENCODER)
    parser.add_argument("--rounds", type=int, default=10, help="latency rounds (interleaved)")
    parser.add_argument("--skip-full", action="store_true", help="leave out --bench full (it takes long)")
    parser.add_argument(
        "--work", type=Path, default=None, help="scratch folder (default: beside the encoder)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.encoder.exists():
        raise SystemExit(
            f"missing {args.encoder}: python benchmarks/fastconformer.py encoder --size parakeet"
            " --positional-table 5000 --out PATH"
        )
    from onnx_conv2matmul.files.paths import model_file_bytes
    from onnx_conv2matmul.speed.timing import TimingOptions, time_models

    cpu, flags = cpu_flags()
    model_bytes = model_file_bytes(str(args.encoder))
    work = Path(tempfile.mkdtemp(prefix="bench-defaults-", dir=args.work or args.encoder.parent.parent))
    load_start = os.getloadavg()
    try:
        env = dict(os.environ, XDG_CACHE_HOME=str(work / "xdg"))
        outs = {name: work / name / "encoder-model.int4.onnx" for name in ("recipe", "cold", "warm", "full")}
        for out in outs.values():
            out.parent.mkdir()
        rewritten = work / "rewritten" / "encoder-model.onnx"
        rewritten.parent.mkdir()
        runs: dict[str, dict[str, Any]] = {}
        convert = run("recipe: rewrite", cli("convert", args.encoder, rewritten, "-q"), env)
        quantizer = run(
            "recipe: quantize", [sys.executable, "-c", RECIPE_SCRIPT, str(rewritten), str(outs["recipe"])]
        )
        runs["recipe"] = {
            "seconds": convert["seconds"] + quantizer["seconds"],
            "peak_rss_bytes": max(convert["peak_rss_bytes"], quantizer["peak_rss_bytes"]),
        }
        shutil.rmtree(rewritten.parent)
        reports = {}
        for name, extra in (("cold", []), ("warm", []), ("full", ["--bench", "full"])):
            if name == "full" and args.skip_full:
                continue
            reports[name] = work / f"{name}.json"
            command = cli("quantize", args.encoder, outs[name], "--report-json", reports[name], "-q", *extra)
            runs[name] = run(f"quantize {name}", command, env)
            runs[name].update(report_summary(reports[name]))
        timed = [
            name for name in ("recipe", "cold", "full") if name in runs and runs[name].get("passed", True)
        ]
        print(
            f"[latency] fp32 and {', '.join(timed)}: {args.rounds} interleaved rounds",
            file=sys.stderr,
            flush=True,
        )
        timing = time_models(
            [str(args.encoder), *(str(outs[name]) for name in timed)],
            TimingOptions(lengths=(200, 1000), rounds=args.rounds),
            labels=["fp32", *timed],
        )
        latency = {
            name: {lat.length: lat.ratio for lat in timing.models[1 + i].latencies}
            for i, name in enumerate(timed)
        }
        result = {
            "cpu": cpu,
            "flags": flags,
            "model_bytes": model_bytes,
            "runs": runs,
            "latency_x_fp32": latency,
            "load_average": [load_start, os.getloadavg()],
        }
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(result: dict[str, Any]) -> None:
    runs, latency, model = result["runs"], result["latency_x_fp32"], result["model_bytes"]
    recipe = runs["recipe"]["seconds"]
    print(f"CPU: {result['cpu']}; flags: {', '.join(result['flags']) or 'none of ' + ', '.join(FLAGS)}")
    print(f"model: {model / 2**20:.0f} MiB; load average at start/end: {result['load_average']}")
    print()
    print(
        "| run | wall x recipe | peak RSS x model | x fp32 at 200 | x fp32 at 1000 | floor met | settings |"
    )
    print("|---|---|---|---|---|---|---|")
    labels = {
        "recipe": "recipe (convert + MatMulNBitsQuantizer)",
        "cold": "`quantize` default, empty cache",
        "warm": "`quantize` default, warm cache",
        "full": "`quantize --bench full`",
    }
    for name in ("recipe", "cold", "warm", "full"):
        if name not in runs:
            continue
        r = runs[name]
        lat = latency.get("cold" if name == "warm" else name, {})
        settings = r.get("settings")
        text = (
            "4 bits, block 64, level 0"
            if name == "recipe"
            else (
                f"per node (search), level {settings['accuracy_level']}"
                if r.get("searched")
                else f"block {settings['block_size']}, level {settings['accuracy_level']}"
            )
        )
        floor = (
            "-"
            if name == "recipe"
            else ("yes" if r.get("passed") else "no")
            + (f" ({r['worst_cosine']:.4f})" if r.get("worst_cosine") is not None else "")
        )
        print(
            f"| {labels[name]} | {r['seconds'] / recipe:.2f} ({r['seconds']:.0f} s) |"
            f" {r['peak_rss_bytes'] / model:.2f} | {ratio(lat.get(200))} | {ratio(lat.get(1000))} |"
            f" {floor} | {text} |"
        )
    print()
    for name in ("cold", "warm", "full"):
        if name in runs:
            print(f"{name}: seconds by phase {runs[name].get('seconds_by_phase')}")
            if runs[name].get("search"):
                print(f"{name}: search: {runs[name]['search']}")
    checks = {
        "cold wall x recipe": runs["cold"]["seconds"] / recipe,
        "warm wall x recipe": runs["warm"]["seconds"] / recipe,
        "latency x fp32 at 200": latency.get("cold", {}).get(200),
        "latency x fp32 at 1000": latency.get("cold", {}).get(1000),
        "peak RSS x model": max(runs[n]["peak_rss_bytes"] for n in ("cold", "warm")) / model,
    }
    if "full" in latency and "cold" in latency:
        checks["x --bench full's best"] = max(latency["cold"][n] / latency["full"][n] for n in (200, 1000))
    print()
    for name, value in checks.items():
        goal = TARGETS[name]
        verdict = "n/a" if value is None else ("met" if value <= goal else "NOT met")
        shown = "-" if value is None else f"{value:.2f}"
        print(f"{name}: {shown} (target <= {goal:g}): {verdict}")


if __name__ == "__main__":
    main()
