"""The bench command's report: every model at every length against the baseline."""

from __future__ import annotations

from rich.console import Console, JustifyMethod
from rich.markup import escape

from onnx_conv2matmul.cli.render import human_bytes, latency_table, print_warnings, timing_title
from onnx_conv2matmul.speed.bench import BenchReport


def print_bench_report(console: Console, report: BenchReport) -> None:
    """The bench command's table: every model at every length against the baseline."""
    data = report.body()
    base = data["models"][data["baseline"]]["label"]
    title = timing_title("Latency", data["cpu"], data["lengths"], data["options"]).replace(
        "the original", escape(base)
    )
    rows = [
        (
            (escape(model["label"]), model["quantization"]["kind"], human_bytes(model["file_bytes"])),
            model["latencies"],
        )
        for model in data["models"]
    ]
    columns: tuple[tuple[str, JustifyMethod], ...] = (("model", "left"), ("kind", "left"), ("size", "right"))
    console.print(latency_table(title, data["lengths"]["used"], rows, columns))
    print_warnings(console, report.warnings)
