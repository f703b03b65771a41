"""What every command shares: the outcome of the run, errors as one line and an exit code, the
console, progress and the report's JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn, TextIO

import click

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.cli import signals
from onnx_conv2matmul.cli.streams import Diversion
from onnx_conv2matmul.errors import (
    Conv2MatMulError,
    ExitCode,
    Hint,
    OptionConflict,
    exit_code_for,
    is_out_of_memory,
)
from onnx_conv2matmul.files.checks import check_report_target, fingerprint
from onnx_conv2matmul.report import CommandReport, ErrorReport

if TYPE_CHECKING:
    from rich.console import Console

    from onnx_conv2matmul.files.progress import Progress


PROGRESS_MIN_BYTES = 100 * 2**20


# How the command line words each hint an error carries: the option it names (a hint is
# shown only by a command that has that option) and the text appended to the message.
HINTS: dict[Hint, tuple[str, str]] = {
    Hint.OUTPUT_IS_INPUT: ("inplace", "use --inplace to replace the input"),
    Hint.NO_OUTPUT: ("inplace", "--inplace replaces the input"),
    Hint.OUTPUT_AND_INPLACE: ("inplace", "give OUTPUT or --inplace, not both"),
    Hint.SKIP_INPUT_CHECKER: ("skip_checker", "--skip-checker skips this check"),
    Hint.VERIFY_INPUTS: ("verify_inputs", "--verify-input, --verify-dim, --verify-lengths"),
    Hint.NOT_INT8_DYNAMIC: ("int8_dynamic", "without --int8-dynamic, the default MatMulNBits mode takes it"),
    Hint.KEPT_PATH: ("keep_on_failure", "--keep-on-failure moves a failed output there"),
    Hint.CALIBRATION_INPUTS: ("inputs", "--inputs FILE.npz gives them"),
    Hint.SYNTHESISED_SHAPES: ("inputs", "--inputs FILE.npz gives real inputs; or --verify-dim NAME=SIZE"),
    Hint.CLASSIFIER_INPUTS: (
        "inputs",
        "--inputs with real samples (about 100), or --criterion cosine to judge by the cosine alone",
    ),
    Hint.INPUT_FILES: ("inputs", "check the --inputs files: the model cannot run on them"),
    Hint.VERIFY_BUDGET: (
        "verify_memory",
        "--verify-memory SIZE raises the budget; or shorter --verify-lengths",
    ),
    Hint.VERIFY_OUT_OF_MEMORY: (
        "verify_memory",
        "--verify-memory SIZE lowers what the check holds; or shorter --verify-lengths",
    ),
}


class Outcome:
    """How this run ends, so that every exit says the same things.

    With ``--report-json-stdout`` stdout gets exactly one JSON object: the command's report,
    or, when the command ends without one (an error, a usage error, an interrupt), an object
    with ``return_code`` and ``error``. On an interrupt, the paths the command may write are
    compared with what they were when it started, to say truthfully what was written.
    """

    def __init__(self) -> None:
        self._diversion = Diversion()
        self.stdout: TextIO = sys.stdout
        self.reset(json_stdout=False)

    def reset(self, *, json_stdout: bool, argv: Sequence[str] = ()) -> None:
        """Start a run (``main`` may be called more than once in one process, as tests do)."""
        self.json_stdout = json_stdout
        self.argv = list(argv)
        self.unparsed = False  # the command line could not be parsed (click's usage error)
        self.command: str | None = None
        self.inputs: str | list[str] | None = None
        self.error: str | None = None
        self._printed = False
        self.report_path: str | None = None
        self._report_written = False
        self.quiet = False
        self.failure: str | None = None  # a report's failure, which the quiet console did not print
        self._watched: dict[str, tuple[int, ...] | None] = {}
        self.restore()
        self.stdout = sys.stdout  # the real one: a command's body may redirect it

    def watch(self, *paths: str | None) -> None:
        """Remember the state of ``paths`` (those the command may write) from now on."""
        for path in paths:
            if path:
                self._watched.setdefault(path, fingerprint(path))

    def written(self) -> list[str]:
        """The watched paths that changed since they were first watched."""
        return [path for path, before in self._watched.items() if fingerprint(path) != before]

    def interrupted_detail(self) -> str:
        """What an interrupt leaves behind: nothing, or the watched paths written so far."""
        written = self.written()
        return f"already written: {', '.join(written)}" if written else signals.NOTHING_WRITTEN

    def print_json(self, text: str) -> None:
        """Print the command's JSON report on stdout, when asked for and not printed yet."""
        if self.json_stdout and not self._printed:
            self._printed = True
            click.echo(text, file=self.stdout)

    def start(self, json_stdout: bool, inputs: str | list[str], *, quiet: bool = False) -> None:
        """A command starts: whether it prints its JSON on stdout, its input(s) for the error
        object, and ``-q``; from here on stdout is this tool's alone (see :meth:`divert`)."""
        self.json_stdout = json_stdout
        self.inputs = inputs
        self.quiet = quiet
        self.divert()

    def divert(self) -> None:
        """From here on stdout is the tool's alone (see :class:`~onnx_conv2matmul.cli.streams.Diversion`);
        the JSON goes through :attr:`stdout`, the real one."""
        self.stdout = self._diversion.divert(self.stdout, lambda: self.quiet)

    def undiverted(self) -> contextlib.AbstractContextManager[None]:
        """Descriptor 1 as it was, for a write to a path the user named (``/dev/stdout``)."""
        return self._diversion.undiverted(self.stdout)

    def restore(self) -> None:
        """Stdout as it was before :meth:`divert`."""
        self.stdout = self._diversion.restore(self.stdout)

    def error_json(self, code: int, error: str) -> str:
        """The error object a run that ends without its report gives instead."""
        return json.dumps(ErrorReport(self.command, code, error, self.inputs).to_dict(), indent=2)

    def print_error_json(self, code: int, error: str) -> None:
        """Print the error object instead of a report, when asked for and nothing printed yet."""
        self.print_json(self.error_json(code, error))

    def claim_report(
        self,
        path: str | None,
        *,
        inputs: list[str],
        outputs: list[str],
        read: Iterable[str] = (),
        checked: bool = False,
    ) -> None:
        """``--report-json PATH`` (None: not asked for), checked as a place to write before any
        other work (see :func:`~onnx_conv2matmul.files.checks.check_report_target`; ``checked``:
        the command did, with the other files it writes) and watched: from then on it gets the
        error object when the run ends before the command wrote its report there."""
        if path is None:
            return
        if not checked:
            check_report_target(path, inputs=inputs, outputs=outputs, read=read)
        self.watch(path)
        self.report_path = path

    def report_written(self) -> None:
        self._report_written = True

    def finish(self, code: int) -> None:
        """The exit: a failure that printed no report prints the error object instead, on stdout
        (``--report-json-stdout``) and into the ``--report-json`` file."""
        if code == 0:
            return
        if self.quiet and self.error is None and self.failure:  # -q silences tables, not the error
            with contextlib.suppress(OSError):
                click.echo(f"error: {self.failure}", err=True)
        error = self.error or self.failure or f"exit code {code}"
        with contextlib.suppress(OSError):  # a closed pipe: nothing more to say
            self.print_error_json(code, error)
        path = self.report_path if self.report_path is not None else self._unparsed_report(code)
        if path is not None and not self._report_written:
            from onnx_conv2matmul.files import load as _io

            # A closed or broken path: the error line already says what went wrong.
            with contextlib.suppress(OSError), self.undiverted():
                _io.write_text_atomic(path, self.error_json(code, error) + "\n")

    def _unparsed_report(self, code: int) -> str | None:
        """On a usage error the command line was not parsed, so the report's place was never
        checked: the ``--report-json`` path given, only where writing cannot hurt (no file there
        yet, or one of this tool's reports) and no other argument names it."""
        if code != ExitCode.USAGE or not self.unparsed:
            return None
        argv = self.argv[: self.argv.index("--")] if "--" in self.argv else self.argv
        path = None
        for index, token in enumerate(argv):
            if token == "--report-json" and index + 1 < len(argv):
                path = argv[index + 1]
            elif token.startswith("--report-json="):
                path = token.split("=", 1)[1]
        if not path or path.startswith("-") or argv.count(path) > 1:
            return None
        if os.path.lexists(path):
            try:
                if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > 2**20:
                    return None
                with open(path, encoding="utf-8") as handle:
                    previous = json.load(handle)
            except (OSError, ValueError):
                return None
            report = isinstance(previous, dict) and previous.get("tool") == "onnx-conv2matmul"
            if not report or "schema_version" not in previous or "return_code" not in previous:
                return None  # not one of this tool's reports (its folder mark is JSON too)
        return path


OUTCOME = Outcome()


def quiet_onnxruntime() -> None:
    """Keep onnxruntime's own log lines (its C++ default logger) off the terminal: a failure
    reaches the user as the one error line, which carries onnxruntime's message. Sessions the
    package opens set their own severity to fatal as well. Called by the commands that run
    models; it imports onnxruntime, so ``convert`` without a check does not pay for it."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)


def stderr_console(quiet: bool) -> Console:
    from rich.console import Console  # imported when needed: convert starts its copy first

    OUTCOME.quiet = quiet
    # Off a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
    return Console(stderr=True, quiet=quiet, width=None if sys.stderr.isatty() else 160)


def fail(message: str, code: int) -> NoReturn:
    from rich.console import Console
    from rich.markup import escape

    OUTCOME.error = message
    Console(stderr=True).print(
        f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True
    )
    sys.exit(code)


@contextmanager
def handled_errors(*, click_shows_usage: bool = False) -> Iterator[None]:
    """Map every exception to one line on stderr and an exit code; never a traceback.

    The exit code is :func:`onnx_conv2matmul.errors.exit_code_for`'s (click's usage errors:
    2); an internal error (3) gets its traceback printed first with ONNX_CONV2MATMUL_DEBUG=1,
    which changes only what is printed, never the exit code.
    The message of an error of this package gets the flag its hint names (see
    :data:`HINTS`). With ``click_shows_usage`` click's usage errors go on to click, which
    prints the usage too.
    """
    try:
        # Stdout is diverted while a command works (Outcome.divert): what a library prints there
        # goes to stderr, or nowhere with -q.
        yield
    except (click.exceptions.Exit, click.Abort):
        raise  # --help, --version: click ends the run
    except click.ClickException as err:
        if click_shows_usage:
            OUTCOME.error = err.format_message()
            OUTCOME.unparsed = True
            raise
        fail(err.format_message(), ExitCode.USAGE)
    except OptionConflict as err:
        fail(err.template.format(*map(flag_for, err.options)), ExitCode.USAGE)
    except Conv2MatMulError as err:
        fail(with_hint(str(err), err.hint) + _address_space_note(err), exit_code_for(err))
    except KeyboardInterrupt as interrupt:
        fail(signals.interrupted_message(interrupt, OUTCOME.interrupted_detail()), exit_code_for(interrupt))
    except MemoryError as err:
        fail(_out_of_memory(err), exit_code_for(err))
    except OSError as err:
        if is_out_of_memory(err):
            fail(_out_of_memory(err), exit_code_for(err))
        fail(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "), exit_code_for(err))
    except Exception as err:
        if is_out_of_memory(err):  # onnxruntime's bad_alloc or failed allocation: not a bug
            fail(_out_of_memory(err), exit_code_for(err))
        if os.environ.get("ONNX_CONV2MATMUL_DEBUG"):  # more said, the same exit code
            import traceback

            with contextlib.suppress(OSError, ValueError):
                traceback.print_exc(file=sys.stderr)
        fail(internal_error(err), exit_code_for(err))


# Options whose flag is not their name with dashes.
_FLAGS = {
    "symmetric": "--symmetric/--asymmetric",
    "other_weights_int8": "--other-weights int8",
    "nodes": "the settings file's nodes",
    "bench_mode": "--bench",
}


def flag_for(option: str) -> str:
    """The command line's words for an option the library names by its field."""
    return _FLAGS.get(option, "--" + option.replace("_", "-"))


def _out_of_memory(err: BaseException) -> str:
    """One line for memory that ran out outside the check (the check names its option itself)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    line = f"out of memory: {first}" if first and "out of memory" not in first.lower() else "out of memory"
    return line + _address_space_note(err)


def _address_space_note(err: BaseException) -> str:
    """For memory that ran out under a limit on this process's address space (``ulimit -v``,
    ``prlimit --as``), the limit, which may be what ran out rather than the memory."""
    if not is_out_of_memory(err):
        return ""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return ""
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" (this process may use at most {soft / 2**30:.1f} GiB of address space: ulimit -v sets it)"


# Hints worded without a flag that this invocation refuses (see :func:`refused_flags`).
_WITHOUT: dict[Hint, dict[str, str | None]] = {
    Hint.VERIFY_BUDGET: {"--verify-lengths": "--verify-memory SIZE raises the budget"},
    Hint.VERIFY_OUT_OF_MEMORY: {"--verify-lengths": "--verify-memory SIZE lowers what the check holds"},
    Hint.SYNTHESISED_SHAPES: {"--verify-dim": "check the --inputs files: the model cannot run on them"},
}


def refused_flags(ctx: click.Context) -> set[str]:
    """The flags this invocation of its command refuses although the command has them:
    real inputs (``--inputs``) exclude the synthesis's lengths, values and dims; ``bench``
    times batch 1 at its own lengths."""
    refused = set()
    if ctx.params.get("inputs"):
        refused |= {"--verify-input", "--verify-dim", "--verify-lengths"}
    if ctx.command.name == "bench":
        refused |= {"--verify-lengths", "--verify-batch"}
    return refused


def hint_text(hint: Hint, ctx: click.Context | None) -> str | None:
    """How ``hint`` reads in this invocation: None when the command lacks its flag, or every
    flag it could name is refused here; never a flag the same invocation refuses."""
    option, text = HINTS[hint]
    if ctx is None or option not in {param.name for param in ctx.command.params}:
        return None
    refused = refused_flags(ctx)
    if hint is Hint.VERIFY_INPUTS:  # a list of flags: those this invocation takes
        names = {param.name for param in ctx.command.params}
        usable = [f for f in text.split(", ") if f not in refused]
        if "bench_lengths" in names and ctx.command.name == "bench":
            usable.append("--bench-lengths")
        return ", ".join(usable) or None
    for flag, instead in _WITHOUT.get(hint, {}).items():
        if flag in refused:
            if instead is None:
                return None
            text = instead
    return text


def with_hint(message: str, hint: Hint | None) -> str:
    """``message (hint)``, the hint worded with the flag it names, when this command has that
    flag and this invocation does not refuse it (:func:`hint_text`)."""
    if hint is None:
        return message
    text = hint_text(hint, click.get_current_context(silent=True))
    return message if text is None else f"{message} ({text})"


def internal_error(err: Exception) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    return (
        f"internal error: {err.__class__.__name__}: {first} -- a bug in onnx-conv2matmul {__version__},"
        " please report it (set ONNX_CONV2MATMUL_DEBUG=1 for a traceback)"
    )


def emit_report(report: CommandReport, path: str | None, error: str | None = None) -> None:
    """The JSON report to ``path`` and/or stdout; ``error`` words a failure (default: the report's).

    Called last, after the tables: nothing may follow the object on stdout.
    """
    from onnx_conv2matmul.cli import render

    text = render.report_json(report, error=error)
    if report.return_code != 0:
        OUTCOME.failure = error or report.failure
    if path is not None:
        from onnx_conv2matmul.files import load as _io

        with OUTCOME.undiverted():
            _io.write_text_atomic(path, text + "\n")
        OUTCOME.report_written()
    OUTCOME.print_json(text)


class RichProgress:
    """One bar on stderr whose label follows the step, named with its phase (``[quantize]
    Quantizing``); the steps that count their work (the save counts tensors) show an estimate of
    the time left."""

    def __init__(self, console: Console) -> None:
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),  # the estimate, for the steps that count their work
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("Starting", total=None)
        self._progress.start()

    def phase(self, name: str) -> None:
        # A new task per phase: rich's update() cannot set a known total back to unknown.
        self._progress.remove_task(self._task)
        from rich.markup import escape

        from onnx_conv2matmul.quantize.plan import phase_of

        # The phase is named after the step when the step's words do not already say it (rich
        # reads square brackets as markup: escaped).
        phase = phase_of(name)
        words = name.lower().replace("-", " ")
        label = name if phase == "other" or phase.split()[0] in words else f"{name} ({phase})"
        self._task = self._progress.add_task(escape(label), total=None)

    def advance(self, done: int, total: int) -> None:
        self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        self._progress.stop()


def progress_for(console: Console, input_path: str, quiet: bool) -> Progress | None:
    """A progress bar for models above ~100 MB, only when stderr is a terminal."""
    from onnx_conv2matmul.files.paths import model_file_bytes

    if quiet or not console.is_terminal or model_file_bytes(input_path) < PROGRESS_MIN_BYTES:
        return None
    return RichProgress(console)


def files_read(
    inputs: tuple[str, ...] | list[str] = (), validate: str | None = None, config: str | None = None
) -> list[str]:
    """The files a run reads besides its models, which no output or report may overwrite:
    the ``--inputs`` files or folders, the ``--config`` settings file, and the file of a
    ``--validate path/to/file.py:function`` (a module named by its dotted name is not a path)."""
    read = [*inputs]
    if config is not None:
        read.append(config)
    if validate is not None and ":" in validate:
        module = validate.rsplit(":", 1)[0]
        if module.endswith(".py") or os.sep in module:
            read.append(module)
    return read
