"""Whether ``quantize`` gives the same result from one cold run to the next (issue 42, item 3).

A user who quantizes a model on a new machine, then again, should get the same model: a choice
made by timing must not flip with the noise of that timing. For each model, ``quantize MODEL
OUT`` with the options a user types (none, or ``--prefer size``) runs ``--runs`` times, each in its
own process with an empty cache folder, so the kernel costs are timed afresh every time, as on a
new machine. With ``--before DIR`` (the package folder of another checkout, e.g. one made with
``git worktree add /tmp/old <commit>``: ``/tmp/old/src``), that code runs the same commands, its
runs interleaved with this one's, so both meet the same machine.

Models: those of the registry set (``tests/real_packages.py``) whose size changed from one cold
run to the next (in ``bench_registry.py``'s runs or here): a small BERT (g2p-id), PP-OCR's
recognizers and detectors (PP-OCRv4 det's default and ``--prefer size``, whose target is at most
0.40x in each run), a document-layout YOLO, a VAD without control flow, DTLN's second stage and a
wake-word head.

Columns: the code, the model, the options, how many distinct results (size, and the settings
kept), the smallest and the largest size against the original, each run's size, the seconds.

    python benchmarks/bench_repeat.py [--runs 3] [--only NAME,...] [--before DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from _process import run_quiet
from bench_onepass import before_tool, tool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from model_cache import FETCHER  # noqa: E402
from real_packages import REGISTRY  # noqa: E402

CASES: list[tuple[str, tuple[str, ...]]] = [
    ("g2p-id BERT", ()),
    ("PP-OCRv4 rec", ()),
    ("PP-OCRv5 rec", ()),
    ("PP-OCRv4 det", ()),
    ("PP-OCRv4 det", ("--prefer", "size")),
    ("PP-OCRv5 det", ()),
    ("YOLOv8n DocLayNet", ()),
    ("silero VAD v6 ifless", ()),
    ("DTLN stage 2", ()),
    ("openWakeWord hey jarvis", ()),
]


def one_run(model: Path, options: tuple[str, ...], work: Path, before: Path | None) -> dict[str, Any]:
    """One cold ``quantize``: its exit code, seconds, size ratio and the settings it kept."""
    cache = work / "xdg"
    cache.mkdir()
    out, report_path = work / "q.onnx", work / "r.json"
    args = ("quantize", model, out, *options, "--report-json", report_path)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    if before is None:
        argv = tool(*args)
    else:
        argv, extra = before_tool(before, *args)
        env.update(extra)
    code, seconds, _peak, _stderr = run_quiet(argv, env)
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    quantize = (report.get("options") or {}).get("quantize") or {}
    settings = {
        "block_size": quantize.get("block_size"),
        "accuracy_level": quantize.get("accuracy_level"),
        "nodes": report.get("quantized_nodes"),
    }
    return {"code": code, "seconds": seconds, "ratio": (report.get("files") or {}).get("ratio"), **settings}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
    outcomes = {(r["code"], r["ratio"], r["nodes"]) for r in runs}
    return {
        "distinct": len(outcomes),
        "smallest": min(ratios) if ratios else None,
        "largest": max(ratios) if ratios else None,
    }


def _one(run: dict[str, Any]) -> str:
    if run["ratio"] is None:
        return f"exit {run['code']}"
    return f"{run['ratio']:.3f} ({run['seconds']:.0f} s, exit {run['code']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--before", type=Path, help="another checkout's package folder (its src/)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = CASES
    if args.only:
        wanted = set(args.only.split(","))
        cases = [case for case in CASES if case[0] in wanted]
    codes: list[tuple[str, Path | None]] = [("this", None)]
    if args.before is not None:
        codes.append(("before", args.before.resolve()))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-repeat-") as tmp:
        for name, options in cases:
            model = FETCHER.fetch(REGISTRY[name])
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in codes}
            for index in range(args.runs):
                for label, before in codes:  # interleaved: both meet the same machine
                    work = Path(tmp) / f"{len(rows)}-{label}-{index}"
                    work.mkdir()
                    print(
                        f"[{name} {' '.join(options)}] {label} run {index + 1}", file=sys.stderr, flush=True
                    )
                    runs[label].append(one_run(model, options, work, before))
            for label, _ in codes:
                rows.append({"code": label, "model": name, "options": " ".join(options), "runs": runs[label]})
                rows[-1].update(summary(runs[label]))
    head = f"{'code':<7} {'model':<24} {'options':<14} {'distinct':>8} {'smallest':>9} {'largest':>8}  runs"
    print(head)
    print("-" * len(head))
    for row in rows:
        each = ", ".join(
            f"{r['ratio']:.3f} ({r['seconds']:.0f} s, exit {r['code']})"
            if r["ratio"] is not None
            else f"exit {r['code']}"
            for r in row["runs"]
        )
        low = "-" if row["smallest"] is None else f"{row['smallest']:.3f}"
        high = "-" if row["largest"] is None else f"{row['largest']:.3f}"
        print(
            f"{row['code']:<7} {row['model']:<24} {row['options'] or '(none)':<14} {row['distinct']:>8}"
            f" {low:>9} {high:>8}  {each}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
