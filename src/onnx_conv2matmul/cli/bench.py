"""The ``bench`` command: several models timed side by side on this CPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    handled_errors,
    quiet_onnxruntime,
    stderr_console,
)
from onnx_conv2matmul.cli.flags import bench_options, build_verify_options, report_options, verify_options
from onnx_conv2matmul.files.checks import check_input_path


@click.command("bench")
@click.argument("models", metavar="MODEL...", nargs=-1, required=True, type=click.Path())
@click.option(
    "--baseline",
    type=click.IntRange(min=1),
    default=1,
    help="The model the others are compared with, by position from 1 [default: 1, the first].",
)
@bench_options
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    help="Intra-op threads of every session; 0: onnxruntime's default (one per physical core).",
)
@verify_options
@report_options()
def bench_command(
    models: tuple[str, ...],
    baseline: int,
    bench_lengths: tuple[int, ...] | None,
    bench_rounds: int | None,
    threads: int,
    report_json: str | None,
    report_json_stdout: bool,
    quiet: bool,
    **verify_kwargs: Any,
) -> None:
    """Time MODEL... side by side on this CPU (batch 1), against the first or --baseline.

    fp32 against int4 against int8 at a glance: each model's median latency at each length,
    its quartiles and its ratio to the baseline, with a warning where a quantized model is
    slower than a float baseline. Inputs are made as for verify (--verify-input, --verify-dim,
    ...); --verify-lengths and --verify-batch do not apply: --bench-lengths, batch 1.
    """
    OUTCOME.start(report_json_stdout, list(models), quiet=quiet)
    with handled_errors():
        quiet_onnxruntime()
        from onnx_conv2matmul import api
        from onnx_conv2matmul.cli.render.bench import print_bench_report
        from onnx_conv2matmul.errors import InputError
        from onnx_conv2matmul.speed.timing import DEFAULT_ROUNDS, TimingOptions

        console = stderr_console(quiet)
        # First: every error from here on ends in the report too.
        OUTCOME.claim_report(report_json, inputs=list(models), outputs=[])
        for path in models:
            check_input_path(path)
        if baseline > len(models):
            raise click.BadParameter(
                f"{baseline} is above the number of models ({len(models)})", param_hint="--baseline"
            )
        for name in ("verify_lengths", "verify_batch"):
            if verify_kwargs.get(name) not in (None, 1):
                flag = "--" + name.replace("_", "-")
                raise click.BadParameter("bench times batch 1 at --bench-lengths", param_hint=flag)
        synthesis = build_verify_options(
            {**verify_kwargs, "verify_lengths": None, "verify_batch": 1}, None, ()
        )
        try:
            options = TimingOptions(
                lengths=bench_lengths,
                rounds=DEFAULT_ROUNDS if bench_rounds is None else bench_rounds,
                threads=threads,
                synthesis=dataclasses.replace(synthesis, report_only=False),
            )
        except ValueError as err:
            raise InputError(str(err)) from err
        report = api.bench_models(models, baseline=baseline - 1, options=options)
        print_bench_report(console, report)
        emit_report(report, report_json)
