"""The convert command's report: converted and skipped nodes, by op type, and the check."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.table import Table

from onnx_conv2matmul.cli.render import human_bytes
from onnx_conv2matmul.cli.render.verify import print_verification
from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvertReport

MAX_SKIPPED_ROWS = 25


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


def counts_line(report: ConvertReport) -> str:
    """The Transpose and node counts before and after the rewrite (convert's and inspect's)."""
    return (
        f"Transpose nodes: {report.transposes_before} -> {report.transposes_after}"
        f" ({report.transposes_cancelled} cancelled), nodes: {report.nodes_before} -> {report.nodes_after}"
    )


def print_convert_report(console: Console, report: ConvertReport) -> None:
    console.print(summary_table(report))
    by_op_type = op_type_table(report)
    if by_op_type is not None:
        console.print(by_op_type)
    skipped = skipped_table(report)
    if skipped is not None:
        console.print(skipped)
    lines = [counts_line(report)]
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
