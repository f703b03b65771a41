"""The commands' reports: typed data sharing one JSON envelope, rendered elsewhere (``render.py``).

Every JSON object the command line prints or writes comes from :func:`envelope`: a command's
report (:class:`CommandReport`: convert, verify, quantize, bundle, inspect) or, when a command ends
without one, an :class:`ErrorReport`. ``schema/report.schema.json`` in the source tree
describes them all.

This module imports nothing heavy (the console entry point may use it before anything else):
the types of other modules it names are for type checking only.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar

from onnx_conv2matmul._version import __version__
from onnx_conv2matmul.errors import ExitCode

SCHEMA_VERSION = 2
TOOL = "onnx-conv2matmul"


class Command(str, enum.Enum):
    """The commands that print a report."""

    CONVERT = "convert"
    VERIFY = "verify"
    QUANTIZE = "quantize"
    BUNDLE = "bundle"
    INSPECT = "inspect"
    BENCH = "bench"


# The commands that take several inputs: their envelope has ``inputs`` (a list), not ``input``.
_SEVERAL_INPUTS = frozenset({Command.VERIFY.value, Command.BENCH.value})
_ENVELOPE_KEYS = ("schema_version", "tool", "version", "command", "input", "inputs", "return_code", "error")


def envelope(
    command: Command | str | None,
    *,
    inputs: str | list[str] | None,
    return_code: int,
    error: str | None,
    body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The one JSON object of a command: the envelope, then the command's own ``body``.

    The envelope is ``schema_version``, ``tool``, ``version``, ``command`` (None when not
    known), ``input`` (or, for ``verify``, ``inputs``: a list; None when not known),
    ``return_code`` and ``error``.

    Raises:
        ValueError: ``error`` is None while ``return_code`` is not 0, or the other way round
            (``error`` is null exactly when the command succeeded); ``inputs`` does not suit
            the command; or ``body`` repeats an envelope key.
    """
    if (error is None) != (return_code == ExitCode.OK):
        raise ValueError(f"error must be null exactly when return_code is 0: {return_code}, {error!r}")
    name = command.value if isinstance(command, Command) else command
    several = name in _SEVERAL_INPUTS
    if inputs is not None and isinstance(inputs, list) != several:
        raise ValueError(f"command {name!r} takes {'a list of inputs' if several else 'one input'}")
    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": TOOL,
        "version": __version__,
        "command": name,
        "inputs" if several else "input": inputs,
        "return_code": return_code,
        "error": error,
    }
    clash = [key for key in body or {} if key in _ENVELOPE_KEYS]
    if clash:
        raise ValueError(f"the body repeats envelope keys: {clash}")
    data.update(body or {})
    return data


class CommandReport(abc.ABC):
    """What a command did, as data; :meth:`to_dict` is its JSON object.

    ``return_code`` is the command line's exit code; ``failure`` says why it is not 0 (None
    exactly when it is 0), in words that name no command-line flag.
    """

    COMMAND: ClassVar[Command]

    @property
    @abc.abstractmethod
    def return_code(self) -> int: ...

    @property
    @abc.abstractmethod
    def failure(self) -> str | None: ...

    @property
    @abc.abstractmethod
    def inputs(self) -> str | list[str] | None:
        """The envelope's ``input`` (or ``inputs`` for ``verify`` and ``bench``)."""

    @abc.abstractmethod
    def body(self) -> dict[str, Any]:
        """The command's own keys, after the envelope."""

    def to_dict(self, *, error: str | None = None) -> dict[str, Any]:
        """The report as one JSON object (see :func:`envelope`).

        ``error``: the message of a failed run in the caller's words (the command line
        names its flags); by default :attr:`failure`.
        """
        return envelope(
            self.COMMAND,
            inputs=self.inputs,
            return_code=self.return_code,
            error=self.failure if error is None else error,
            body=self.body(),
        )


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """The object printed instead of a report when a command ends without one.

    An error, a usage error or an interrupt: the envelope alone, ``return_code`` not 0.
    """

    command: str | None
    return_code: int
    error: str
    inputs: str | list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return envelope(self.command, inputs=self.inputs, return_code=self.return_code, error=self.error)
