"""Command line: parses options, calls the API, renders the report. Nothing more."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console

from onnx_conv2matmul import _io, api, render
from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.errors import CheckerError, Conv2MatMulError, InputError
from onnx_conv2matmul.options import ConvertOptions

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class _DefaultGroup(click.Group):
    """A group whose default command is ``convert``: ``onnx-conv2matmul IN OUT`` works."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["convert", *args]
        return super().parse_args(ctx, args)


def _stderr_console(quiet: bool) -> Console:
    return Console(stderr=True, quiet=quiet)


def _fail(message: str, code: int) -> None:
    Console(stderr=True).print(f"[bold red]error:[/bold red] {message}", highlight=False)
    sys.exit(code)


@contextmanager
def _errors() -> Iterator[None]:
    """Map errors to one line on stderr and an exit code; never a traceback."""
    try:
        yield
    except InputError as err:
        _fail(str(err), EXIT_USAGE)
    except CheckerError as err:
        _fail(str(err), EXIT_FAILED)
    except Conv2MatMulError as err:
        _fail(str(err), EXIT_FAILED)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", 130)
    except MemoryError:
        _fail("out of memory", EXIT_FAILED)
    except OSError as err:
        _fail(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "), EXIT_FAILED)
    except Exception as err:
        if os.environ.get("ONNX_CONV2MATMUL_DEBUG"):
            raise
        _fail(
            f"unexpected {err.__class__.__name__}: {err} (set ONNX_CONV2MATMUL_DEBUG=1 for a traceback)",
            EXIT_FAILED,
        )


def write_text_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _progress_factory(console: Console, enabled: bool) -> Callable[[str], Any]:
    """Build progress callbacks; a no-op unless stderr is a terminal."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    if not enabled or not console.is_terminal:
        return lambda _label: None
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )

    def make(label: str) -> Callable[[int, int], None]:
        task = progress.add_task(label, total=None)
        progress.start()

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
            if done >= total:
                progress.stop()

        return update

    return make


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="onnx-conv2matmul")
def main() -> None:
    """Rewrite pointwise convolutions of an ONNX model into exact MatMul subgraphs.

    Run `onnx-conv2matmul INPUT OUTPUT` (the convert command) or one of the commands below.
    """


@main.command("convert")
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=True))
@click.argument("output_path", metavar="[OUTPUT]", required=False, type=click.Path())
@click.option("--inplace", is_flag=True, help="Replace INPUT (atomically) instead of writing OUTPUT.")
@click.option("--extended-conv1x1", "extended", is_flag=True,
              help="Also rewrite convs with pads, strides > 1 or auto_pad (emits Pad/Slice).")
@click.option("--allow-non-unit-dilation", is_flag=True, help="Also rewrite convs with dilations > 1.")
@click.option("--max-dilation", type=click.IntRange(min=1), default=None,
              help="With --allow-non-unit-dilation, skip convs whose dilation is above N.")
@click.option("--skip-checker", is_flag=True, help="Do not run the ONNX checker on input and output.")
@click.option("--report-json", "report_json", type=click.Path(dir_okay=False),
              help="Write the JSON report to this file.")
@click.option("--report-json-stdout", is_flag=True,
              help="Print the JSON report on stdout and nothing else.")
@click.option("-q", "--quiet", is_flag=True, help="No tables or progress on stderr.")
def convert_command(
    input_path: str,
    output_path: str | None,
    inplace: bool,
    extended: bool,
    allow_non_unit_dilation: bool,
    max_dilation: int | None,
    skip_checker: bool,
    report_json: str | None,
    report_json_stdout: bool,
    quiet: bool,
) -> None:
    """Rewrite INPUT into OUTPUT (or INPUT itself with --inplace)."""
    console = _stderr_console(quiet)
    with _errors():
        options = ConvertOptions(
            extended=extended,
            allow_non_unit_dilation=allow_non_unit_dilation,
            max_dilation=max_dilation,
        )
        api.check_paths(input_path, output_path, inplace=inplace)
        if report_json is not None:
            _io.check_output_path(report_json, what="report")
        big = os.path.getsize(input_path) > 100 * 2**20 or _has_big_neighbours(input_path)
        progress = _progress_factory(console, enabled=big)
        report = api.convert_file(
            input_path,
            None if inplace else output_path,
            options,
            inplace=inplace,
            run_checker=not skip_checker,
            progress=progress("Saving"),
        )
        text = render.report_json(report)
        if report_json is not None:
            write_text_atomic(report_json, text + "\n")
        if report_json_stdout:
            click.echo(text)
        render.print_convert_report(console, report)
    sys.exit(report.return_code)


def _has_big_neighbours(path: str) -> bool:
    data = path + ".data"
    return os.path.exists(data) and os.path.getsize(data) > 100 * 2**20


if __name__ == "__main__":  # pragma: no cover
    main()
