"""The click group: the commands, ``convert`` as the default one, and :func:`run`, the group as a
process. Parses options, calls the API, renders the report. Nothing more.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.cli import signals
from onnx_conv2matmul.cli.bench import bench_command
from onnx_conv2matmul.cli.bundle import bundle_command
from onnx_conv2matmul.cli.common import (
    OUTCOME,
    handled_errors,
)
from onnx_conv2matmul.cli.convert import convert_command, verify_command
from onnx_conv2matmul.cli.inspect import inspect_command
from onnx_conv2matmul.cli.quantize import quantize_command
from onnx_conv2matmul.errors import ExitCode


class _DefaultGroup(click.Group):
    """A group whose default command is ``convert``: ``onnx-conv2matmul IN OUT`` works.

    It also ends every run the same way: errors become one line and an exit code (see
    :func:`handled_errors`), and with ``--report-json-stdout`` stdout gets one JSON object
    whatever happens, click's usage errors included (see :class:`Outcome`).
    """

    def main(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        from onnx_conv2matmul.files.publish import interruptions_deferred_by

        argv = sys.argv[1:] if args is None else list(args)
        OUTCOME.reset(json_stdout=signals.asks_for_json(argv), argv=argv)
        try:
            with interruptions_deferred_by(signals.held):
                return super().main(args, *rest, **kwargs)
        except SystemExit as exit_:
            code = exit_.code
            OUTCOME.finish(code if isinstance(code, int) else 0 if code is None else ExitCode.FAILED)
            raise
        finally:
            OUTCOME.restore()

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["convert", *args]
        with handled_errors(click_shows_usage=True):
            return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        OUTCOME.command = command.name if command is not None else name
        return name, command, rest

    def invoke(self, ctx: click.Context) -> Any:
        with handled_errors(click_shows_usage=True):
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


# Every command takes -h as well as --help, whichever context it is first parsed in: click keeps
# the help option a command is first asked for, so it is made here, before a caller's own
# click.Context (which has --help alone) can ask first.
_HELP_NAMES: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


@click.group(cls=_DefaultGroup, context_settings=_HELP_NAMES)
@click.version_option(__version__, "--version", prog_name="onnx-conv2matmul")
def main() -> None:
    """Rewrite pointwise convolutions of an ONNX model into exact MatMul subgraphs.

    `onnx-conv2matmul INPUT OUTPUT [OPTIONS]` rewrites INPUT into OUTPUT (the convert
    command, whose options follow); the other commands are listed after them.
    """


def run() -> None:
    """:func:`main` as a process: SIGINT, SIGTERM and SIGHUP handled, exit codes as documented.

    Each signal unwinds like Ctrl-C (staging and scratch directories removed) and exits 128 + signal
    (see :mod:`onnx_conv2matmul.cli.entry`); so does a signal that arrives while the end of
    the run is reported. Otherwise this ends with :exc:`SystemExit`, as :func:`main` does,
    and the interpreter's teardown as usual: nothing else about the process is changed.
    """
    signals.install_signal_handlers()
    try:
        main()
    except KeyboardInterrupt as interrupt:  # a signal while the end of the run was reported
        signals.exit_interrupted(interrupt, OUTCOME.interrupted_detail(), OUTCOME.print_error_json)


for _command in (
    convert_command,
    verify_command,
    quantize_command,
    inspect_command,
    bundle_command,
    bench_command,
):
    _command.context_settings = {**_HELP_NAMES, **_command.context_settings}
    _command.get_help_option(
        click.Context(_command, help_option_names=_HELP_NAMES["help_option_names"])
    )  # kept: see _HELP_NAMES
    main.add_command(_command)
