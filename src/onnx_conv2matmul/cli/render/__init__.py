"""Turn typed reports into terminal tables and JSON: the pieces every command's report uses
(sizes, JSON text, latency tables); one module per command's report beside this one.

Nothing here computes figures. This is the command line's view: it names its flags.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from onnx_conv2matmul.report import CommandReport


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def dump(data: Any) -> str:
    return json.dumps(data, indent=2)


def report_json(report: CommandReport, *, error: str | None = None) -> str:
    """A report as JSON text (see :meth:`CommandReport.to_dict` for ``error``)."""
    return dump(report.to_dict(error=error))


def print_warnings(console: Console, warnings: Iterable[str]) -> None:
    """One ``warning:`` line each, as quantize, bench and bundle print them."""
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)


def latency_cell(latency: dict[str, Any]) -> str:
    """``median ms (q1-q3)``, then the ratio to the baseline when there is one."""
    text = f"{latency['median_ms']:.1f} ms ({latency['q1_ms']:.1f}-{latency['q3_ms']:.1f})"
    if latency["ratio"] is not None:
        low, high = latency["ratio_interval"]
        text += f" {latency['ratio']:.2f}x [{low:.2f}-{high:.2f}]"
    return text


def timing_title(
    what: str, cpu: str, lengths: dict[str, Any], options: dict[str, Any], mode: str = "together"
) -> str:
    threads = options["threads"] or "onnxruntime's default"
    rounds = (
        f"{options['rounds']} rounds each, the original and the result timed apart (not interleaved)"
        if mode == "apart"
        else f"{options['rounds']} interleaved rounds"
    )
    return (
        f"{what} on {cpu}: batch 1, {rounds}, threads {threads};"
        f" median (quartiles) and ratio to the original [95% interval]; lengths {lengths['rule']}"
    )


def latency_table(
    title: str,
    lengths: Sequence[int],
    rows: Iterable[tuple[Sequence[str], Sequence[dict[str, Any]]]],
    columns: Sequence[tuple[str, JustifyMethod]] = (("model", "left"),),
) -> Table:
    """The latency rows of quantize's and bench's reports: ``columns`` (name, justification) lead,
    then one column per length; each row is its leading cells and its latency at each length."""
    table = Table(title=title, title_justify="left")
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for length in lengths:
        table.add_column(f"length {length}", justify="right")
    for cells, latencies in rows:
        table.add_row(*cells, *(latency_cell(lat) for lat in latencies))
    return table
