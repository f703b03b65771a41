"""The ``quantize`` command: flags mapped to quantize options, the report rendered."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files.load import check_report_target
from onnx_conv2matmul.quantize.weight_only import ALGORITHMS
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.verify.check import (
    Criterion,
)

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.nbits import QuantizeOptions as QuantizeOptionsType
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.search import AutoOptions
from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    handled_errors,
    progress_for,
    stderr_console,
)
from onnx_conv2matmul.cli.flags import (
    allow_added_transposes,
    build_verify_options,
    inputs_option,
    nbits_options,
    no_gemm,
    verify_options,
)


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
    default=0,
    show_default=True,
    help="MatMulNBits accuracy level.",
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
    default="default",
    show_default=True,
    help=(
        "onnxruntime's weight-only algorithm: default (round-to-nearest), k_quant, gptq (calibrated"
        " on --inputs) or hqq (needs torch)."
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
@click.option("--max-dilation", type=click.IntRange(min=1), default=None)
@allow_added_transposes
@no_gemm
@click.option(
    "--min-cosine",
    type=click.FloatRange(-1, 1),
    default=None,
    help="Fail (exit 1, nothing written) when an output's cosine similarity is below X.",
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
        " other weights' storage: the smallest model whose cosine meets --min-cosine."
    ),
)
@click.option(
    "--max-evaluations",
    type=click.IntRange(min=2),
    default=8,
    show_default=True,
    help="With --auto, the most full-model evaluations the search makes.",
)
@click.option(
    "--save-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --auto, write the chosen settings (the equivalent options, as JSON) to this file.",
)
@click.option("--skip-checker", is_flag=True)
@verify_options
@click.option("--report-json", "report_json", type=click.Path(dir_okay=False))
@click.option("--report-json-stdout", is_flag=True)
@click.option("-q", "--quiet", is_flag=True)
def quantize_command(
    input_path: str,
    output_path: str,
    int8_dynamic: bool,
    bits: str,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    exclude: tuple[str, ...],
    include: tuple[str, ...],
    bits_for: tuple[str, ...],
    algorithm: str,
    config: str | None,
    inputs: tuple[str, ...],
    strict_conv1x1: bool,
    no_dilation: bool,
    max_dilation: int | None,
    allow_added_transposes: bool,
    no_gemm: bool,
    min_cosine: float | None,
    other_weights: str | None,
    auto: bool,
    max_evaluations: int,
    save_config: str | None,
    skip_checker: bool,
    report_json: str | None,
    report_json_stdout: bool,
    quiet: bool,
    **verify_kwargs: Any,
) -> None:
    """Rewrite pointwise convs of INPUT, quantize it with onnxruntime, write OUTPUT.

    Default: MatMulNBits, 4 bits, block 64, asymmetric, accuracy level 0. The result is
    compared with INPUT on synthesised inputs (cosine similarity, relative error).
    With --auto --min-cosine X: the smallest model whose cosine is at least X.
    """
    OUTCOME.start(report_json_stdout, input_path)
    with handled_errors():
        from onnx_conv2matmul.quantize.workflow import quantize_file

        console = stderr_console(quiet)
        from onnx_conv2matmul.cli import render

        given = {
            "bits": int(bits),
            "block_size": block_size,
            "symmetric": symmetric,
            "accuracy_level": accuracy_level,
            "exclude": exclude,
            "include": include,
            "bits_for": _parse_bits_for(bits_for),
            "algorithm": algorithm,
        }
        if other_weights is not None:
            given["other_weights"] = other_weights
        q_options = _quantize_options(given, config)
        if int8_dynamic:
            _refuse_with_int8_dynamic(q_options)
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
        auto_options = _auto_options(
            auto, min_cosine, max_evaluations, other_weights, save_config, int8_dynamic, q_options, config
        )
        _io.check_input_path(input_path)
        v_options = build_verify_options(verify_kwargs, min_cosine, inputs)
        for path, what in ((report_json, "report"), (save_config, "settings file")):
            if path is not None:
                check_report_target(path, inputs=[input_path], outputs=[output_path], what=what)
        OUTCOME.watch(output_path, output_path + ".data", report_json, save_config)
        report = quantize_file(
            input_path,
            output_path,
            convert_options=c_options,
            quantize_options=q_options,
            int8=int8_dynamic,
            verify=v_options,
            run_checker=not skip_checker,
            progress=progress_for(console, input_path, quiet) if os.path.isfile(input_path) else None,
            auto=auto_options,
        )
        render.print_quantize_report(console, report)
        if save_config is not None and report.auto is not None:
            _io.write_text_atomic(save_config, json.dumps(report.auto.config.to_config(), indent=2) + "\n")
        emit_report(report, report_json, _quantize_error(report))
    sys.exit(report.return_code)


def _parse_bits_for(values: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in values:
        pattern, sep, raw = item.rpartition("=")
        if not sep or not pattern or raw not in ("4", "8"):
            raise click.BadParameter(
                f"expected PATTERN=4 or PATTERN=8, got {item!r}", param_hint="--bits-for"
            )
        pairs.append((pattern, int(raw)))
    return tuple(pairs)


def _quantize_options(given: dict[str, Any], config: str | None) -> QuantizeOptionsType:
    """The settings file's options, overridden by those given on the command line.

    Without a file, the command line's (defaults included). With one, an option takes the
    command line's value only when given there; a repeatable option given there replaces
    the file's whole list.
    """
    from click.core import ParameterSource

    from onnx_conv2matmul.quantize.nbits import QuantizeOptions, load_config

    fields = dict(given)
    if config is not None:
        ctx = click.get_current_context()
        fields = load_config(config)
        for name, value in given.items():
            if name not in fields or ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                fields[name] = value
    try:
        return QuantizeOptions(**fields)
    except ValueError as err:
        raise InputError(str(err)) from err


def _refuse_with_int8_dynamic(options: QuantizeOptionsType) -> None:
    """Refuse MatMulNBits settings that ``quantize_dynamic`` would silently not apply."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    typed = {
        "bits": "--bits",
        "block_size": "--block-size",
        "symmetric": "--symmetric/--asymmetric",
        "accuracy_level": "--accuracy-level",
    }
    clashes = [
        flag for name, flag in typed.items() if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    clashes += [
        name
        for name, given in (
            ("--bits-for", bool(options.bits_for)),
            ("--algorithm", options.algorithm != "default"),
            ("--other-weights int8", options.other_weights == "int8"),
            ("the settings file's nodes", bool(options.nodes)),
        )
        if given
    ]
    if clashes:
        raise click.UsageError(f"{clashes[0]}: a MatMulNBits setting, which --int8-dynamic would not apply")


def _auto_options(
    auto: bool,
    min_cosine: float | None,
    max_evaluations: int,
    other_weights: str | None,
    save_config: str | None,
    int8_dynamic: bool,
    q_options: QuantizeOptionsType,
    config: str | None,
) -> AutoOptions | None:
    """The search's options, or None without --auto (refusing options that need it or clash)."""
    if not auto:
        if save_config is not None:
            raise click.UsageError("--save-config needs --auto")
        return None
    if min_cosine is None:
        raise click.UsageError("--auto needs --min-cosine")
    if int8_dynamic:
        raise click.UsageError("--auto chooses MatMulNBits settings: it does not combine with --int8-dynamic")
    clashes = [
        name
        for name, given in (
            ("--config", config is not None),
            ("--bits-for", bool(q_options.bits_for)),
            ("--algorithm", q_options.algorithm != "default"),
        )
        if given
    ]
    if clashes:
        raise click.UsageError(
            f"--auto chooses every node's setting (round-to-nearest): it does not combine with {clashes[0]}"
        )
    from onnx_conv2matmul.quantize.search import AutoOptions

    return AutoOptions(
        min_cosine=min_cosine,
        max_evaluations=max_evaluations,
        other_weights=None if other_weights is None else other_weights == "int8",
        accuracy_level=q_options.accuracy_level,
        exclude=q_options.exclude,
        include=q_options.include,
    )


def _quantize_error(report: QuantizeReport) -> str | None:
    """The report's failure, naming --min-cosine when that was the criterion."""
    verification = report.verification
    if report.passed or verification is None or verification.options.criterion is not Criterion.MIN_COSINE:
        return None
    return f"accuracy below --min-cosine {verification.options.min_cosine:g}; nothing was written"
