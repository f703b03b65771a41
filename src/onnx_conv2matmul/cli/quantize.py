"""The ``quantize`` command: flags mapped to quantize options, the report rendered."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files.checks import check_input_path, check_not_read, check_report_target
from onnx_conv2matmul.quantize.weight_only import ALGORITHMS
from onnx_conv2matmul.rewrite.options import ConvertOptions

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.report import QuantizeReport
from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    files_read,
    handled_errors,
    progress_for,
    quiet_onnxruntime,
    stderr_console,
)
from onnx_conv2matmul.cli.flags import (
    allow_added_transposes,
    bench_options,
    build_verify_options,
    inputs_option,
    max_dilation_option,
    min_cosine_option,
    nbits_given,
    nbits_options,
    no_gemm,
    report_options,
    skip_checker,
    verify_options,
)
from onnx_conv2matmul.quantize.options import DEFAULT_MAX_EVALUATIONS, resolve


@click.command("quantize")
@click.argument("input_path", metavar="INPUT", type=click.Path())
@click.argument("output_path", metavar="OUTPUT", type=click.Path())
@click.option(
    "--int8-dynamic",
    is_flag=True,
    help="onnxruntime's quantize_dynamic with int8 weights instead (decoder/joint).",
)
@nbits_options
@click.option(
    "--accuracy-level",
    type=click.IntRange(0, 4),
    default=None,
    help=(
        "MatMulNBits accuracy level (4: int8 activations, faster on most CPUs); pins it [default: the"
        " faster of 0 and 4 on this CPU that meets the accuracy target; 0 with --no-bench, --auto or"
        " --prefer size]."
    ),
)
@bench_options
@click.option(
    "--no-bench",
    is_flag=True,
    help=(
        "Time nothing: keep the accuracy level and block size as given (defaults 0 and 64) and"
        " report no latency."
    ),
)
@click.option(
    "--bench",
    "bench_mode",
    type=click.Choice(["shapes", "full"]),
    default=None,
    help=(
        "How the kernel settings are chosen: shapes times each kernel at the model's weight shapes"
        " and quantizes once; full quantizes every candidate and times the whole models"
        " [default: shapes]."
    ),
)
@click.option(
    "--no-bench-cache",
    is_flag=True,
    help=(
        "Measure again instead of reading what is kept for this CPU in the cache folder: the kernel"
        " costs, and for a model of 64 MiB or more the original's latency and its classes' losses."
    ),
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="PATTERN",
    help="Leave MatMul nodes whose name matches this glob in float. Repeatable.",
)
@click.option(
    "--include",
    multiple=True,
    metavar="PATTERN",
    help="Quantize only MatMul nodes whose name matches a glob. Repeatable.",
)
@click.option(
    "--bits-for",
    "bits_for",
    multiple=True,
    metavar="PATTERN=BITS",
    help="4 or 8 bits for MatMul nodes whose name matches the glob; a later one wins. Repeatable.",
)
@click.option(
    "--algorithm",
    type=click.Choice(ALGORITHMS),
    default=None,
    help=(
        "onnxruntime's weight-only algorithm: default (round-to-nearest), k_quant, gptq (calibrated"
        " on --inputs) or hqq (needs torch) [default: default]."
    ),
)
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    default=None,
    help=(
        "Quantization settings from a JSON file (as in the report's options.quantize); options"
        " given on the command line override the file's."
    ),
)
@inputs_option
@click.option(
    "--strict-conv1x1",
    is_flag=True,
    help="Rewrite only unit-stride, unpadded, ungrouped convs (extended mode is on by default here).",
)
@click.option("--no-dilation", is_flag=True, help="Do not rewrite convs with dilation > 1.")
@max_dilation_option("Skip convs whose dilation is above N.")
@allow_added_transposes
@click.option(
    "--prefer",
    type=click.Choice(["size", "speed"]),
    default=None,
    help=(
        "When pointwise convs are left because rewriting them adds Transposes, both models are made"
        " and timed: size keeps the smaller, speed the faster [default: the smaller one not slower"
        " than the input by more than 10%, else the faster; with --auto, size]."
    ),
)
@no_gemm
@min_cosine_option(
    help=(
        "The accuracy the output must meet: every sample's cosine similarity to the input at least X"
        " (default 0.99, the floor; -1 accepts anything). Below it: with the default settings, the"
        " search (--auto) runs; with settings given, exit 1 and nothing is written."
    ),
)
@click.option(
    "--validate",
    "validate",
    metavar="MODULE:FUNCTION",
    default=None,
    help=(
        "Your own accuracy measure: a function (package.module:function, or path/to/file.py:function)"
        " called with a model file's path that returns a score, higher is better. The output's score"
        " may drop from the input's by at most --max-drop; --auto searches with it as the target."
    ),
)
@click.option(
    "--max-drop",
    "max_drop",
    metavar="X or X%",
    default=None,
    help="With --validate, the largest drop of the score: absolute (default 0.01), or relative with %.",
)
@click.option(
    "--other-weights",
    type=click.Choice(["int8", "keep"]),
    default=None,
    help=(
        "int8: store float weights of 64 KiB or more that MatMulNBits does not take (tables, convs"
        " that stay, embeddings) as int8 with a per-axis DequantizeLinear. Default: keep (with"
        " --auto: chosen by the search)."
    ),
)
@click.option(
    "--auto",
    is_flag=True,
    help=(
        "Search, per MatMul, for 4 or 8 bits or float, the block size and symmetry, and the"
        " other weights' storage: the smallest model that meets --min-cosine (default 0.99)"
        " and, with --validate, --max-drop."
    ),
)
@click.option(
    "--max-evaluations",
    type=click.IntRange(min=2),
    default=None,
    help=f"With --auto, the most full-model evaluations [default: {DEFAULT_MAX_EVALUATIONS}].",
)
@click.option(
    "--save-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --auto, write the chosen settings (the equivalent options, as JSON) to this file.",
)
@skip_checker
@verify_options
@report_options()
def quantize_command(
    input_path: str,
    output_path: str,
    int8_dynamic: bool,
    bits: str | None,
    block_size: int | None,
    symmetric: bool | None,
    accuracy_level: int | None,
    bench_lengths: tuple[int, ...] | None,
    bench_rounds: int | None,
    no_bench: bool,
    bench_mode: str | None,
    no_bench_cache: bool,
    exclude: tuple[str, ...],
    include: tuple[str, ...],
    bits_for: tuple[str, ...],
    algorithm: str | None,
    config: str | None,
    inputs: tuple[str, ...],
    strict_conv1x1: bool,
    no_dilation: bool,
    max_dilation: int | None,
    allow_added_transposes: bool,
    prefer: str | None,
    no_gemm: bool,
    min_cosine: float | None,
    validate: str | None,
    max_drop: str | None,
    other_weights: str | None,
    auto: bool,
    max_evaluations: int | None,
    save_config: str | None,
    skip_checker: bool,
    report_json: str | None,
    report_json_stdout: bool,
    quiet: bool,
    **verify_kwargs: Any,
) -> None:
    """Rewrite pointwise convs of INPUT, quantize it with onnxruntime, write OUTPUT.

    Default: MatMulNBits, 4 bits, asymmetric; the block size (64, 128, 256) and accuracy level
    (0, 4) that run fastest on this CPU while meeting the accuracy criterion. The result is
    compared with INPUT on synthesised inputs (or --inputs), timed against it (--no-bench:
    block 64, level 0, no timing) and written only when every sample's cosine similarity is at
    least --min-cosine (0.99 by default); when the default settings fall below it, the search
    of --auto finds settings that meet it. With --auto: the smallest model that meets it.
    """
    OUTCOME.start(report_json_stdout, input_path, quiet=quiet)
    with handled_errors():
        # The report's place first: from here on every error, a missing input or a bad option
        # included, ends in the report file too.
        read = files_read(inputs, validate, config)
        for path, what in ((report_json, "report"), (save_config, "settings file")):
            if path is not None:
                check_report_target(path, inputs=[input_path], outputs=[output_path], what=what, read=read)
        if report_json is not None and save_config is not None and _same_file(report_json, save_config):
            raise click.UsageError(
                f"--report-json and --save-config name the same file ({save_config}): one would overwrite"
                " the other"
            )
        OUTCOME.watch(output_path, output_path + ".data", save_config)
        # Claimed once both files were found fit, and apart: a refusal of either writes neither.
        OUTCOME.claim_report(report_json, inputs=[input_path], outputs=[output_path], checked=True)
        quiet_onnxruntime()
        console = stderr_console(quiet)
        from onnx_conv2matmul.cli.render.quantize import print_quantize_report

        given = nbits_given(
            bits=bits,
            block_size=block_size,
            symmetric=symmetric,
            accuracy_level=accuracy_level,
            exclude=exclude,
            include=include,
            bits_for=parse_bits_for(bits_for),
            algorithm=algorithm,
            other_weights=other_weights,
        )
        if validate is not None and "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(
                0, os.getcwd()
            )  # package.module:function from the current directory, as Python does
        resolved = resolve(
            given,
            config=config,
            int8_dynamic=int8_dynamic,
            auto=auto,
            min_cosine=min_cosine,
            max_evaluations=max_evaluations,
            save_config=save_config is not None,
            bench=not no_bench,
            bench_lengths=bench_lengths,
            bench_rounds=bench_rounds,
            bench_mode=bench_mode,
            bench_cache=not no_bench_cache,
            validate=validate,
            max_drop=max_drop,
        )
        try:
            c_options = ConvertOptions(
                extended=not strict_conv1x1,
                allow_non_unit_dilation=not no_dilation,
                max_dilation=max_dilation,
                allow_added_transposes=allow_added_transposes,
                gemm=not no_gemm,
            )
        except ValueError as err:
            raise InputError(str(err)) from err
        if prefer is not None and allow_added_transposes:
            raise click.UsageError(
                "--allow-added-transposes keeps those convs whatever they cost; --prefer chooses by"
                " measurement: give one of them"
            )
        transposes = None
        if not allow_added_transposes and not resolved.int8_dynamic:
            from onnx_conv2matmul.quantize.transposes import Prefer, TransposeOptions

            # --auto asks for the smallest model: the trade keeps the smaller unless told otherwise.
            transposes = TransposeOptions(Prefer(prefer or ("size" if auto else "balanced")))
        check_input_path(input_path)
        v_options = build_verify_options(verify_kwargs, min_cosine, inputs)
        for written in (output_path, output_path + ".data"):
            check_not_read(written, read, what="output")
        from onnx_conv2matmul import api
        from onnx_conv2matmul.files import load as _io

        report = api.quantize_file(
            input_path,
            output_path,
            resolved.quantize,
            convert_options=c_options,
            int8_dynamic=resolved.int8_dynamic,
            verify=v_options,
            run_checker=not skip_checker,
            progress=progress_for(console, input_path, quiet) if os.path.isfile(input_path) else None,
            auto=resolved.auto,
            speed=resolved.speed,
            metric=resolved.metric,
            search_below=resolved.search_below,
            transposes=transposes,
        )
        print_quantize_report(console, report)
        settings = report.options.get("quantize")
        if save_config is not None and report.output_path is not None and settings is not None:
            # The written model's settings: the search's, or the default run's when --auto kept it.
            config = json.dumps(settings, indent=2) + "\n"
            with OUTCOME.undiverted():  # a path the user named: /dev/stdout is stdout
                _io.write_text_atomic(save_config, config)
        emit_report(report, report_json, _quantize_error(report))
    sys.exit(report.return_code)


def parse_bits_for(values: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in values:
        pattern, sep, raw = item.rpartition("=")
        if not sep or not pattern or raw not in ("4", "8"):
            raise click.BadParameter(
                f"expected PATTERN=4 or PATTERN=8, got {item!r}", param_hint="--bits-for"
            )
        pairs.append((pattern, int(raw)))
    return tuple(pairs)


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` lead to the same file (or would, once written)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def _quantize_error(report: QuantizeReport) -> str | None:
    """The report's failure: the criterion missed, and what can help."""
    from onnx_conv2matmul.cli.render.quantize import quantize_failure

    return quantize_failure(report)
