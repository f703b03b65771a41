"""The ``inspect`` command."""

from __future__ import annotations

import sys
from typing import Any

import click

from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    handled_errors,
    stderr_console,
)
from onnx_conv2matmul.cli.flags import (
    build_rewrite_options,
    json_stdout_option,
    nbits_given,
    nbits_options,
    quiet_option,
    rewrite_options,
    skip_checker,
)


@click.command("inspect")
@click.argument("input_path", metavar="MODEL", type=click.Path())
@rewrite_options
@nbits_options
@skip_checker
@json_stdout_option("--json", help="Print the report as one JSON object on stdout and nothing else.")
@quiet_option("No tables on stderr.")
def inspect_command(
    input_path: str,
    bits: str | None,
    block_size: int | None,
    symmetric: bool | None,
    skip_checker: bool,
    report_json_stdout: bool,
    quiet: bool,
    **kwargs: Any,
) -> None:
    """Show what convert would do to MODEL, and its projected MatMulNBits size; write nothing.

    Takes convert's rewrite options; --bits, --block-size and --symmetric/--asymmetric are
    quantize's settings for the projection.
    """
    OUTCOME.start(report_json_stdout, input_path, quiet=quiet)
    with handled_errors():
        from onnx_conv2matmul import api
        from onnx_conv2matmul.quantize.options import resolve

        options = build_rewrite_options(kwargs)
        q_options = resolve(nbits_given(bits=bits, block_size=block_size, symmetric=symmetric)).quantize
        from onnx_conv2matmul.cli.render.inspect import print_inspect_report

        report = api.inspect_file(input_path, options, q_options, run_checker=not skip_checker)
        print_inspect_report(stderr_console(quiet), report)
        emit_report(report, None)
    sys.exit(report.return_code)
