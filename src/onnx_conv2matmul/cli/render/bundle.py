"""The bundle command's reports: a folder's listing, and a bundle built (its files, each model's
quantization and accuracy, and how to load it)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from onnx_conv2matmul.bundle.report import BundleBuildReport
from onnx_conv2matmul.cli.render import human_bytes, print_warnings
from onnx_conv2matmul.quantize.report import BundleReport


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
    print_warnings(console, report.warnings)


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
