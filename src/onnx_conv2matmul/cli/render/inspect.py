"""The inspect command's report: every node the rewrite looked at, the summary, the projection."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onnx_conv2matmul.cli.render import human_bytes
from onnx_conv2matmul.cli.render.convert import counts_line, summary_table
from onnx_conv2matmul.quantize.report import InspectNode, InspectReport


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
    console.print(counts_line(rewrite), highlight=False, soft_wrap=True)
    console.print(projection_table(report))
    if report.coverage is not None:
        from onnx_conv2matmul.quantize.inspection import coverage_text

        console.print(
            f"MatMulNBits could take, of the float weights: {coverage_text(report.coverage)}",
            highlight=False,
            soft_wrap=True,
        )
    console.print("Nothing was written.", highlight=False)
