"""Every exception the package raises on purpose, and the exit code each one ends a command with.

The mapping from exception to exit code lives here only (:func:`exit_code_for`, over
:data:`EXIT_CODES`); the command line asks it. Messages are worded for any caller and name no
command-line flag: an error that the user can fix by changing an option carries a :class:`Hint`,
which a front end words in its own terms (the CLI names its flags).

This module imports nothing heavy: the console entry point uses it before anything else.
"""

from __future__ import annotations

import enum
import errno
import signal


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (for a one-line error), or its type's name when the
    message is empty."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class ExitCode(enum.IntEnum):
    """The command line's exit codes, except 128 + signal for an interrupt (:func:`exit_code_for`)."""

    OK = 0
    """Success."""
    FAILED = 1
    """Verification or the accuracy check failed, or the ONNX checker rejected the output."""
    USAGE = 2
    """Usage, input or system error (a bad path or option, a full disk, out of memory)."""
    INTERNAL = 3
    """Any other exception: a bug."""


INTERRUPTED_BASE = 128
"""An interrupt exits with this plus the signal number: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP."""


class Hint(enum.Enum):
    """What the user can change to get past an error, named in the library's terms.

    A front end words each hint itself; the command line names the flag (and shows the hint
    only for a command that has that flag).
    """

    OUTPUT_IS_INPUT = "replace the input in place instead of naming it as the output"
    NO_OUTPUT = "give an output path, or replace the input in place"
    OUTPUT_AND_INPLACE = "give an output path or replace the input in place, not both"
    SKIP_INPUT_CHECKER = "skip the ONNX checker (run_checker=False)"
    VERIFY_INPUTS = "fix the synthesised inputs: input values, dim values or lengths (VerifyOptions)"
    NOT_INT8_DYNAMIC = "use MatMulNBits quantization, which takes the model"
    KEPT_PATH = "remove what is at the path where a failed output is kept"
    CALIBRATION_INPUTS = "give real inputs of the model (VerifyOptions.feeds, load_inputs)"
    SYNTHESISED_SHAPES = "give real inputs (VerifyOptions.feeds), or the dims' values (VerifyOptions.dims)"
    CLASSIFIER_INPUTS = (
        "give real inputs (VerifyOptions.feeds), or judge by the cosine alone (VerifyOptions.labels='cosine')"
    )
    INPUT_FILES = "fix the real inputs given (VerifyOptions.feeds): the model cannot run on them"
    VERIFY_BUDGET = "raise the check's memory budget (VerifyOptions.memory), or give shorter lengths"
    VERIFY_OUT_OF_MEMORY = "lower the check's memory budget (VerifyOptions.memory), or give shorter lengths"


class Conv2MatMulError(Exception):
    """Base class of this package's errors.

    Attributes:
        hint: What the user can change to fix it, when an option can (``None`` otherwise).
    """

    default_hint: Hint | None = None

    def __init__(self, message: str, *, hint: Hint | None = None) -> None:
        super().__init__(message)
        self.hint = hint if hint is not None else self.default_hint


class InputError(Conv2MatMulError):
    """Bad input, output path or option: the user can fix it."""


class OptionConflict(InputError):
    """Options that cannot be applied as given: missing one they need, or combined with one that
    would not be applied.

    ``template`` names them ``{0}``, ``{1}``, ...; ``options`` are their names as the API has
    them (fields of the options types, e.g. ``bits_for``). The message fills in those names; the
    command line fills in its flags instead.
    """

    def __init__(self, template: str, *options: str) -> None:
        super().__init__(template.format(*options))
        self.template = template
        self.options = options


class ValidationError(InputError):
    """The user's validation function cannot be loaded, fails, or returns no number."""


class DestinationBusy(InputError):
    """Another process is writing the same destination."""


class ModeRefused(InputError):
    """The quantization mode asked for cannot meet the criterion on this model with any node it
    takes (``--int8-dynamic``'s step back had nothing left to try)."""


class ModelRunError(Conv2MatMulError):
    """onnxruntime could not load or run a model on the synthesised inputs."""

    default_hint: Hint | None = Hint.VERIFY_INPUTS


class ModelLoadError(ModelRunError):
    """onnxruntime could not load a model at all: no input or length can fix that, so no hint."""

    default_hint = None


class OutOfMemory(Conv2MatMulError):
    """Memory ran out: numpy's ``MemoryError`` or an allocation onnxruntime could not make."""


class CheckerError(Conv2MatMulError):
    """The ONNX checker rejected the rewritten model."""


class TargetUnreachable(Conv2MatMulError):
    """The accuracy asked for is not met even with every weight left in float."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived while the console entry point ran.

    Raised by the handler :func:`onnx_conv2matmul.cli.signals.install_signal_handlers` installs,
    so a SIGTERM or SIGHUP unwinds like Ctrl-C and every cleanup runs; the exit code is 128 + ``signum``.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (InputError, ExitCode.USAGE),  # DestinationBusy included
    (OutOfMemory, ExitCode.USAGE),
    (ModelRunError, ExitCode.USAGE),
    (CheckerError, ExitCode.FAILED),
    (TargetUnreachable, ExitCode.FAILED),
    (Conv2MatMulError, ExitCode.FAILED),
    (MemoryError, ExitCode.USAGE),
    (OSError, ExitCode.USAGE),
)
"""Exception class to exit code, first match wins; an interrupt and anything else: see
:func:`exit_code_for`."""


def exit_code_for(error: BaseException) -> int:
    """The exit code a command ends with when ``error`` ends it.

    128 + signal for an interrupt (:class:`Interrupted`, or a plain ``KeyboardInterrupt``
    taken as SIGINT); :attr:`ExitCode.USAGE` for memory exhaustion, whatever raised it (see
    :func:`is_out_of_memory`); the first match in :data:`EXIT_CODES`; otherwise
    :attr:`ExitCode.INTERNAL`. A command-line usage error (the parser's) is
    :attr:`ExitCode.USAGE`; the command line maps those itself, as this module knows no parser.
    """
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED_BASE + getattr(error, "signum", signal.SIGINT)
    if is_out_of_memory(error):
        return int(ExitCode.USAGE)
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return int(code)
    return int(ExitCode.INTERNAL)


_OUT_OF_MEMORY_TEXT = ("bad_alloc", "failed to allocate", "out of memory", "cannot allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says memory ran out: :class:`OutOfMemory`, ``MemoryError``, an
    ``OSError`` of ``ENOMEM``, or a message of onnxruntime's or the C++ runtime's
    (``std::bad_alloc``, "Failed to allocate memory")."""
    if isinstance(error, OutOfMemory | MemoryError):
        return True
    if isinstance(error, OSError) and error.errno == errno.ENOMEM:
        return True
    text = str(error).lower()
    return any(marker in text for marker in _OUT_OF_MEMORY_TEXT)
