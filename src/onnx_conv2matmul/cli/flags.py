"""Options several commands share (the check, the rewrite, MatMulNBits) and their mapping to the
library's option types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import click

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.quantize.options import QuantizeOptions
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.verify.options import (
    DEFAULT_LENGTHS,
    DEFAULT_MAX_ABS,
    DEFAULT_MEAN_ABS,
    DEFAULT_MEMORY,
    IMAGE_LENGTHS,
    LABEL_MODES,
    LONG_LENGTH,
    VerifyOptions,
    format_size,
    parse_size,
)

_DEFAULTS = QuantizeOptions()

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses NaN and the infinities (a range lets NaN through:
    it compares false with both bounds)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def parse_pairs(values: tuple[str, ...], option: str, kind: type) -> dict[str, Any]:
    pairs: dict[str, Any] = {}
    for item in values:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"expected NAME=VALUE, got {item!r}", param_hint=option)
        try:
            pairs[name] = kind(raw)
        except ValueError:
            raise click.BadParameter(f"{raw!r} is not a {kind.__name__}", param_hint=option) from None
        if kind is float and not math.isfinite(pairs[name]):
            raise click.BadParameter(f"{raw!r} is not a finite number", param_hint=option)
        if kind is int and pairs[name] < 1:
            raise click.BadParameter(f"{raw!r}: must be >= 1", param_hint=option)
    return pairs


def parse_lengths(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        lengths = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not lengths or any(n < 1 for n in lengths):
        raise click.BadParameter("lengths must be positive integers")
    return lengths


def parse_memory(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int:
    if value is None:
        return DEFAULT_MEMORY
    try:
        return parse_size(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


VERIFY_OPTIONS = [
    click.option(
        "--verify-deterministic-cpu",
        is_flag=True,
        help="One thread, sequential execution, deterministic compute.",
    ),
    click.option(
        "--verify-lengths",
        default=None,
        callback=parse_lengths,
        help=(
            "Values each sequence dim (time, tokens, height, width...; not the batch) takes in turn,"
            f" used as given. Default: {','.join(map(str, DEFAULT_LENGTHS))}, and {LONG_LENGTH} for a"
            f" speech encoder; {','.join(map(str, IMAGE_LENGTHS))} (multiples of 32) when an input has"
            " a symbolic height and width; a length the original cannot run at is replaced by"
            " another; default lengths are shortened to fit --verify-memory."
        ),
    ),
    click.option(
        "--verify-memory",
        default=None,
        callback=parse_memory,
        metavar="SIZE",
        help=(
            "What the check may hold at once: every run's inputs and reference outputs and one"
            f" run's candidate outputs (e.g. 512MiB, 2GiB). Default: {format_size(DEFAULT_MEMORY)};"
            " default lengths are shortened to fit it, lengths given that do not fit are refused."
        ),
    ),
    click.option(
        "--verify-batch",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Value of the batch dims (named batch, or the first axis of an input).",
    ),
    click.option("--verify-signal-input-name", default=None, help="Main signal input (random)."),
    click.option(
        "--verify-length-input-name",
        default=None,
        help="Input that gets the sequence length per batch row.",
    ),
    click.option(
        "--verify-output-index",
        type=click.IntRange(min=0),
        default=None,
        help="Compare only this output (with --verify-length-output-index).",
    ),
    click.option(
        "--verify-length-output-index",
        type=click.IntRange(min=0),
        default=None,
        help="Also compare this (length) output; integer outputs must match exactly.",
    ),
    click.option(
        "--verify-seed",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Seed of the random inputs.",
    ),
    click.option(
        "--verify-max-abs",
        type=FiniteFloatRange(min=0),
        default=DEFAULT_MAX_ABS,
        show_default=True,
        help="Max scaled absolute difference.",
    ),
    click.option(
        "--verify-mean-abs",
        type=FiniteFloatRange(min=0),
        default=DEFAULT_MEAN_ABS,
        show_default=True,
        help="Max mean scaled absolute difference.",
    ),
    click.option(
        "--verify-input",
        "verify_inputs",
        multiple=True,
        metavar="NAME=VALUE",
        help="Fill an input with a value (e.g. sr=16000). Repeatable.",
    ),
    click.option(
        "--verify-dim",
        "verify_dims",
        multiple=True,
        metavar="NAME=VALUE",
        help="Fix a symbolic dim (e.g. batch=2). Repeatable.",
    ),
]


allow_added_transposes = click.option(
    "--allow-added-transposes",
    is_flag=True,
    help="Also rewrite convs whose channels-last form adds Transpose nodes (between depthwise convs).",
)


skip_checker = click.option(
    "--skip-checker",
    is_flag=True,
    help="Do not run the ONNX checker on the models read and written (inspect: on MODEL).",
)


no_gemm = click.option(
    "--no-gemm",
    is_flag=True,
    help="Leave Gemm nodes as they are (by default a Gemm with a constant weight becomes MatMul).",
)


def max_dilation_option(
    help: str = "With --allow-non-unit-dilation, skip convs whose dilation is above N.",
) -> Decorator:
    """``--max-dilation N``; quantize, which rewrites dilated convs by default, words it its way."""
    return click.option("--max-dilation", type=click.IntRange(min=1), default=None, help=help)


def min_cosine_option(help: str) -> Decorator:
    """``--min-cosine X``: verify's pass criterion, quantize's accuracy floor (each words it), and
    ``--criterion``, what else a minimum cosine judges."""
    return option_group(
        [
            click.option("--min-cosine", type=FiniteFloatRange(-1, 1), default=None, help=help),
            click.option(
                "--criterion",
                type=click.Choice(LABEL_MODES),
                default="auto",
                show_default=True,
                help=(
                    "With a minimum cosine, outputs of class scores must also keep fp32's labels"
                    " (99%, or the minimum cosine when lower; per sample, or as read from frames):"
                    " auto finds them in the graph (Softmax, ArgMax, logits), labels takes every"
                    " output that can hold them, cosine none."
                ),
            ),
        ]
    )


def json_stdout_option(
    *aliases: str, help: str = "Print the JSON report on stdout and nothing else."
) -> Decorator:
    """``--report-json-stdout`` (inspect also takes it as ``--json``)."""
    return click.option(*aliases, "--report-json-stdout", "report_json_stdout", is_flag=True, help=help)


def quiet_option(help: str = "No tables or progress on stderr.") -> Decorator:
    return click.option("-q", "--quiet", is_flag=True, help=help)


# What the rewrite may do: convert's options, which inspect takes too (ConvertOptions).
REWRITE_OPTIONS = [
    click.option(
        "--extended-conv1x1",
        "extended",
        is_flag=True,
        help="Also rewrite convs with pads or strides > 1 (emits Pad/Slice), and grouped convs.",
    ),
    click.option("--allow-non-unit-dilation", is_flag=True, help="Also rewrite convs with dilations > 1."),
    max_dilation_option(),
    allow_added_transposes,
    no_gemm,
]


# MatMulNBits settings: quantize's options, which inspect takes to project the quantized size.
# No defaults here: an option left out is left to the settings file, then to QuantizeOptions.
NBITS_OPTIONS = [
    click.option(
        "--bits",
        type=click.Choice(["4", "8"]),
        default=None,
        help=f"MatMulNBits bits [default: {_DEFAULTS.bits}].",
    ),
    click.option(
        "--block-size",
        type=int,
        default=None,
        help=(
            f"MatMulNBits block size: 16, 32, 64, 128 or 256 [default: {_DEFAULTS.block_size}; quantize"
            " chooses it from the kernel costs on this CPU, the fewest bytes with --prefer size, unless"
            " --no-bench, --auto or another --algorithm]."
        ),
    ),
    click.option(
        "--symmetric/--asymmetric",
        default=None,
        help="MatMulNBits without/with zero points [default: "
        + ("symmetric" if _DEFAULTS.symmetric else "asymmetric")
        + "].",
    ),
]


def nbits_given(**values: Any) -> dict[str, Any]:
    """The MatMulNBits settings given on the command line, by QuantizeOptions field (the rest
    left out: a settings file or the defaults decide them)."""
    given = {name: value for name, value in values.items() if value is not None and value != ()}
    if "bits" in given:
        given["bits"] = int(given["bits"])
    return given


def apply_options(options: Sequence[Any], func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(options):
        func = option(func)
    return func


def option_group(options: Sequence[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that adds ``options`` to a command, in the order listed (in its help too)."""

    def add(func: Callable[..., Any]) -> Callable[..., Any]:
        return apply_options(options, func)

    return add


def report_options(
    report_json: str = "Write the JSON report to this file.",
    stdout: str = "Print the JSON report on stdout and nothing else.",
    quiet_help: str = "No tables or progress on stderr.",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--report-json FILE``, ``--report-json-stdout`` and ``-q/--quiet``, with the help every
    command gives them unless it says otherwise."""
    return option_group(
        [
            click.option("--report-json", "report_json", type=click.Path(dir_okay=False), help=report_json),
            json_stdout_option(help=stdout),
            quiet_option(help=quiet_help),
        ]
    )


verify_options = option_group(VERIFY_OPTIONS)
rewrite_options = option_group(REWRITE_OPTIONS)
nbits_options = option_group(NBITS_OPTIONS)


def build_rewrite_options(kwargs: dict[str, Any]) -> ConvertOptions:
    """The :data:`REWRITE_OPTIONS` of a command, taken out of ``kwargs``."""
    return ConvertOptions(
        extended=kwargs.pop("extended"),
        allow_non_unit_dilation=kwargs.pop("allow_non_unit_dilation"),
        max_dilation=kwargs.pop("max_dilation"),
        allow_added_transposes=kwargs.pop("allow_added_transposes"),
        gemm=not kwargs.pop("no_gemm"),
    )


inputs_option = click.option(
    "--inputs",
    "inputs",
    multiple=True,
    metavar="FILE.npz",
    type=click.Path(),
    help=(
        "Real inputs instead of synthesised ones: an .npz file whose keys are the model's input"
        " names (one run per file), or a directory of .npz files. Repeatable."
    ),
)


def build_verify_options(
    kwargs: dict[str, Any], min_cosine: float | None = None, inputs: tuple[str, ...] = ()
) -> VerifyOptions:
    indices: tuple[int, ...] | None = None
    picked = [kwargs["verify_output_index"], kwargs["verify_length_output_index"]]
    if any(i is not None for i in picked):
        indices = tuple(i for i in picked if i is not None)
    feeds = None
    if inputs:
        from onnx_conv2matmul.verify.check import load_inputs

        feeds = tuple(load_inputs(inputs))
    try:
        return verify_options_from(kwargs, indices, min_cosine, feeds)
    except ValueError as err:
        raise InputError(str(err)) from err


def verify_options_from(
    kwargs: dict[str, Any],
    indices: tuple[int, ...] | None,
    min_cosine: float | None,
    feeds: tuple[Any, ...] | None = None,
) -> VerifyOptions:
    return VerifyOptions(
        lengths=kwargs["verify_lengths"],
        batch=kwargs["verify_batch"],
        seed=kwargs["verify_seed"],
        max_abs=kwargs["verify_max_abs"],
        mean_abs=kwargs["verify_mean_abs"],
        min_cosine=min_cosine,
        signal_input=kwargs["verify_signal_input_name"],
        length_input=kwargs["verify_length_input_name"],
        output_indices=indices,
        inputs=parse_pairs(kwargs["verify_inputs"], "--verify-input", float),
        dims=parse_pairs(kwargs["verify_dims"], "--verify-dim", int),
        deterministic=kwargs["verify_deterministic_cpu"],
        feeds=feeds,
        memory=kwargs["verify_memory"],
        labels=kwargs.get("criterion") or "auto",
    )


# --bench-lengths and --bench-rounds: how latency is measured (quantize and bench).
BENCH_OPTIONS = [
    click.option(
        "--bench-lengths",
        callback=parse_lengths,
        default=None,
        metavar="L,L,...",
        help=(
            "Lengths the latency is measured at, batch 1 (every symbolic dim but the batch"
            " takes each in turn) [default: 200,1000 for one sequence dim, 224,448 for images,"
            " 16,64 for several length dims]."
        ),
    ),
    click.option(
        "--bench-rounds",
        type=click.IntRange(min=3),
        default=None,
        help="Timed runs of each model at each length, interleaved [default: 10].",
    ),
]
bench_options = option_group(BENCH_OPTIONS)
