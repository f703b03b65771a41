"""The ``bundle`` command."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from onnx_conv2matmul import api
from onnx_conv2matmul.files.load import check_report_target

if TYPE_CHECKING:
    pass
from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    handled_errors,
    stderr_console,
)


@click.command("bundle")
@click.argument("directory", type=click.Path())
@click.option(
    "--manifest",
    type=click.Path(dir_okay=False),
    default=None,
    help=(
        "Write a JSON manifest: every file of every model with its size and sha256, and each"
        " model's quantization settings and accuracy from MODEL.report.json beside it."
    ),
)
@click.option("--report-json-stdout", is_flag=True, help="Print the sizes as JSON on stdout.")
def bundle_command(directory: str, manifest: str | None, report_json_stdout: bool) -> None:
    """List the models in DIRECTORY with their external data, sizes and the total."""
    OUTCOME.start(report_json_stdout, directory)
    with handled_errors():
        console = stderr_console(False)
        from onnx_conv2matmul.cli import render

        if manifest is not None:
            models = [os.path.join(directory, n) for n in _onnx_names(directory)]
            check_report_target(manifest, inputs=models, outputs=[])
            OUTCOME.watch(manifest)
        report = api.check_bundle(directory, manifest=manifest is not None)
        render.print_bundle_report(console, report)
        emit_report(report, manifest)


def _onnx_names(directory: str) -> list[str]:
    """The .onnx files in ``directory`` (none when it is not one: the command says so later)."""
    try:
        return [name for name in os.listdir(directory) if name.endswith(".onnx")]
    except OSError:
        return []
