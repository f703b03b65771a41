"""Benchmark the rewrite of the parakeet-size encoders against ``cp`` and the peer tool.

For each encoder export in the cache that ``fastconformer.py cache`` builds (dynamo: one
external data file; legacy: one file per tensor), this script times, side by side:

- ``cp`` of the model's files (after one untimed warm-up copy, so the page cache is warm),
- ``cp`` followed by ``sync`` of the copied files: the copy made as durable as our output,
  which is fsynced before it is renamed into place,
- our rewrite with the checker on and with ``--skip-checker``,
- the peer tool ``onnx-conv2matmul==0.1.1`` (installed into its own venv in the cache)
  with the same flags.

They run in rounds: each round runs every command once, each round starting one command
further than the one before, so a slow drift of the machine (page
cache, disk writeback, neighbours on a shared VM) hits them all alike; "x cp" is the median,
over rounds, of a run's time over the time of ``cp`` in the same round. Before every run the
disk cache is flushed (``sync``), so no run pays for the writeback of another. Every run is a child
process measured with ``os.wait4`` (wall time and the child's peak RSS) and writes into a fresh
directory on the cache's filesystem, removed after the run. The last output of each rewrite is
then checked (untimed) with ``onnx-conv2matmul verify``, and for our checker-on output the
onnxruntime latency (pairs in alternating order, sessions that do not spin: see ``_timing``)
and the Transpose count are compared with the original. Failures are
recorded in the tables, never raised; a command that fails is not run again.

Usage::

    python benchmarks/bench_rewrite.py [--cache DIR] [--repeat N] [--skip-peer] [--json FILE]

Sizes and RSS are in MB of 2**20 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from _process import run_measured
from _timing import interleaved_latency, ratio_interval, timed_session

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "onnx-conv2matmul-bench"
COMPLETE_MARKER = ".complete"  # written last by fastconformer.py cache
EXPORTS = ("encoder-dynamo", "encoder-legacy")
MODEL_FILENAME = "encoder-model.onnx"
PEER_PACKAGE = "onnx-conv2matmul"
PEER_VERSION = "0.1.1"
TOOL = "onnx-conv2matmul"
REWRITE_FLAGS = ("--extended-conv1x1", "--allow-non-unit-dilation", "--max-dilation", "4")
VERIFY_FLAGS = ("--verify-lengths", "200", "--verify-batch", "1")
LATENCY_FRAMES = 1000
LATENCY_FEATURES = 128
LATENCY_THREADS = 2
LATENCY_WARMUP = 2
LOAD_FAILURE = "onnxruntime cannot load the candidate model: "  # how verify reports one
MB = 1 << 20
# A message longer than this is cut in the tables (the JSON keeps it whole).
CELL_CHARS = 240


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Check:
    """Whether onnxruntime loads an output and agrees with the original."""

    loads: bool | None = None
    agrees: bool | None = None
    detail: str = ""


@dataclasses.dataclass
class RunResult:
    """One row of a table: a command repeated on the same input."""

    label: str
    command: list[str]
    walls_s: list[float] = dataclasses.field(default_factory=list)
    wall_s: float | None = None  # median of walls_s
    peak_rss_kb: int = 0
    output_bytes: int = 0
    returncode: int | None = None
    status: str = "ok"
    check: Check | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclasses.dataclass
class Latency:
    """onnxruntime latency of the original and our rewritten encoder."""

    original_ms: float  # median
    rewritten_ms: float  # median
    ratio: float
    original_samples_ms: list[float]
    rewritten_samples_ms: list[float]
    ratio_low: float  # 95% bootstrap interval of the ratio of medians
    ratio_high: float


@dataclasses.dataclass
class ExportResult:
    """Everything measured on one export."""

    name: str
    model: str
    files: int
    input_bytes: int
    runs: list[RunResult] = dataclasses.field(default_factory=list)
    latency: Latency | None = None
    latency_error: str = ""
    transposes_original: int | None = None
    transposes_ours: int | None = None
    load_average: list[float] = dataclasses.field(default_factory=list)  # 1, 5, 15 min, at the end
    warning: str = ""


@dataclasses.dataclass
class Tool:
    """A rewrite tool: its name in the tables, its command prefix, or why it cannot run."""

    name: str
    argv: list[str]
    unavailable: str = ""


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph of its nodes' attributes, at any depth."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_graphs(sub)


def iter_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and tensor attributes of ``graph`` and its subgraphs."""
    for sub in iter_graphs(graph):
        yield from sub.initializer
        for node in sub.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def model_files(path: Path) -> list[Path]:
    """The ``.onnx`` file and its external data files, relative to its directory."""
    model = onnx.load(path, load_external_data=False)
    locations = {
        entry.value
        for tensor in iter_tensors(model.graph)
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return [Path(path.name), *sorted(Path(location) for location in locations)]


def count_ops(path: Path, op_type: str) -> int:
    """Nodes of ``op_type`` in every graph of the model (weights are not read)."""
    model = onnx.load(path, load_external_data=False)
    return sum(node.op_type == op_type for graph in iter_graphs(model.graph) for node in graph.node)


def tree_bytes(directory: Path) -> int:
    """Size of every file under ``directory``."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


# --------------------------------------------------------------------------- #
# Measured child processes
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class ChildRun:
    """Wall time, peak RSS and outcome of one child process."""

    wall_s: float
    peak_rss_kb: int
    returncode: int
    message: str


def failure_line(output: str) -> str:
    """The line that says why a command failed: its ``error:`` line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1]


def run_child(argv: Sequence[str], cwd: Path | None = None) -> ChildRun:
    """Run ``argv`` to completion, forked from a small launcher (``_process``: its peak RSS is
    its own, not this script's); its output only explains a failure."""
    with tempfile.TemporaryFile() as log:
        usage = run_measured(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        message = ""
        if usage.returncode < 0:
            message = f"killed by {signal.Signals(-usage.returncode).name}"
        elif usage.returncode > 0:
            log.seek(0)
            message = failure_line(log.read().decode(errors="replace"))
    return ChildRun(usage.seconds, usage.ru_maxrss, usage.returncode, message)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# Checks of an output
# --------------------------------------------------------------------------- #


def verify_output(ours: Path, original: Path, candidate: Path, work_dir: Path) -> Check:
    """Run ``onnx-conv2matmul verify`` (exit 0: agree, 1: differ or does not load, 2: bad input)."""
    report_path = work_dir / "verify-report.json"
    argv = [str(ours), "verify", str(original), str(candidate), *VERIFY_FLAGS, "-q"]
    child = run_child([*argv, "--report-json", str(report_path)])
    failures = []
    if report_path.exists():
        failures = json.loads(report_path.read_text())["verification"]["failures"]
        report_path.unlink()
    if child.returncode == 0:
        return Check(loads=True, agrees=True)
    if child.returncode != 1 or not failures:
        return Check(detail=f"verify exit {child.returncode}: {child.message}")
    first = failures[0]
    note = first["note"].replace(f"{candidate.parent}{os.sep}", "")
    if note.startswith(LOAD_FAILURE):
        return Check(loads=False, detail=f"does not load: {note.removeprefix(LOAD_FAILURE)}")
    detail = note or (
        f"{first['output']} at length {first['length']}:"
        f" max_abs {first['max_abs']:.3g}, mean_abs {first['mean_abs']:.3g}"
    )
    return Check(loads=True, agrees=False, detail=detail)


def measure_latency(original: Path, rewritten: Path, runs: int) -> Latency:
    """Median latency of both models, run alternately on the same input (B=1, T=1000)."""
    sessions = [timed_session(original, LATENCY_THREADS), timed_session(rewritten, LATENCY_THREADS)]
    try:
        inputs = {arg.name: arg for arg in sessions[0].get_inputs()}
        features = inputs["audio_signal"].shape[1]
        if not isinstance(features, int):
            features = LATENCY_FEATURES
        feeds = {
            "audio_signal": np.random.default_rng(0).standard_normal(
                (1, features, LATENCY_FRAMES), dtype=np.float32
            ),
            "length": np.array([LATENCY_FRAMES], dtype=np.int64),
        }
        # Pairs in alternating order (AB BA ...): neither model always runs first.
        times = interleaved_latency(sessions, feeds, runs, warmup=LATENCY_WARMUP)
    finally:
        del sessions
        gc.collect()
    original_ms, rewritten_ms = (statistics.median(samples) for samples in times)
    low, high = ratio_interval(times[0], times[1])
    return Latency(
        original_ms,
        rewritten_ms,
        rewritten_ms / original_ms,
        original_samples_ms=times[0],
        rewritten_samples_ms=times[1],
        ratio_low=low,
        ratio_high=high,
    )


# --------------------------------------------------------------------------- #
# Benchmark of one export
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Contender:
    """One row to measure: a command run into a fresh directory each time."""

    result: RunResult
    argv_for: Callable[[Path], list[str]]
    cwd: Path | None = None
    inspect: Callable[[Path, RunResult], None] | None = None


def run_once(contender: Contender, attempt: int, repeat: int, work_dir: Path) -> None:
    """Run a contender once into a fresh directory, removed afterwards."""
    result = contender.result
    out_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work_dir))
    try:
        # Start from the same state every time: what earlier runs wrote (the peer writes
        # 2.6 GB) is flushed to disk first, so no run pays for another's writeback.
        os.sync()
        child = run_child(contender.argv_for(out_dir), contender.cwd)
        result.walls_s.append(child.wall_s)
        result.peak_rss_kb = max(result.peak_rss_kb, child.peak_rss_kb)
        result.output_bytes = tree_bytes(out_dir)
        result.returncode = child.returncode
        progress(
            f"  {result.label} [{attempt}/{repeat}]: {child.wall_s:.2f} s, "
            f"{child.peak_rss_kb / 1024:.0f} MB peak RSS, exit {child.returncode}"
        )
        if not result.ok:
            result.status = f"exit {child.returncode}: {child.message}"
        if contender.inspect is not None and (attempt == repeat or not result.ok):
            contender.inspect(out_dir, result)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def measure_rounds(contenders: list[Contender], repeat: int, work_dir: Path) -> None:
    """Run every contender once per round, ``repeat`` rounds, so slow drifts of the machine
    (page cache, writeback, neighbours) hit all of them alike. A failed contender is not
    run again."""
    for attempt in range(1, repeat + 1):
        # Each round starts one command further, so no command always runs right after the
        # same other one (whose output was just deleted, whose writeback was just flushed).
        shift = (attempt - 1) % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            if contender.result.returncode is None or contender.result.ok:
                run_once(contender, attempt, repeat, work_dir)
    for contender in contenders:
        if contender.result.walls_s:
            contender.result.wall_s = statistics.median(contender.result.walls_s)


def paired_ratio(run: RunResult, baseline: RunResult) -> float | None:
    """Median over rounds of this run's time over the baseline's time in the same round."""
    pairs = [w / b for w, b in zip(run.walls_s, baseline.walls_s, strict=False) if b > 0]
    return statistics.median(pairs) if pairs else None


def check_output(
    out_dir: Path,
    result: RunResult,
    *,
    export: ExportResult,
    ours: Path,
    work_dir: Path,
    latency_runs: int | None,
) -> None:
    """Verify a rewrite's output; with ``latency_runs``, also time it and count Transposes."""
    output = out_dir / MODEL_FILENAME
    if not result.ok or not output.exists():
        return
    original = Path(export.model)
    progress(f"  {result.label}: verify")
    result.check = verify_output(ours, original, output, work_dir)
    if latency_runs is None:
        return
    export.transposes_original = count_ops(original, "Transpose")
    export.transposes_ours = count_ops(output, "Transpose")
    progress(f"  {result.label}: latency")
    try:
        export.latency = measure_latency(original, output, latency_runs)
    except Exception as err:  # a failure is a result, not a crash
        export.latency_error = f"{type(err).__name__}: {failure_line(str(err))}"


def bench_export(
    name: str, model: Path, ours: Path, tools: list[Tool], args: argparse.Namespace, work_dir: Path
) -> ExportResult:
    """Time cp and every tool on ``model``; check the outputs."""
    marker = model.parent / COMPLETE_MARKER
    built = marker.stat().st_mtime_ns
    files = [str(file) for file in model_files(model)]
    export = ExportResult(
        name, str(model), len(files), sum((model.parent / file).stat().st_size for file in files)
    )
    progress(f"[{name}] {model}: {len(files)} files, {export.input_bytes / MB:,.0f} MB")

    def copy_argv(out_dir: Path) -> list[str]:
        return ["cp", "--parents", *files, str(out_dir)]

    warm_up = Contender(RunResult("cp (warm-up)", copy_argv(Path("OUT"))), copy_argv, model.parent)
    run_once(warm_up, 1, 1, work_dir)

    def durable_copy_argv(out_dir: Path) -> list[str]:
        # The same copy, then fsync of every copied file: what our tool guarantees on disk.
        script = 'out=$1; shift; cp --parents "$@" "$out" && cd "$out" && sync "$@"'
        return ["sh", "-c", script, "sh", str(out_dir), *files]

    contenders = [
        Contender(RunResult("cp", copy_argv(Path("OUT"))), copy_argv, model.parent),
        Contender(RunResult("cp + sync", durable_copy_argv(Path("OUT"))), durable_copy_argv, model.parent),
    ]
    rows = [c.result for c in contenders]  # table order; cp first
    for tool in tools:
        for skip_checker in (False, True):
            flags = [*REWRITE_FLAGS, *(["--skip-checker"] if skip_checker else [])]
            label = f"{tool.name} ({'--skip-checker' if skip_checker else 'checker'})"
            if tool.unavailable:
                rows.append(RunResult(label, [], status=f"not run: {tool.unavailable}"))
                continue

            def rewrite_argv(out_dir: Path, tool: Tool = tool, flags: list[str] = flags) -> list[str]:
                return [*tool.argv, str(model), str(out_dir / MODEL_FILENAME), *flags]

            inspect = functools.partial(
                check_output,
                export=export,
                ours=ours,
                work_dir=work_dir,
                latency_runs=args.latency_runs if tool.name == "ours" and not skip_checker else None,
            )
            contender = Contender(RunResult(label, rewrite_argv(Path("OUT"))), rewrite_argv, None, inspect)
            contenders.append(contender)
            rows.append(contender.result)
    measure_rounds(contenders, args.repeat, work_dir)
    export.runs.extend(rows)
    export.load_average = list(os.getloadavg())
    if not marker.exists() or marker.stat().st_mtime_ns != built:
        export.warning = "the export was rebuilt during the benchmark: these figures are not valid"
    return export


# --------------------------------------------------------------------------- #
# Setup
# --------------------------------------------------------------------------- #


def peer_tool(cache_dir: Path) -> tuple[Tool, str]:
    """Install the peer into its own venv in the cache (once); return it and its version."""
    venv = cache_dir / "peer-venv"
    python = venv / "bin" / "python"
    version_argv = [str(python), "-c", f"import importlib.metadata as m; print(m.version({PEER_PACKAGE!r}))"]

    def installed_version() -> str:
        if not python.exists():
            return ""
        found = subprocess.run(version_argv, capture_output=True, text=True, check=False)
        return found.stdout.strip()

    if installed_version() != PEER_VERSION:
        progress(f"installing {PEER_PACKAGE}=={PEER_VERSION} into {venv}")
        for argv in (
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "-q", f"{PEER_PACKAGE}=={PEER_VERSION}"],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                reason = f"cannot install the peer: {failure_line(done.stdout + done.stderr)}"
                return Tool("peer", [], unavailable=reason), "not installed"
    version = installed_version()
    if version != PEER_VERSION:
        reason = f"peer venv has {PEER_PACKAGE} {version or 'missing'}, not {PEER_VERSION}"
        return Tool("peer", [], unavailable=reason), version or "not installed"
    return Tool("peer", [str(venv / "bin" / TOOL)]), version


def machine_facts(peer: str) -> dict[str, str]:
    """CPU, RAM and the versions that matter."""
    cpu = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "CPUs": f"{os.cpu_count()} ({cpu})",
        "load average at the start": " ".join(f"{load:.2f}" for load in os.getloadavg()),
        "RAM": f"{ram / (1 << 30):.1f} GiB",
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "onnx-ir": importlib.metadata.version("onnx-ir"),
        "onnx-conv2matmul (ours)": importlib.metadata.version("onnx-conv2matmul"),
        "onnx-conv2matmul (peer)": peer,
    }


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


def yes_no(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "no")


def render_export(export: ExportResult) -> str:
    """The markdown table of one export and its latency line."""
    cp = export.runs[0]  # the first row is always cp
    lines = [
        f"### {export.name}: {export.input_bytes / MB:,.0f} MB in {export.files} files",
        "",
        "| run | wall s | x cp | peak RSS MB | output MB | x input size | loads in ORT "
        "| agrees with original | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for run in export.runs:
        status = run.status
        if run.check is not None and run.check.detail:
            status += f"; {run.check.detail}"
        check = run.check or Check()
        if run.wall_s is None:
            measured = ["—"] * 5
        else:
            measured = [
                f"{run.wall_s:.2f}",
                f"{ratio:.2f}" if (ratio := paired_ratio(run, cp)) is not None else "—",
                f"{run.peak_rss_kb / 1024:,.0f}",
                f"{run.output_bytes / MB:,.0f}",
                f"{run.output_bytes / export.input_bytes:.4f}",
            ]
        cells = [run.label, *measured, yes_no(check.loads), yes_no(check.agrees), cell(status)]
        lines.append(f"| {' | '.join(cells)} |")
    lines.append("")
    if export.warning:
        lines.append(f"**Warning: {export.warning}.**")
    lines.append(
        f"Load average (1, 5, 15 min) after the runs: {' '.join(f'{x:.2f}' for x in export.load_average)}."
    )
    if export.latency is not None:
        latency = export.latency
        lines.append(
            f"Latency (onnxruntime CPU, {LATENCY_THREADS} threads, B=1, T={LATENCY_FRAMES}, "
            f"median of {len(latency.original_samples_ms)}): original {latency.original_ms:.1f} ms, "
            f"ours {latency.rewritten_ms:.1f} ms, ratio {latency.ratio:.3f} "
            f"(95% bootstrap interval {latency.ratio_low:.3f}-{latency.ratio_high:.3f})."
        )
    else:
        lines.append(f"Latency: not measured ({cell(export.latency_error or 'our rewrite failed')}).")
    if export.transposes_original is not None:
        lines.append(
            f"Transpose nodes: original {export.transposes_original} → ours {export.transposes_ours}."
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help="cache of fastconformer.py (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds of timed runs (default: 3)")
    parser.add_argument(
        "--latency-runs", type=int, default=10, help="timed onnxruntime runs per model (default: 10)"
    )
    parser.add_argument("--skip-peer", action="store_true", help="do not benchmark the peer tool")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME=EXE",
        help="also time another build of this tool (its onnx-conv2matmul executable), e.g. an earlier "
        "commit installed in its own venv; repeatable",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.latency_runs < 1:
        parser.error("--repeat and --latency-runs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cache_dir: Path = args.cache.expanduser().resolve()
    models: dict[str, Path] = {}
    for name in EXPORTS:
        if (cache_dir / name / COMPLETE_MARKER).exists():
            models[name] = cache_dir / name / MODEL_FILENAME
        else:
            progress(f"[{name}] not in {cache_dir}: run `python benchmarks/fastconformer.py cache`")
    if not models:
        progress("error: no complete export in the cache")
        return 2

    ours = Path(sys.executable).with_name(TOOL)
    if not ours.exists():
        progress(
            f"error: {ours} not found: run this script with the Python of the venv where we are installed"
        )
        return 2
    tools = [Tool("ours", [str(ours), "convert"])]
    for item in args.also:
        name, _, exe = item.partition("=")
        if not name or not exe or not Path(exe).exists():
            progress(f"error: --also expects NAME=EXE with an existing executable, got {item!r}")
            return 2
        tools.append(Tool(name, [exe, "convert"]))
    peer_version = "skipped"
    if not args.skip_peer:
        peer, peer_version = peer_tool(cache_dir)
        tools.append(peer)

    facts = machine_facts(peer_version)
    print("## Machine\n")
    print("\n".join(f"- {key}: {value}" for key, value in facts.items()), flush=True)

    work_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=cache_dir))
    exports = []
    try:
        for name, model in models.items():
            export = bench_export(name, model, ours, tools, args, work_dir)
            exports.append(export)
            print(f"\n{render_export(export)}", flush=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    if args.json is not None:
        data: dict[str, Any] = {
            "machine": facts,
            "options": {
                "repeat": args.repeat,
                "latency_runs": args.latency_runs,
                "rewrite_flags": list(REWRITE_FLAGS),
                "verify_flags": list(VERIFY_FLAGS),
            },
            "exports": [dataclasses.asdict(export) for export in exports],
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
