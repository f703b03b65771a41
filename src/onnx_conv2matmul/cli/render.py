"""Turn typed reports (``report.py``, ``verify.py``) into terminal tables and JSON.

Nothing here computes figures. This is the command line's view: it names its flags.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onnx_conv2matmul.bundle.report import BundleBuildReport
from onnx_conv2matmul.quantize.report import BundleReport, InspectNode, InspectReport, QuantizeReport
from onnx_conv2matmul.report import CommandReport
from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvertReport
from onnx_conv2matmul.speed.bench import BenchReport
from onnx_conv2matmul.verify.check import Criterion, OutputComparison, VerifyReport
from onnx_conv2matmul.verify.options import format_size
from onnx_conv2matmul.verify.plan import held as plan_held

MAX_SKIPPED_ROWS = 25


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def summary_table(report: ConvertReport) -> Table:
    table = Table(title="Pointwise Conv and Gemm -> MatMul", title_justify="left")
    table.add_column("status / reason")
    table.add_column("nodes", justify="right")
    table.add_column("weight params", justify="right")
    table.add_column("weight bytes", justify="right")
    table.add_row(
        "[green]converted[/green]",
        str(len(report.converted)),
        f"{report.converted_params:,}",
        human_bytes(report.converted_weight_bytes),
    )
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for entry in report.skipped:
        key = entry.reason.value if entry.reason is not None else "?"
        groups[key][0] += 1
        groups[key][1] += entry.params
        groups[key][2] += entry.weight_bytes
    for reason, (count, params, nbytes) in sorted(groups.items()):
        table.add_row(
            f"[yellow]skipped[/yellow]: {reason} ({SkipReason(reason).description})",
            str(count),
            f"{params:,}",
            human_bytes(nbytes),
        )
    return table


def op_type_table(report: ConvertReport) -> Table | None:
    """Nodes and conversions per op type (Conv, Gemm, ...), when there are several op types."""
    counts = report.op_type_counts
    if len(counts) < 2:
        return None
    table = Table(title="By op type", title_justify="left")
    for column in ("op type", "nodes", "converted", "skipped"):
        table.add_column(column, justify="left" if column == "op type" else "right")
    for op_type, count in counts.items():
        nodes, converted = count["nodes"], count["converted"]
        table.add_row(op_type, str(nodes), str(converted), str(nodes - converted))
    return table


def skipped_table(report: ConvertReport) -> Table | None:
    interesting = [e for e in report.skipped if e.reason is not SkipReason.KERNEL_NOT_POINTWISE]
    if not interesting:
        return None
    table = Table(title="Pointwise candidates left untouched", title_justify="left")
    for column in ("node", "scope", "reason", "detail"):
        table.add_column(column)
    for entry in interesting[:MAX_SKIPPED_ROWS]:
        table.add_row(
            entry.name or "(unnamed)",
            entry.scope or "main",
            entry.reason.value if entry.reason else "",
            entry.detail,
        )
    if len(interesting) > MAX_SKIPPED_ROWS:
        table.caption = f"... and {len(interesting) - MAX_SKIPPED_ROWS} more in the JSON report"
    return table


def print_convert_report(console: Console, report: ConvertReport) -> None:
    console.print(summary_table(report))
    by_op_type = op_type_table(report)
    if by_op_type is not None:
        console.print(by_op_type)
    skipped = skipped_table(report)
    if skipped is not None:
        console.print(skipped)
    lines: list[str] = [
        f"Transpose nodes: {report.transposes_before} -> {report.transposes_after}"
        f" ({report.transposes_cancelled} cancelled), nodes: {report.nodes_before} -> {report.nodes_after}",
    ]
    failed = report.verification_passed is False
    if failed:
        lines.append(
            f"Verification failed: output kept for inspection at {report.output_path}"
            if report.output_path
            else "Verification failed: nothing was written."
        )
    elif report.output_path is not None:
        lines.append(
            f"Wrote {report.output_path} ({human_bytes(report.output_bytes)};"
            f" input {human_bytes(report.input_bytes)};"
            f" external data: {'yes' if report.external_data else 'no'};"
            f" checker: {report.checker})"
        )
    if report.timings:
        lines.append("Time: " + ", ".join(f"{k} {v:.2f}s" for k, v in report.timings.items()))
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    if report.verification is not None:
        print_verification(console, report.verification)


def dump(data: Any) -> str:
    return json.dumps(data, indent=2)


def report_json(report: CommandReport, *, error: str | None = None) -> str:
    """A report as JSON text (see :meth:`CommandReport.to_dict` for ``error``)."""
    return dump(report.to_dict(error=error))


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    return f"{value:.3g}"


def _shape_text(result: OutputComparison) -> str:
    """A tensor's shape as 2x3x5; a sequence output as its number of tensors."""
    if result.dtype.startswith("sequence"):
        count = result.shape[0] if result.shape else "?"
        return f"sequence of {count}"
    return "x".join(map(str, result.shape))


def verification_table(verification: VerifyReport, *, cosine: bool = False) -> Table:
    options = verification.options
    criterion = options.criterion
    if criterion is Criterion.REPORT_ONLY:
        title = "Accuracy against the original (measured only: no criterion on the cosine)"
        cosine = True
    elif criterion is Criterion.MIN_COSINE:
        title = f"Verification: cosine >= {options.min_cosine} for every sample"
        cosine = True
    else:
        title = f"Verification: scaled max_abs <= {options.max_abs:g}, mean_abs <= {options.mean_abs:g}"
    table = Table(title=title, title_justify="left")
    columns = ["length", "output", "shape", "max |ref|", "max_abs", "mean_abs", "rel_err"]
    samples = any(r.sample_cosine is not None for r in verification.results)
    if cosine:
        columns.append("cosine")
        if samples:
            columns.append("worst sample")
    columns.append("result")
    for column in columns:
        table.add_column(column, justify="left" if column in ("output", "shape", "result") else "right")
    for r in verification.results:
        row = [
            str(r.length),
            r.output,
            _shape_text(r),
            _fmt(r.max_ref),
            _fmt(r.max_abs),
            _fmt(r.mean_abs),
            _fmt(r.rel_err),
        ]
        if cosine:
            row.append("-" if r.cosine is None else f"{r.cosine:.6f}")
            if samples:
                worst = "-" if r.sample_cosine is None else f"{r.sample_cosine:.6f} of {r.samples}"
                row.append(worst)
        row.append(_verdict(r, criterion))
        table.add_row(*row)
    return table


def _verdict(row: OutputComparison, criterion: Criterion) -> str:
    """``ok`` where a criterion was checked and met, ``measured`` where a float output was only
    measured (integer outputs always must match), else FAIL with the note."""
    if not row.passed:
        return f"[red]FAIL[/red] {escape(row.note)}"
    if criterion is Criterion.REPORT_ONLY and row.cosine is not None:
        return "measured"
    return "[green]ok[/green]"


def _lengths_lines(verification: VerifyReport) -> list[str]:
    """Which lengths were used and why, each dim's values in the runs, the lengths not run."""
    if not verification.lengths:
        return []
    takes = any(dim.role.value == "sequence" for dim in verification.dims) or verification.options.feeds
    lengths = dict.fromkeys(verification.lengths)  # the chunks of one inputs file share its number
    used = ", ".join(map(str, lengths)) if takes or not verification.dims else "none"
    lines = [f"Lengths: {used} ({verification.lengths_rule})"]
    if verification.options.found:
        found = "; ".join(f"{f.what} = {f.value} ({f.how})" for f in verification.options.found)
        lines.append(f"Found before the check: {found}")
    if verification.dims and verification.runs:
        parts = []
        for dim in verification.dims:
            values = [run.dims[dim.key] for run in verification.runs if dim.key in run.dims]
            fed = ", ".join(str(v) for v in dict.fromkeys(values)) or "-"
            parts.append(f"{dim.key} {dim.role.value} {fed}")
        held = plan_held(verification.runs)
        lines.append(
            f"Dims fed: {'; '.join(parts)} (memory: about {format_size(held)} of tensors at once,"
            f" budget {format_size(verification.options.memory)})"
        )
    not_run = verification.lengths_not_run
    if not_run:
        skipped = ", ".join(str(length) for length, _ in not_run)
        lines.append(
            f"Not run at {skipped}; other lengths took their place where there were any"
            f" (at {not_run[0][0]}: {not_run[0][1]})"
        )
    return lines


def print_verification(console: Console, verification: VerifyReport, *, cosine: bool = False) -> None:
    console.print(verification_table(verification, cosine=cosine))
    files = verification.input_files
    if files:
        for number, item in enumerate(files, 1):
            shapes = ", ".join(
                f"{name} {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in item["shapes"].items()
            )
            console.print(
                f"Inputs {number}: {escape(item['file'])} ({shapes})", highlight=False, soft_wrap=True
            )
    else:
        inputs = ", ".join(f"{k}: {v}" for k, v in verification.inputs.items())
        if inputs:
            console.print(f"Inputs: {inputs}", highlight=False, soft_wrap=True)
    for line in _lengths_lines(verification):
        console.print(line, highlight=False, soft_wrap=True)
    for warning in verification.warnings:
        console.print(f"[yellow]Warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)
    if verification.options.criterion is Criterion.REPORT_ONLY:
        console.print("Cosine measured only; --min-cosine makes it a pass/fail criterion.")
    elif verification.passed:
        count = len(verification.warnings)
        more = f", with {count} warning{'s' if count > 1 else ''} above" if count else ""
        console.print(f"[bold green]Verification PASSED[/bold green]{more}")
    else:
        worst = verification.failures[0] if verification.failures else None
        if worst is not None:
            console.print(
                f"First failure: output {worst.output!r} at length {worst.length}:"
                f" max_abs {_fmt(worst.max_abs)}, mean_abs {_fmt(worst.mean_abs)},"
                f" rel_err {_fmt(worst.rel_err)} {escape(worst.note)}",
                highlight=False,
                soft_wrap=True,
            )
        console.print("[bold red]Verification FAILED[/bold red]")


def print_transpose_trade(console: Console, trade: dict[str, Any]) -> None:
    """The pointwise convs whose rewrite adds Transposes: both models and the one kept."""
    table = Table(
        title=(
            f"{trade['convs']} pointwise convs add Transposes when rewritten; they hold"
            f" {trade['weight_share']:.0%} of the weights"
        ),
        title_justify="left",
    )
    for column in ("model", "size", "latency x original", "meets the criterion", "kept"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in trade["models"]:
        ratios = model["latency_ratios"]
        latency = "not timed" if ratios is None else " / ".join(f"{r:.2f}" for r in ratios)
        size = "-" if model["size_ratio"] is None else f"{model['size_ratio']:.3f}x"
        kept = "yes" if model["name"] == trade["kept"] else ""
        table.add_row(model["name"], size, latency, "yes" if model["meets_criterion"] else "no", kept)
    console.print(table)
    console.print(f"Kept: {escape(trade['reason'])}", highlight=False, soft_wrap=True)


def print_quantize_report(console: Console, report: QuantizeReport) -> None:
    """The quantize command's summary; its first line says why nothing was quantized, if so."""
    if report.unchanged is not None:
        console.print(f"[bold yellow]{escape(report.unchanged.message)}[/bold yellow]", soft_wrap=True)
    table = Table(title=f"Quantize ({report.mode})", title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    rewrite = report.rewrite
    by_op_type = rewrite.get("by_op_type") or {}
    if "Gemm" in by_op_type:
        for op_type, count in by_op_type.items():
            table.add_row(f"{op_type} rewritten", f"{count['converted']} of {count['nodes']}")
    else:
        converted, convs = rewrite.get("converted", 0), rewrite.get("convs", 0)
        table.add_row("pointwise convs rewritten", f"{converted} of {convs}")
    if report.mode == "matmul_nbits":
        table.add_row("MatMul -> MatMulNBits", f"{report.quantized_nodes} of {report.matmuls}")
        if report.excluded:
            table.add_row("left in float by the settings", str(len(report.excluded)))
        for setting, count in _setting_counts(report).items():
            table.add_row(f"  {setting}", str(count))
        before, after = report.weights_without_rewrite, report.weights_with_rewrite
        if before and after:
            table.add_row("quantizable weight share without the rewrite", f"{before.share:.1%}")
            table.add_row("quantizable weight share with the rewrite", f"{after.share:.1%}")
    else:
        table.add_row("int8 dynamic nodes", str(report.quantized_nodes))
    if report.other_weights is not None:
        others = report.other_weights
        table.add_row(
            "other weights stored as int8",
            f"{len(others.stored)} ({human_bytes(others.saved_bytes)} saved; {len(others.kept)} kept)",
        )
    if report.auto is not None:
        found = report.auto
        if found.min_cosine is not None and found.reached_cosine is not None:
            table.add_row(
                "search: minimum cosine asked / reached", f"{found.min_cosine:g} / {found.reached_cosine:.5f}"
            )
        if found.metric is not None and found.original_score is not None and found.reached_score is not None:
            table.add_row(
                f"search: score of {found.metric.label}, original / reached",
                f"{found.original_score:.6g} / {found.reached_score:.6g}"
                f" (max drop {found.metric.max_drop_text})",
            )
        for label, count in found.config.counts().items():
            table.add_row(f"search: {label}", str(count))
        table.add_row(
            "search: full-model evaluations, time",
            f"{len(found.evaluations)}, {found.seconds:.1f} s"
            f" (sensitivity {found.sensitivity_seconds:.1f} s)",
        )
    table.add_row("size before", human_bytes(report.input_bytes))
    ratio = f" ({report.ratio:.3f}x)" if report.ratio else ""
    table.add_row("size after", human_bytes(report.output_bytes) + ratio)
    table.add_row("time", f"{report.seconds:.1f} s")
    if report.seconds_by_phase:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in report.seconds_by_phase.items())
        table.add_row("time by phase", parts)
    table.add_row("peak memory (RSS) until saved", human_bytes(report.peak_rss_quantize_bytes))
    table.add_row("peak memory (RSS) with the accuracy check", human_bytes(report.peak_rss_bytes))
    console.print(table)
    if report.transposes is not None:
        print_transpose_trade(console, report.transposes.to_dict())
    if report.kernel_plan is not None:
        costs = report.kernel_plan.to_dict()
        console.print(
            f"Kernel choice from per-shape costs ({costs['measured']} kernel timings,"
            f" {costs['from_cache']} from the cache): {escape(costs['reason'])}",
            highlight=False,
            soft_wrap=True,
        )
        if costs["search"] is not None:
            console.print(f"Search: {escape(costs['search']['summary'])}", highlight=False, soft_wrap=True)
    if report.kernel_choice is not None:
        console.print(kernel_choice_table(report.kernel_choice))
        console.print(f"Chosen: {escape(report.kernel_choice['reason'])}", highlight=False, soft_wrap=True)
    if report.latency is not None:
        console.print(quantize_latency_table(report.latency))
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)
    verification = report.verification
    if verification is not None:
        print_verification(console, verification, cosine=True)
    for line in _accuracy_lines(report):
        console.print(line, highlight=False, soft_wrap=True)
    failure = quantize_failure(report)
    if report.output_path:
        console.print(f"Wrote {report.output_path}", highlight=False, soft_wrap=True)
    elif failure is not None:
        console.print(escape(failure[0].upper() + failure[1:]) + ".", highlight=False, soft_wrap=True)
    else:
        console.print("Outputs that must match differ: nothing was written.", highlight=False)


def _latency_cell(latency: dict[str, Any]) -> str:
    """``median ms (q1-q3)``, then the ratio to the baseline when there is one."""
    text = f"{latency['median_ms']:.1f} ms ({latency['q1_ms']:.1f}-{latency['q3_ms']:.1f})"
    if latency["ratio"] is not None:
        low, high = latency["ratio_interval"]
        text += f" {latency['ratio']:.2f}x [{low:.2f}-{high:.2f}]"
    return text


def _timing_title(what: str, cpu: str, lengths: dict[str, Any], options: dict[str, Any]) -> str:
    threads = options["threads"] or "onnxruntime's default"
    return (
        f"{what} on {cpu}: batch 1, {options['rounds']} interleaved rounds, threads {threads};"
        f" median (quartiles) and ratio to the original [95% interval]; lengths {lengths['rule']}"
    )


def quantize_latency_table(latency: dict[str, Any]) -> Table:
    """The result against the original, one column per length."""
    table = Table(
        title=_timing_title("Latency", latency["cpu"], latency["lengths"], latency["options"]),
        title_justify="left",
    )
    table.add_column("model")
    for length in latency["lengths"]["used"]:
        table.add_column(f"length {length}", justify="right")
    for label in ("original", "result"):
        table.add_row(label, *(_latency_cell(lat) for lat in latency[label]))
    return table


def kernel_choice_table(choice: dict[str, Any]) -> Table:
    """The kernel settings tried: accuracy, whether it met the target, latency ratios."""
    original = choice["original"]
    lengths = [lat["length"] for lat in original["latencies"]] if original else []
    table = Table(
        title=f"Kernel settings tried on {choice['cpu']} ({choice['target']})", title_justify="left"
    )
    for name in ("candidate", "cosine", "meets target", *(f"x original at {n}" for n in lengths), "speed"):
        table.add_column(name, justify="left" if name == "candidate" else "right")
    for candidate in choice["candidates"]:
        ratios = {lat["length"]: lat["ratio"] for lat in candidate["latencies"] or ()}
        mark = "[bold]" if candidate["name"] == choice["winner"] else ""
        table.add_row(
            f"{mark}{escape(candidate['name'])}",
            f"{candidate['cosine']:.5f}",
            "yes" if candidate["meets_target"] else "no",
            *(f"{ratios[n]:.2f}x" if ratios.get(n) is not None else "-" for n in lengths),
            "-" if candidate["speed"] is None else f"{candidate['speed']:.3f}x",
        )
    return table


def print_bench_report(console: Console, report: BenchReport) -> None:
    """The bench command's table: every model at every length against the baseline."""
    data = report.body()
    base = data["models"][data["baseline"]]["label"]
    title = _timing_title("Latency", data["cpu"], data["lengths"], data["options"]).replace(
        "the original", escape(base)
    )
    table = Table(title=title, title_justify="left")
    table.add_column("model")
    table.add_column("kind")
    table.add_column("size", justify="right")
    for length in data["lengths"]["used"]:
        table.add_column(f"length {length}", justify="right")
    for model in data["models"]:
        table.add_row(
            escape(model["label"]),
            model["quantization"]["kind"],
            human_bytes(model["file_bytes"]),
            *(_latency_cell(lat) for lat in model["latencies"]),
        )
    console.print(table)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)


def quantize_failure(report: QuantizeReport) -> str | None:
    """The report's failure: the criterion missed, and what can help."""
    verification = report.verification
    if report.passed or verification is None:
        return None
    metric = report.accuracy.get("metric") or {}
    if metric.get("passed") is False:
        return (
            f"the score of --validate {metric['function']} dropped from {metric['original_score']:.6g}"
            f" to {metric['score']:.6g}, more than --max-drop {metric['max_drop']:g}"
            f"{' (relative)' if metric['relative'] else ''}; nothing was written"
            + ("" if report.auto is not None else " (--auto searches for settings that meet it)")
        )
    if verification.options.criterion is not Criterion.MIN_COSINE:
        return None
    worst = min((c for c in (r.worst_cosine for r in verification.results) if c is not None), default=None)
    floor = report.accuracy.get("min_cosine_source") == "default floor"
    measured = "" if worst is None else f" (worst sample {worst:.4f})"
    what = (
        f"the accuracy floor --min-cosine {verification.options.min_cosine:g}"
        if floor
        else (f"--min-cosine {verification.options.min_cosine:g}")
    )
    helps = []
    if report.mode == "matmul_nbits" and report.auto is None:
        helps.append("--auto searches for settings that meet it")
    if report.mode == "int8_dynamic":
        helps.append("MatMulNBits with --auto may meet it")
    if report.accuracy.get("inputs") == "synthesised":
        helps.append("--inputs checks on real inputs")
    if floor:
        helps.append("--min-cosine X sets another floor")
    return f"accuracy below {what}{measured}; nothing was written" + (
        f" ({'; '.join(helps)})" if helps else ""
    )


def _accuracy_lines(report: QuantizeReport) -> list[str]:
    """The criterion the output met (or missed), the user's score, and the synthetic-input caveat."""
    accuracy = report.accuracy
    lines = []
    if accuracy.get("min_cosine_source") == "default floor":
        lines.append(
            f"Criterion: the default accuracy floor, every sample's cosine >= {accuracy['min_cosine']:g}"
            " (--min-cosine sets another)."
        )
    metric = accuracy.get("metric")
    if metric and metric.get("score") is not None:
        verdict = "[green]ok[/green]" if metric.get("passed") else "[red]FAIL[/red]"
        relative = " (relative)" if metric["relative"] else ""
        lines.append(
            f"Score of {escape(metric['function'])}: {metric['original_score']:.6g} -> {metric['score']:.6g},"
            f" drop {metric['drop']:.4g}{relative}, at most {metric['max_drop']:g}: {verdict}"
        )
    if accuracy.get("inputs") == "synthesised":
        lines.append(
            "[yellow]note:[/yellow] measured on synthesised inputs, which can overstate accuracy"
            " (a trained model can do well on random inputs and badly on real ones): --inputs with"
            " real inputs, or --validate with your own measure, gives the true figure."
        )
    return lines


def _setting_counts(report: QuantizeReport) -> dict[str, int]:
    """How many MatMuls got each setting, when they did not all get the same."""
    counts: dict[str, int] = {}
    for setting in report.settings.values():
        kind = "symmetric" if setting.symmetric else "asymmetric"
        key = f"{setting.bits} bits, block {setting.block_size}, {kind}"
        counts[key] = counts.get(key, 0) + 1
    return counts if len(counts) > 1 else {}


def bundle_table(report: BundleReport) -> Table:
    table = Table(title=f"Bundle {report.directory}", title_justify="left")
    table.add_column("model")
    table.add_column("external data")
    table.add_column("size", justify="right")
    table.add_column("MB", justify="right")
    for model in report.models:
        data = model.external_data
        shown = ", ".join(data[:3]) + (f" (+{len(data) - 3} files)" if len(data) > 3 else "")
        table.add_row(model.name, shown or "-", human_bytes(model.size), f"{model.size / 1e6:.1f}")
    total = report.total_bytes
    table.add_row("[bold]total[/bold]", "", human_bytes(total), f"{total / 1e6:.1f}")
    return table


def print_bundle_report(console: Console, report: BundleReport) -> None:
    """The bundle's table, then its warnings."""
    console.print(bundle_table(report))
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)


def _ints_text(values: list[int] | None, sep: str = ",") -> str:
    return "-" if values is None else sep.join(map(str, values))


def _outcome_text(node: InspectNode) -> str:
    entry = node.entry
    if entry.reason is None:
        extra = f" (+{', '.join(entry.extra_ops)})" if entry.extra_ops else ""
        return f"[green]converted[/green]{extra}" + (f": {escape(entry.detail)}" if entry.detail else "")
    return f"[yellow]{entry.reason.value}[/yellow]" + (f": {escape(entry.detail)}" if entry.detail else "")


def inspect_nodes_table(report: InspectReport) -> Table:
    """Every node the rewrite looked at, with its attributes and what convert does to it."""
    table = Table(title="What convert would do", title_justify="left")
    for column in ("scope", "node", "op", "kernel", "group", "strides", "pads", "dilations", "weight"):
        table.add_column(column)
    table.add_column("bytes", justify="right")
    table.add_column("outcome")
    table.add_column("Transposes", justify="right")
    for node in report.nodes:
        entry = node.entry
        domain = f"{entry.domain}::" if entry.domain not in ("", "ai.onnx") else ""
        added = node.transposes_added
        table.add_row(
            escape(entry.scope or "main"),
            escape(entry.name or "(unnamed)"),
            escape(domain + entry.op_type),
            _ints_text(node.kernel, "x"),
            "-" if node.group is None else str(node.group),
            _ints_text(node.strides),
            _ints_text(node.pads),
            _ints_text(node.dilations),
            _ints_text(entry.weight_shape, "x")
            + (f" {entry.weight_dtype.lower()}" if entry.weight_dtype else ""),
            human_bytes(entry.weight_bytes) if entry.weight_shape is not None else "-",
            _outcome_text(node),
            "" if added is None else f"{added:+d}",
        )
    table.caption = "Transposes: what converting the node adds to the model (negative: removes)"
    return table


def projection_table(report: InspectReport) -> Table:
    """The share of float weights MatMulNBits could take, before and after the rewrite, and the
    projected size."""
    p = report.projection
    kind = "symmetric" if p.symmetric else "asymmetric"
    table = Table(
        title=f"MatMulNBits projection ({p.bits} bits, block {p.block_size}, {kind})", title_justify="left"
    )
    table.add_column("")
    table.add_column("MatMuls", justify="right")
    table.add_column("float weight bytes", justify="right")
    table.add_column("share", justify="right")
    before, after = p.weights_without_rewrite, p.weights_with_rewrite
    table.add_row("all float weights", "", human_bytes(before.total_bytes), "")
    for label, stats in (("quantizable as the model is", before), ("quantizable after the rewrite", after)):
        table.add_row(
            label, str(stats.quantizable_matmuls), human_bytes(stats.quantizable_bytes), f"{stats.share:.1%}"
        )
    ratio = p.projected_model_bytes / p.model_bytes if p.model_bytes else 0.0
    table.caption = (
        f"Model {human_bytes(p.model_bytes)} -> {human_bytes(p.projected_model_bytes)} ({ratio:.3f}x)"
        f" after the rewrite and MatMulNBits: quantized weights {human_bytes(p.packed_bytes)},"
        f" scales {human_bytes(p.scale_bytes)}, zero points {human_bytes(p.zero_point_bytes)}"
    )
    return table


def print_inspect_report(console: Console, report: InspectReport) -> None:
    """The inspect command's tables: every node, the summary, Transposes, the projection."""
    rewrite = report.rewrite
    if report.nodes:
        console.print(inspect_nodes_table(report))
    console.print(summary_table(rewrite))
    console.print(
        f"Transpose nodes: {rewrite.transposes_before} -> {rewrite.transposes_after}"
        f" ({rewrite.transposes_cancelled} cancelled),"
        f" nodes: {rewrite.nodes_before} -> {rewrite.nodes_after}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(projection_table(report))
    console.print("Nothing was written.", highlight=False)


def bundle_build_table(report: BundleBuildReport) -> Table:
    """One row per file of the bundle, each model's quantization and accuracy on its row, and the
    total against the release folder's."""
    title = f"Bundle {report.output_dir or '(not written)'} ({report.layout})"
    table = Table(title=title, title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("MB", justify="right")
    table.add_column("model")
    table.add_column("quantized", justify="right")
    table.add_column("min cosine", justify="right")
    models = {m.file: m for m in report.models}
    for file in report.files:
        model = models.get(file.path)
        if model is None:
            table.add_row(file.path, human_bytes(file.bytes), f"{file.bytes / 1e6:.1f}", "", "", "")
            continue
        mode = "int8 dynamic" if model.mode == "int8_dynamic" else "MatMulNBits"
        table.add_row(
            file.path,
            human_bytes(file.bytes),
            f"{file.bytes / 1e6:.1f}",
            model.role,
            mode,
            _cosine(model.min_cosine),
        )
    for model in report.models:
        if not model.passed:
            failed = "[bold red]failed[/bold red]"
            table.add_row(model.file, "-", "-", model.role, failed, _cosine(model.min_cosine))
    total, source = report.bundle_bytes, report.source_bytes
    ratio = f"{total / source:.3f}x the source ({human_bytes(source)})" if source else ""
    table.add_row("[bold]total[/bold]", human_bytes(total), f"{total / 1e6:.1f}", ratio, "", "")
    return table


def _cosine(value: float | None) -> str:
    return "-" if value is None else f"{value:.5f}"


def print_bundle_build_report(console: Console, report: BundleBuildReport) -> None:
    console.print(bundle_build_table(report))
    if report.split is not None:
        state = "equal" if report.split.passed else "[bold red]different[/bold red]"
        console.print(
            f"decoder + joiner against decoder_joint in onnxruntime: {state} (max abs diff"
            f" {report.split.max_abs_diff:.3g} on {len(report.split.shapes)} input shapes)"
        )
    if report.output_dir is None:
        return
    if report.onnx_asr_quantization is not None:
        console.print(
            f'onnx-asr: onnx_asr.load_model("nemo-parakeet-tdt-0.6b-v3", path="{report.output_dir}",'
            f' quantization="{report.onnx_asr_quantization}")'
        )
    else:
        roles = {m.role: m.file for m in report.models}
        console.print(
            "sherpa-onnx: OfflineRecognizer.from_transducer(encoder=..., decoder=..., joiner=...,"
            ' tokens=..., model_type="nemo_transducer"): '
            + ", ".join(f"{role} {roles[role]}" for role in ("encoder", "decoder", "joiner") if role in roles)
            + ", tokens tokens.txt"
        )
