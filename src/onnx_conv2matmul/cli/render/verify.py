"""The check's report (the verify command's, and the check inside convert and quantize): one row
per output and length, the inputs and lengths used, the verdict."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onnx_conv2matmul.verify.check import Criterion, OutputComparison, VerifyReport
from onnx_conv2matmul.verify.options import format_size
from onnx_conv2matmul.verify.plan import held as plan_held


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
    for result in verification.labels:
        mark = "[green]ok[/green]" if result.passed else "[red]FAIL[/red]"
        console.print(f"Labels {mark}: {escape(result.text())}", highlight=False, soft_wrap=True)
    if verification.options.criterion is Criterion.REPORT_ONLY:
        console.print("Cosine measured only; --min-cosine makes it a pass/fail criterion.")
    elif verification.passed:
        count = len(verification.warnings)
        more = f", with {count} warning{'s' if count > 1 else ''} above" if count else ""
        console.print(f"[bold green]Verification PASSED[/bold green]{more}")
    else:
        worst = verification.failures[0] if verification.failures else None
        moved = next((t for t in verification.labels if not t.passed), None)
        if worst is None and moved is not None:
            console.print(f"First failure: {escape(moved.text())}", highlight=False, soft_wrap=True)
        if worst is not None:
            console.print(
                f"First failure: output {worst.output!r} at length {worst.length}:"
                f" max_abs {_fmt(worst.max_abs)}, mean_abs {_fmt(worst.mean_abs)},"
                f" rel_err {_fmt(worst.rel_err)} {escape(worst.note)}",
                highlight=False,
                soft_wrap=True,
            )
        console.print("[bold red]Verification FAILED[/bold red]")
