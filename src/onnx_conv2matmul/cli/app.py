"""Command line: parses options, calls the API, renders the report. Nothing more."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import click

from onnx_conv2matmul import api
from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.cli import signals
from onnx_conv2matmul.errors import Conv2MatMulError, ExitCode, Hint, InputError, exit_code_for
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.quantize.weight_only import ALGORITHMS
from onnx_conv2matmul.report import CommandReport, ErrorReport
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.verify.check import (
    DEFAULT_LENGTHS,
    DEFAULT_MAX_ABS,
    DEFAULT_MEAN_ABS,
    IMAGE_LENGTHS,
    Criterion,
    VerifyOptions,
    verify_models,
)
from onnx_conv2matmul.verify.report import VerifyCommandReport

if TYPE_CHECKING:
    from rich.console import Console

    from onnx_conv2matmul.quantize.nbits import QuantizeOptions as QuantizeOptionsType
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.search import AutoOptions

PROGRESS_MIN_BYTES = 100 * 2**20

# How the command line words each hint an error carries: the option it names (a hint is
# shown only by a command that has that option) and the text appended to the message.
_HINTS: dict[Hint, tuple[str, str]] = {
    Hint.OUTPUT_IS_INPUT: ("inplace", "use --inplace to replace the input"),
    Hint.NO_OUTPUT: ("inplace", "--inplace replaces the input"),
    Hint.OUTPUT_AND_INPLACE: ("inplace", "give OUTPUT or --inplace, not both"),
    Hint.SKIP_INPUT_CHECKER: ("skip_checker", "--skip-checker skips this check"),
    Hint.VERIFY_INPUTS: ("verify_inputs", "--verify-input, --verify-dim, --verify-lengths"),
    Hint.NOT_INT8_DYNAMIC: ("int8_dynamic", "without --int8-dynamic, the default MatMulNBits mode takes it"),
    Hint.KEPT_PATH: ("keep_on_failure", "--keep-on-failure moves a failed output there"),
    Hint.CALIBRATION_INPUTS: ("inputs", "--inputs FILE.npz gives them"),
    Hint.INPUT_FILES: ("inputs", "check the --inputs files: the model cannot run on them"),
}


class _Outcome:
    """How this run ends, so that every exit says the same things.

    With ``--report-json-stdout`` stdout gets exactly one JSON object: the command's report,
    or, when the command ends without one (an error, a usage error, an interrupt), an object
    with ``return_code`` and ``error``. On an interrupt, the paths the command may write are
    compared with what they were when it started, to say truthfully what was written.
    """

    def __init__(self) -> None:
        self.reset(json_stdout=False)

    def reset(self, *, json_stdout: bool) -> None:
        """Start a run (``main`` may be called more than once in one process, as tests do)."""
        self.json_stdout = json_stdout
        self.command: str | None = None
        self.inputs: str | list[str] | None = None
        self.error: str | None = None
        self._printed = False
        self._watched: dict[str, tuple[int, ...] | None] = {}

    def watch(self, *paths: str | None) -> None:
        """Remember the state of ``paths`` (those the command may write) from now on."""
        for path in paths:
            if path:
                self._watched.setdefault(path, _fingerprint(path))

    def written(self) -> list[str]:
        """The watched paths that changed since they were first watched."""
        return [path for path, before in self._watched.items() if _fingerprint(path) != before]

    def interrupted_detail(self) -> str:
        """What an interrupt leaves behind: nothing, or the watched paths written so far."""
        written = self.written()
        return f"already written: {', '.join(written)}" if written else signals.NOTHING_WRITTEN

    def print_json(self, text: str) -> None:
        """Print the command's JSON report on stdout, when asked for and not printed yet."""
        if self.json_stdout and not self._printed:
            self._printed = True
            click.echo(text)

    def start(self, json_stdout: bool, inputs: str | list[str]) -> None:
        """A command starts: whether it prints its JSON on stdout, and its input(s) for the error object."""
        self.json_stdout = json_stdout
        self.inputs = inputs

    def print_error_json(self, code: int, error: str) -> None:
        """Print the error object instead of a report, when asked for and nothing printed yet."""
        self.print_json(json.dumps(ErrorReport(self.command, code, error, self.inputs).to_dict(), indent=2))

    def finish(self, code: int) -> None:
        """The exit: a failure that printed no report prints the error object instead."""
        if code != 0:
            with contextlib.suppress(OSError):  # a closed pipe: nothing more to say
                self.print_error_json(code, self.error or f"exit code {code}")


def _fingerprint(path: str) -> tuple[int, ...] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_OUTCOME = _Outcome()


class _DefaultGroup(click.Group):
    """A group whose default command is ``convert``: ``onnx-conv2matmul IN OUT`` works.

    It also ends every run the same way: errors become one line and an exit code (see
    :func:`_errors`), and with ``--report-json-stdout`` stdout gets one JSON object
    whatever happens, click's usage errors included (see :class:`_Outcome`).
    """

    def main(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        _OUTCOME.reset(json_stdout=signals.asks_for_json(sys.argv[1:] if args is None else list(args)))
        try:
            return super().main(args, *rest, **kwargs)
        except SystemExit as exit_:
            code = exit_.code
            _OUTCOME.finish(code if isinstance(code, int) else 0 if code is None else ExitCode.FAILED)
            raise

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["convert", *args]
        with _errors(click_shows_usage=True):
            return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        _OUTCOME.command = command.name if command is not None else name
        return name, command, rest

    def invoke(self, ctx: click.Context) -> Any:
        with _errors(click_shows_usage=True):
            return super().invoke(ctx)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The default command's usage and options first, then the other commands.

        ``onnx-conv2matmul --help`` shows how to rewrite a model (``convert``'s options), as
        the original single-command tool's help did; ``COMMAND --help`` shows a command's own.
        """
        default = self.commands["convert"]
        # A child of ctx, so that it has the group's -h/--help: click keeps the help option
        # a command is first asked for, and convert's own help must still take -h.
        sub = click.Context(default, info_name=ctx.info_name, parent=ctx)
        pieces = " ".join(default.collect_usage_pieces(sub))
        formatter.write_usage(ctx.command_path, pieces)
        formatter.write_usage(ctx.command_path, "COMMAND [ARGS]...", prefix="   or: ")
        self.format_help_text(ctx, formatter)
        # convert's own options (not its --help), then the group's: --version, -h/--help.
        options = [p for p in default.params if isinstance(p, click.Option)]
        records = [record for param in options if (record := param.get_help_record(sub))]
        records += [record for param in self.get_params(ctx) if (record := param.get_help_record(ctx))]
        with formatter.section("Options"):
            formatter.write_dl(records)
        self.format_commands(ctx, formatter)
        formatter.write_paragraph()
        formatter.write_text(f"Run `{ctx.command_path} COMMAND --help` for a command's options.")


def _stderr_console(quiet: bool) -> Console:
    from rich.console import Console  # imported when needed: convert starts its copy first

    # Off a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
    return Console(stderr=True, quiet=quiet, width=None if sys.stderr.isatty() else 160)


def _fail(message: str, code: int) -> NoReturn:
    from rich.console import Console
    from rich.markup import escape

    _OUTCOME.error = message
    Console(stderr=True).print(
        f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True
    )
    sys.exit(code)


@contextmanager
def _errors(*, click_shows_usage: bool = False) -> Iterator[None]:
    """Map every exception to one line on stderr and an exit code; never a traceback.

    The exit code is :func:`onnx_conv2matmul.errors.exit_code_for`'s (click's usage errors:
    2); an internal error (3) is re-raised for a traceback with ONNX_CONV2MATMUL_DEBUG=1.
    The message of an error of this package gets the flag its hint names (see
    :data:`_HINTS`). With ``click_shows_usage`` click's usage errors go on to click, which
    prints the usage too.
    """
    try:
        yield
    except (click.exceptions.Exit, click.Abort):
        raise  # --help, --version: click ends the run
    except click.ClickException as err:
        if click_shows_usage:
            _OUTCOME.error = err.format_message()
            raise
        _fail(err.format_message(), ExitCode.USAGE)
    except Conv2MatMulError as err:
        _fail(_with_hint(str(err), err.hint), exit_code_for(err))
    except KeyboardInterrupt as interrupt:
        _fail(signals.interrupted_message(interrupt, _OUTCOME.interrupted_detail()), exit_code_for(interrupt))
    except MemoryError as err:
        _fail("out of memory", exit_code_for(err))
    except OSError as err:
        _fail(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "), exit_code_for(err))
    except Exception as err:
        if os.environ.get("ONNX_CONV2MATMUL_DEBUG"):
            raise
        _fail(_internal_error(err), exit_code_for(err))


def _with_hint(message: str, hint: Hint | None) -> str:
    """``message (hint)``, the hint worded with the flag it names, when this command has that flag."""
    if hint is None:
        return message
    option, text = _HINTS[hint]
    ctx = click.get_current_context(silent=True)
    if ctx is None or option not in {param.name for param in ctx.command.params}:
        return message
    return f"{message} ({text})"


def _internal_error(err: Exception) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    return (
        f"internal error: {err.__class__.__name__}: {first} -- a bug in onnx-conv2matmul {__version__},"
        " please report it (set ONNX_CONV2MATMUL_DEBUG=1 for a traceback)"
    )


def _emit_report(report: CommandReport, path: str | None, error: str | None = None) -> None:
    """The JSON report to ``path`` and/or stdout; ``error`` words a failure (default: the report's).

    Called last, after the tables: nothing may follow the object on stdout.
    """
    from onnx_conv2matmul.cli import render

    text = render.report_json(report, error=error)
    if path is not None:
        _io.write_text_atomic(path, text + "\n")
    _OUTCOME.print_json(text)


class _RichProgress:
    """One bar on stderr whose label follows the phase; the save phase counts tensors."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("Starting", total=None)
        self._progress.start()

    def phase(self, name: str) -> None:
        # A new task per phase: rich's update() cannot set a known total back to unknown.
        self._progress.remove_task(self._task)
        self._task = self._progress.add_task(name, total=None)

    def advance(self, done: int, total: int) -> None:
        self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        self._progress.stop()


def _progress(console: Console, input_path: str, quiet: bool) -> api.Progress | None:
    """A progress bar for models above ~100 MB, only when stderr is a terminal."""
    if quiet or not console.is_terminal or _model_bytes(input_path) < PROGRESS_MIN_BYTES:
        return None
    return _RichProgress(console)


def _model_bytes(path: str) -> int:
    """The .onnx file plus what lies beside it, counted until the threshold (a cheap estimate)."""
    total = os.path.getsize(path)
    if total >= PROGRESS_MIN_BYTES:
        return total
    # External data: one .data file or one file per tensor (legacy torch exporter).
    with os.scandir(os.path.dirname(os.path.abspath(path))) as entries:
        for entry in entries:
            if entry.is_file() and not entry.name.endswith(".onnx"):
                total += entry.stat().st_size
                if total >= PROGRESS_MIN_BYTES:
                    break
    return total


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="onnx-conv2matmul")
def main() -> None:
    """Rewrite pointwise convolutions of an ONNX model into exact MatMul subgraphs.

    `onnx-conv2matmul INPUT OUTPUT [OPTIONS]` rewrites INPUT into OUTPUT (the convert
    command, whose options follow); the other commands are listed after them.
    """


def _parse_pairs(values: tuple[str, ...], option: str, kind: type) -> dict[str, Any]:
    pairs: dict[str, Any] = {}
    for item in values:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"expected NAME=VALUE, got {item!r}", param_hint=option)
        try:
            pairs[name] = kind(raw)
        except ValueError:
            raise click.BadParameter(f"{raw!r} is not a {kind.__name__}", param_hint=option) from None
    return pairs


def _parse_lengths(_ctx: click.Context, _param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        lengths = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not lengths or any(n < 1 for n in lengths):
        raise click.BadParameter("lengths must be positive integers")
    return lengths


_VERIFY_OPTIONS = [
    click.option(
        "--verify-deterministic-cpu",
        is_flag=True,
        help="One thread, sequential execution, deterministic compute.",
    ),
    click.option(
        "--verify-lengths",
        default=None,
        callback=_parse_lengths,
        help=(
            "Values each symbolic non-batch dim takes in turn, used as given. Default:"
            f" {','.join(map(str, DEFAULT_LENGTHS))}; {','.join(map(str, IMAGE_LENGTHS))} (multiples"
            " of 32) when an input has a symbolic height and width; a length the original"
            " cannot run at is replaced by another."
        ),
    ),
    click.option(
        "--verify-batch",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Value of the batch dim (the first symbolic dim of each input).",
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
    click.option("--verify-seed", type=int, default=0, show_default=True),
    click.option(
        "--verify-max-abs",
        type=click.FloatRange(min=0),
        default=DEFAULT_MAX_ABS,
        show_default=True,
        help="Max scaled absolute difference.",
    ),
    click.option(
        "--verify-mean-abs",
        type=click.FloatRange(min=0),
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


_allow_added_transposes = click.option(
    "--allow-added-transposes",
    is_flag=True,
    help="Also rewrite convs whose channels-last form adds Transpose nodes (between depthwise convs).",
)

_no_gemm = click.option(
    "--no-gemm",
    is_flag=True,
    help="Leave Gemm nodes as they are (by default a Gemm with a constant weight becomes MatMul).",
)

# What the rewrite may do: convert's options, which inspect takes too (ConvertOptions).
_REWRITE_OPTIONS = [
    click.option(
        "--extended-conv1x1",
        "extended",
        is_flag=True,
        help="Also rewrite convs with pads or strides > 1 (emits Pad/Slice), and grouped convs.",
    ),
    click.option("--allow-non-unit-dilation", is_flag=True, help="Also rewrite convs with dilations > 1."),
    click.option(
        "--max-dilation",
        type=click.IntRange(min=1),
        default=None,
        help="With --allow-non-unit-dilation, skip convs whose dilation is above N.",
    ),
    _allow_added_transposes,
    _no_gemm,
]

# MatMulNBits settings: quantize's options, which inspect takes to project the quantized size.
_NBITS_OPTIONS = [
    click.option(
        "--bits", type=click.Choice(["4", "8"]), default="4", show_default=True, help="MatMulNBits bits."
    ),
    click.option(
        "--block-size",
        type=int,
        default=64,
        show_default=True,
        help="MatMulNBits block size: 16, 32, 64, 128 or 256.",
    ),
    click.option(
        "--symmetric/--asymmetric",
        default=False,
        show_default=True,
        help="MatMulNBits without/with zero points.",
    ),
]


def _apply(options: Sequence[Any], func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(options):
        func = option(func)
    return func


def verify_options(func: Callable[..., Any]) -> Callable[..., Any]:
    return _apply(_VERIFY_OPTIONS, func)


def rewrite_options(func: Callable[..., Any]) -> Callable[..., Any]:
    return _apply(_REWRITE_OPTIONS, func)


def nbits_options(func: Callable[..., Any]) -> Callable[..., Any]:
    return _apply(_NBITS_OPTIONS, func)


def _build_rewrite_options(kwargs: dict[str, Any]) -> ConvertOptions:
    """The :data:`_REWRITE_OPTIONS` of a command, taken out of ``kwargs``."""
    return ConvertOptions(
        extended=kwargs.pop("extended"),
        allow_non_unit_dilation=kwargs.pop("allow_non_unit_dilation"),
        max_dilation=kwargs.pop("max_dilation"),
        allow_added_transposes=kwargs.pop("allow_added_transposes"),
        gemm=not kwargs.pop("no_gemm"),
    )


_inputs_option = click.option(
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


def _build_verify_options(
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
        return _verify_options_from(kwargs, indices, min_cosine, feeds)
    except ValueError as err:
        raise InputError(str(err)) from err


def _verify_options_from(
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
        inputs=_parse_pairs(kwargs["verify_inputs"], "--verify-input", float),
        dims=_parse_pairs(kwargs["verify_dims"], "--verify-dim", int),
        deterministic=kwargs["verify_deterministic_cpu"],
        feeds=feeds,
    )


@main.command("convert")
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=True))
@click.argument("output_path", metavar="[OUTPUT]", required=False, type=click.Path())
@click.option("--inplace", is_flag=True, help="Replace INPUT (atomically) instead of writing OUTPUT.")
@rewrite_options
@click.option("--skip-checker", is_flag=True, help="Do not run the ONNX checker on input and output.")
@click.option(
    "--report-json",
    "report_json",
    type=click.Path(dir_okay=False),
    help="Write the JSON report to this file.",
)
@click.option("--report-json-stdout", is_flag=True, help="Print the JSON report on stdout and nothing else.")
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
@click.option("-q", "--quiet", is_flag=True, help="No tables or progress on stderr.")
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
    # Off a terminal the console is made after the rewrite: importing rich would delay its start.
    _OUTCOME.start(report_json_stdout, input_path)
    console = _stderr_console(quiet) if sys.stderr.isatty() else None
    with _errors():
        options = _build_rewrite_options(kwargs)
        verify_opts = _build_verify_options(kwargs) if verify else None
        output = api.check_paths(input_path, output_path, inplace=inplace)
        _OUTCOME.watch(output, output + ".data", output + api.FAILED_SUFFIX, report_json)
        if report_json is not None:
            api.check_report_path(
                report_json,
                inputs=[input_path],
                outputs=[] if inplace or output_path is None else [output_path],
            )
        report = api.convert_file(
            input_path,
            None if inplace else output_path,
            options,
            inplace=inplace,
            run_checker=not skip_checker,
            verify=verify_opts,
            keep_on_failure=keep_on_failure,
            progress=_progress(console, input_path, quiet) if console is not None else None,
        )
        from onnx_conv2matmul.cli import render

        render.print_convert_report(console or _stderr_console(quiet), report)
        _emit_report(report, report_json)
    sys.exit(report.return_code)


@main.command("verify")
@click.argument("original", type=click.Path())
@click.argument("candidate", type=click.Path())
@_inputs_option
@verify_options
@click.option("--cosine", is_flag=True, help="Also print the cosine similarity per output.")
@click.option(
    "--min-cosine",
    type=click.FloatRange(-1, 1),
    default=None,
    help="Pass when every float output's cosine similarity is at least X (quantized models).",
)
@click.option(
    "--report-json",
    "report_json",
    type=click.Path(dir_okay=False),
    help="Write the verification report to this file.",
)
@click.option("--report-json-stdout", is_flag=True, help="Print the JSON report on stdout only.")
@click.option("-q", "--quiet", is_flag=True, help="No tables on stderr.")
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
    _OUTCOME.start(report_json_stdout, [original, candidate])
    with _errors():
        console = _stderr_console(quiet)
        from onnx_conv2matmul.cli import render

        for path in (original, candidate):
            _io.check_input_path(path)
        options = _build_verify_options(verify_kwargs, min_cosine, inputs)
        if report_json is not None:
            api.check_report_path(report_json, inputs=[original, candidate], outputs=[])
        _OUTCOME.watch(report_json)
        report = VerifyCommandReport(verify_models(original, candidate, options))
        render.print_verification(console, report.verification, cosine=cosine)
        _emit_report(report, report_json)
    sys.exit(report.return_code)


@main.command("quantize")
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
@_inputs_option
@click.option(
    "--strict-conv1x1",
    is_flag=True,
    help="Rewrite only unit-stride, unpadded, ungrouped convs (extended mode is on by default here).",
)
@click.option("--no-dilation", is_flag=True, help="Do not rewrite convs with dilation > 1.")
@click.option("--max-dilation", type=click.IntRange(min=1), default=None)
@_allow_added_transposes
@_no_gemm
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
    _OUTCOME.start(report_json_stdout, input_path)
    with _errors():
        from onnx_conv2matmul.quantize.workflow import quantize_file

        console = _stderr_console(quiet)
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
        v_options = _build_verify_options(verify_kwargs, min_cosine, inputs)
        for path, what in ((report_json, "report"), (save_config, "settings file")):
            if path is not None:
                api.check_report_path(path, inputs=[input_path], outputs=[output_path], what=what)
        _OUTCOME.watch(output_path, output_path + ".data", report_json, save_config)
        report = quantize_file(
            input_path,
            output_path,
            convert_options=c_options,
            quantize_options=q_options,
            int8=int8_dynamic,
            verify=v_options,
            run_checker=not skip_checker,
            progress=_progress(console, input_path, quiet) if os.path.isfile(input_path) else None,
            auto=auto_options,
        )
        render.print_quantize_report(console, report)
        if save_config is not None and report.auto is not None:
            _io.write_text_atomic(save_config, json.dumps(report.auto.config.to_config(), indent=2) + "\n")
        _emit_report(report, report_json, _quantize_error(report))
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


@main.command("inspect")
@click.argument("input_path", metavar="MODEL", type=click.Path())
@rewrite_options
@nbits_options
@click.option("--skip-checker", is_flag=True, help="Do not run the ONNX checker on MODEL.")
@click.option(
    "--json",
    "--report-json-stdout",
    "json_stdout",
    is_flag=True,
    help="Print the report as one JSON object on stdout and nothing else.",
)
@click.option("-q", "--quiet", is_flag=True, help="No tables on stderr.")
def inspect_command(
    input_path: str,
    bits: str,
    block_size: int,
    symmetric: bool,
    skip_checker: bool,
    json_stdout: bool,
    quiet: bool,
    **kwargs: Any,
) -> None:
    """Show what convert would do to MODEL, and its projected MatMulNBits size; write nothing.

    Takes convert's rewrite options; --bits, --block-size and --symmetric/--asymmetric are
    quantize's settings for the projection.
    """
    _OUTCOME.start(json_stdout, input_path)
    with _errors():
        from onnx_conv2matmul.quantize.nbits import QuantizeOptions

        options = _build_rewrite_options(kwargs)
        try:
            q_options = QuantizeOptions(bits=int(bits), block_size=block_size, symmetric=symmetric)
        except ValueError as err:
            raise InputError(str(err)) from err
        from onnx_conv2matmul.cli import render
        from onnx_conv2matmul.quantize.inspection import inspect_file

        report = inspect_file(input_path, options, q_options, run_checker=not skip_checker)
        render.print_inspect_report(_stderr_console(quiet), report)
        _emit_report(report, None)
    sys.exit(report.return_code)


@main.command("bundle")
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
    _OUTCOME.start(report_json_stdout, directory)
    with _errors():
        from onnx_conv2matmul.quantize.workflow import bundle_report

        console = _stderr_console(False)
        from onnx_conv2matmul.cli import render

        if manifest is not None:
            models = [os.path.join(directory, n) for n in _onnx_names(directory)]
            api.check_report_path(manifest, inputs=models, outputs=[])
            _OUTCOME.watch(manifest)
        report = bundle_report(directory, manifest=manifest is not None)
        console.print(render.bundle_table(report))
        _emit_report(report, manifest)


def _onnx_names(directory: str) -> list[str]:
    """The .onnx files in ``directory`` (none when it is not one: the command says so later)."""
    try:
        return [name for name in os.listdir(directory) if name.endswith(".onnx")]
    except OSError:
        return []


if __name__ == "__main__":  # pragma: no cover
    main()


def run() -> None:
    """:func:`main` as a process: SIGINT and SIGTERM handled, exit codes as documented.

    Both signals unwind like Ctrl-C (staging directories removed) and exit 128 + signal
    (see :mod:`onnx_conv2matmul.cli.entry`); so does a signal that arrives while the end of
    the run is reported. Otherwise this ends with :exc:`SystemExit`, as :func:`main` does,
    and the interpreter's teardown as usual: nothing else about the process is changed.
    """
    signals.install_signal_handlers()
    try:
        main()
    except KeyboardInterrupt as interrupt:  # a signal while the end of the run was reported
        signals.exit_interrupted(interrupt, _OUTCOME.interrupted_detail(), _OUTCOME.print_error_json)
