"""The default ``quantize`` (the one pass) against what a careful user does by hand, side by side.

The yardstick **Y** of a model is the recipe plus one check, each a process of its own:

* ``onnx-conv2matmul convert MODEL REWRITTEN`` (the plain rewrite);
* onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 64, asymmetric, level 0) on the
  rewritten model, saved with external data;
* ``onnx-conv2matmul verify MODEL RESULT`` with its defaults (its exit code is ignored: the
  recipe's result is not exact, the check's cost is what counts).

Then ``onnx-conv2matmul quantize MODEL OUT`` with no options, twice: **cold** (an empty
kernel-cost cache, its own ``XDG_CACHE_HOME``) and **warm** (the same cache again). With
``--before SRC`` (the ``src`` folder of another checkout, e.g. the commit before the one pass), the
same default command of that code runs too, warm, in the same round: its time and result size
beside this one's. Every command is
forked from a small launcher (``_process.run_measured``): wall time and the command's own peak RSS.
Disk written is the report's ``bytes_written`` (the result and the scratch files); the phases, the
candidates and the latency line are the report's too. Rounds rotate the order of the commands.

With ``--bundle DIR`` (a folder laid out as the fp32 Parakeet release, as ``fastconformer.py
release`` writes it), ``onnx-conv2matmul bundle DIR OUT`` with no options (cold) runs against the Y of
both files: the encoder's as above, and the decoder/joint's (onnxruntime's ``quantize_dynamic``,
then ``verify`` of the two).

Usage::

    nice -n 5 python benchmarks/bench_onepass.py [--model PATH]... [--rounds N] [--json PATH]
        [--before SRC] [--bundle DIR]

Without ``--model`` it reads the full-size Parakeet-shaped encoder that ``fastconformer.py cache``
keeps in ``~/.cache/onnx-conv2matmul-bench/encoder-dynamo-table/`` (the relative positional table
kept, as a NeMo export has it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _process import run_measured

DEFAULT_CACHE = Path.home() / ".cache" / "onnx-conv2matmul-bench"
DEFAULT_MODEL = DEFAULT_CACHE / "encoder-dynamo-table" / "encoder-model.onnx"
"""Where ``fastconformer.py cache`` puts the Parakeet-shaped encoder with its positional table."""
RECIPE = """
import sys
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
quantizer = MatMulNBitsQuantizer(sys.argv[1], bits=4, block_size=64, is_symmetric=False, accuracy_level=0)
quantizer.process()
quantizer.model.save_model_to_file(sys.argv[2], use_external_data_format=True)
"""
TARGETS = {"cold x Y": 1.5, "warm x Y": 1.2, "peak RSS x model": 1.2, "disk x result": 3.0}


def tool(*args: object) -> list[str]:
    exe = shutil.which("onnx-conv2matmul")
    head = [exe] if exe else [sys.executable, "-m", "onnx_conv2matmul"]
    return [*head, *(str(a) for a in args)]


def before_tool(src: Path, *args: object) -> tuple[list[str], dict[str, str]]:
    """The same command of the code in ``src`` (another checkout's package folder)."""
    return [sys.executable, "-m", "onnx_conv2matmul", *(str(a) for a in args)], {"PYTHONPATH": str(src)}


def files_bytes(model: Path) -> int:
    """The model's .onnx and the data files beside it that share its name."""
    return sum(p.stat().st_size for p in model.parent.iterdir() if p.name.startswith(model.name))


def run(name: str, argv: list[str], env: dict[str, str] | None = None, check: bool = True) -> dict[str, Any]:
    print(f"[{name}] {' '.join(argv[-3:])}", file=sys.stderr, flush=True)
    measured = run_measured(argv, env=env, stdout=subprocess_devnull(), stderr=subprocess_devnull())
    if check and measured.returncode != 0:
        raise SystemExit(f"[{name}] exited {measured.returncode}")
    return {"seconds": measured.seconds, "peak_bytes": measured.peak_bytes, "code": measured.returncode}


def subprocess_devnull() -> Any:
    import subprocess

    return subprocess.DEVNULL


def one_round(model: Path, work: Path, order: int, before: Path | None = None) -> dict[str, Any]:
    """Y's three commands and the default cold and warm, in an order that rotates by ``order``."""
    rewritten, recipe_out = work / "rewritten.onnx", work / "recipe.onnx"
    cache = work / "xdg"
    out = work / "out"
    out.mkdir(exist_ok=True)

    def yardstick() -> dict[str, Any]:
        for leftover in work.glob("rewritten.onnx*"):
            leftover.unlink()
        for leftover in work.glob("recipe.onnx*"):
            leftover.unlink()
        parts = {
            "convert": run("convert", tool(model, rewritten)),
            "recipe": run("recipe", [sys.executable, "-c", RECIPE, str(rewritten), str(recipe_out)]),
            "verify": run("verify", tool("verify", model, recipe_out), check=False),
        }
        return {"parts": parts, "seconds": sum(p["seconds"] for p in parts.values())}

    def default(kind: str) -> dict[str, Any]:
        if kind == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(exist_ok=True)
        report = work / f"{kind}.json"
        env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
        measured = run(kind, tool("quantize", model, out / "q.onnx", "--report-json", report), env=env)
        data = json.loads(report.read_text())
        measured["report"] = data
        return measured

    def earlier() -> dict[str, Any]:
        assert before is not None
        report = work / "before.json"
        argv, extra = before_tool(before, "quantize", model, out / "b.onnx", "--report-json", report)
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), **extra}
        measured = run("before", argv, env=env, check=False)
        measured["report"] = json.loads(report.read_text()) if report.exists() else None
        return measured

    steps = ["Y", "defaults", *(["before"] if before is not None else [])]
    steps = steps[order % len(steps) :] + steps[: order % len(steps)]
    found: dict[str, Any] = {}
    for step in steps:
        if step == "Y":
            found["Y"] = yardstick()
        elif step == "before":
            found["before"] = earlier()
        else:
            found["cold"] = default("cold")
            found["warm"] = default("warm")
    return found


DYNAMIC = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8)
"""


def bundle_round(release: Path, work: Path) -> dict[str, Any]:
    """The bundle command (cold) against the Y of its two models."""
    encoder = release / "encoder-model.onnx"
    decoder = release / "decoder_joint-model.onnx"
    rewritten, recipe_out, dynamic_out = work / "rw.onnx", work / "enc.q.onnx", work / "dec.int8.onnx"
    parts = {
        "encoder convert": run("convert", tool(encoder, rewritten)),
        "encoder recipe": run("recipe", [sys.executable, "-c", RECIPE, str(rewritten), str(recipe_out)]),
        "encoder verify": run("verify", tool("verify", encoder, recipe_out), check=False),
        "decoder int8 dynamic": run(
            "dynamic", [sys.executable, "-c", DYNAMIC, str(decoder), str(dynamic_out)]
        ),
        "decoder verify": run("verify", tool("verify", decoder, dynamic_out), check=False),
    }
    cache = work / "xdg-bundle"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    out = work / "bundle"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    measured = run("bundle", tool("bundle", release, out), env=env)
    y = sum(p["seconds"] for p in parts.values())
    size = sum(p.stat().st_size for p in out.iterdir() if p.suffix in (".onnx", ".data"))
    return {
        "Y_s": y,
        "Y_parts_s": {k: v["seconds"] for k, v in parts.items()},
        "bundle_s": measured["seconds"],
        "bundle x Y": measured["seconds"] / y,
        "peak_bytes": measured["peak_bytes"],
        "bundle_bytes": size,
        "load": os.getloadavg(),
    }


def summarise(model: Path, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    size = files_bytes(model)
    y = statistics.median(r["Y"]["seconds"] for r in rounds)
    cold = statistics.median(r["cold"]["seconds"] for r in rounds)
    warm = statistics.median(r["warm"]["seconds"] for r in rounds)
    peak = max(max(r["cold"]["peak_bytes"], r["warm"]["peak_bytes"]) for r in rounds)
    last = rounds[-1]["warm"]["report"]
    result_bytes = last["files"]["output_bytes"]
    written = max(r[k]["report"].get("bytes_written") or 0 for r in rounds for k in ("cold", "warm"))
    latency = last.get("latency") or {}
    ratios = {str(lat["length"]): lat["ratio"] for lat in latency.get("result", [])}
    return {
        "model": str(model),
        "model_bytes": size,
        "Y_s": y,
        "Y_parts_s": {k: v["seconds"] for k, v in rounds[-1]["Y"]["parts"].items()},
        "cold_s": cold,
        "warm_s": warm,
        "cold x Y": cold / y,
        "warm x Y": warm / y,
        "peak_bytes": peak,
        "peak RSS x model": peak / size,
        "result_bytes": result_bytes,
        "result x model": result_bytes / size,
        "bytes_written": written,
        "disk x result": written / result_bytes if result_bytes else None,
        "phases_cold": rounds[-1]["cold"]["report"]["seconds_by_phase"],
        "phases_warm": last["seconds_by_phase"],
        "candidates": [
            (c["candidate"], c["worst_cosine"], c["passed"])
            for c in (last.get("one_pass") or {}).get("candidates", [])
        ],
        "latency_ratio": ratios,
        "load": os.getloadavg(),
        "before": _before(rounds),
    }


def _before(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    runs = [r["before"] for r in rounds if "before" in r]
    if not runs:
        return None
    last = runs[-1]
    report = last["report"] or {}
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "peak_bytes": max(r["peak_bytes"] for r in runs),
        "code": last["code"],
        "result_bytes": (report.get("files") or {}).get("output_bytes"),
        "phases": report.get("seconds_by_phase"),
    }


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n{summary['model']} ({summary['model_bytes'] / 2**30:.2f} GiB), load {summary['load'][0]:.1f}")
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in summary["Y_parts_s"].items())
    print(f"  Y = {summary['Y_s']:.1f} s ({parts})")
    for key in ("cold", "warm"):
        ratio = summary[f"{key} x Y"]
        print(
            f"  default {key}: {summary[f'{key}_s']:.1f} s = {ratio:.2f}x Y (target {TARGETS[f'{key} x Y']}x)"
        )
    print(
        f"  peak RSS {summary['peak_bytes'] / 2**30:.2f} GiB = {summary['peak RSS x model']:.2f}x the model"
    )
    disk = summary["disk x result"]
    print(
        f"  result {summary['result_bytes'] / 2**20:.1f} MiB ({summary['result x model']:.3f}x), written"
        f" {summary['bytes_written'] / 2**20:.1f} MiB = {disk:.2f}x the result"
    )
    print(f"  phases cold: {summary['phases_cold']}")
    print(f"  phases warm: {summary['phases_warm']}")
    print(f"  candidates: {summary['candidates']}; latency x fp32: {summary['latency_ratio']}")
    before = summary["before"]
    if before is not None:
        size = before["result_bytes"]
        shown = (
            "nothing written"
            if not size
            else f"{size / 2**20:.1f} MiB ({size / summary['model_bytes']:.3f}x)"
        )
        print(
            f"  before (warm): {before['seconds']:.1f} s = {before['seconds'] / summary['Y_s']:.2f}x Y, exit"
            f" {before['code']}, result {shown}, peak {before['peak_bytes'] / 2**30:.2f} GiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, action="append")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--before", type=Path, help="another checkout's src folder: its default quantize too")
    parser.add_argument("--bundle", type=Path, help="a release folder: the bundle command against its Y")
    args = parser.parse_args()
    summaries: list[dict[str, Any]] = []
    if args.bundle is not None:
        with tempfile.TemporaryDirectory(prefix="bench-bundle-", dir=args.bundle.parent) as tmp:
            found = bundle_round(args.bundle, Path(tmp))
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in found["Y_parts_s"].items())
        print(f"\nbundle {args.bundle}, load {found['load'][0]:.1f}")
        print(f"  Y of both files = {found['Y_s']:.1f} s ({parts})")
        print(
            f"  bundle (cold): {found['bundle_s']:.1f} s = {found['bundle x Y']:.2f}x Y (target 1.5x), peak"
            f" {found['peak_bytes'] / 2**30:.2f} GiB, models {found['bundle_bytes'] / 2**20:.1f} MiB"
        )
        summaries.append({"bundle": str(args.bundle), **found})
    for model in args.model or ([] if args.bundle is not None else [DEFAULT_MODEL]):
        with tempfile.TemporaryDirectory(prefix="bench-onepass-", dir=model.parent.parent) as tmp:
            rounds = [one_round(model, Path(tmp), index, args.before) for index in range(args.rounds)]
        summary = summarise(model, rounds)
        print_table(summary)
        summaries.append(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")


if __name__ == "__main__":
    main()
