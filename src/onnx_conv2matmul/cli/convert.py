"""The ``convert`` and ``verify`` commands."""

from __future__ import annotations

import sys
from typing import Any

import click

from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    handled_errors,
    progress_for,
    quiet_onnxruntime,
    stderr_console,
)
from onnx_conv2matmul.cli.flags import (
    build_rewrite_options,
    build_verify_options,
    inputs_option,
    min_cosine_option,
    report_options,
    rewrite_options,
    skip_checker,
    verify_options,
)
from onnx_conv2matmul.files.checks import check_paths


@click.command("convert")
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=True))
@click.argument("output_path", metavar="[OUTPUT]", required=False, type=click.Path())
@click.option("--inplace", is_flag=True, help="Replace INPUT (atomically) instead of writing OUTPUT.")
@rewrite_options
@skip_checker
@click.option(
    "--verify",
    is_flag=True,
    help="Prove the output equal to the input in onnxruntime before writing it.",
)
@click.option(
    "--keep-on-failure",
    is_flag=True,
    help="When verification fails, keep the output in OUTPUT.verify-failed/.",
)
@verify_options
@report_options()
def convert_command(
    input_path: str,
    output_path: str | None,
    inplace: bool,
    skip_checker: bool,
    report_json: str | None,
    report_json_stdout: bool,
    verify: bool,
    keep_on_failure: bool,
    quiet: bool,
    **kwargs: Any,
) -> None:
    """Rewrite INPUT into OUTPUT (or INPUT itself with --inplace)."""
    from onnx_conv2matmul import api  # imported when a command runs: --help stays light

    # Off a terminal the console is made after the rewrite: importing rich would delay its start.
    OUTCOME.start(report_json_stdout, input_path, quiet=quiet)
    console = stderr_console(quiet) if sys.stderr.isatty() else None
    with handled_errors():
        # First: every error from here on ends in the report too.
        outputs = [] if inplace or output_path is None else [output_path]
        OUTCOME.claim_report(report_json, inputs=[input_path], outputs=outputs)
        options = build_rewrite_options(kwargs)
        verify_opts = build_verify_options(kwargs) if verify else None
        if verify:
            quiet_onnxruntime()
        output = check_paths(input_path, output_path, inplace=inplace)
        OUTCOME.watch(output, output + ".data", output + api.FAILED_SUFFIX)
        report = api.convert_file(
            input_path,
            None if inplace else output_path,
            options,
            inplace=inplace,
            run_checker=not skip_checker,
            verify=verify_opts,
            keep_on_failure=keep_on_failure,
            progress=progress_for(console, input_path, quiet) if console is not None else None,
        )
        from onnx_conv2matmul.cli.render.convert import print_convert_report

        print_convert_report(console or stderr_console(quiet), report)
        emit_report(report, report_json)
    sys.exit(report.return_code)


@click.command("verify")
@click.argument("original", type=click.Path())
@click.argument("candidate", type=click.Path())
@inputs_option
@verify_options
@click.option("--cosine", is_flag=True, help="Also print the cosine similarity per output.")
@min_cosine_option("Pass when every float output's cosine similarity is at least X (quantized models).")
@report_options(
    "Write the verification report to this file.",
    "Print the JSON report on stdout only.",
    "No tables on stderr.",
)
def verify_command(
    original: str,
    candidate: str,
    inputs: tuple[str, ...],
    cosine: bool,
    min_cosine: float | None,
    report_json: str | None,
    report_json_stdout: bool,
    quiet: bool,
    **verify_kwargs: Any,
) -> None:
    """Compare two models with the same inputs and outputs in onnxruntime."""
    from onnx_conv2matmul import api  # imported when a command runs: --help stays light

    OUTCOME.start(report_json_stdout, [original, candidate], quiet=quiet)
    with handled_errors():
        quiet_onnxruntime()
        console = stderr_console(quiet)
        from onnx_conv2matmul.cli.render.verify import print_verification

        # First: every error from here on ends in the report too.
        OUTCOME.claim_report(report_json, inputs=[original, candidate], outputs=[], read=inputs)
        options = build_verify_options(verify_kwargs, min_cosine, inputs)
        report = api.verify_files(original, candidate, options)
        print_verification(console, report.verification, cosine=cosine)
        emit_report(report, report_json)
    sys.exit(report.return_code)
