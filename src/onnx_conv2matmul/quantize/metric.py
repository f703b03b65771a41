"""The user's own accuracy measure as the quantization target.

A validation function takes the path of a model file and returns a score, higher is better
(top-1 accuracy, ``1 - CER``, ``-WER``, a BLEU score...). The original model is scored once;
a quantized model meets the target when its score has dropped by at most ``max_drop``: an
absolute difference (``original - score``), or with ``relative`` that difference over the
original's magnitude. A score above the original's is no drop at all. These are the
semantics of NNCF's ``quantize_with_accuracy_control`` (``max_drop``, ``DropType``), with a
file path in place of an in-memory model, so that any runtime can load it.

The function runs in this process, on files the tool writes; it must not keep them open or
change them. It is fenced (:func:`fenced`), and so is the import of its module: whatever it
raises (``SystemExit`` from ``sys.exit`` included), a result that is not a finite number, and a
change to the process it runs in (working directory, ``sys.argv``, the environment, the
standard streams, the handlers of SIGINT, SIGTERM and SIGHUP) are the user's to fix:
:class:`~onnx_conv2matmul.errors.ValidationError` (exit code 2), one line naming the function,
with the process put back as it was. The user's code sees ``sys.argv`` as ``[the function's
name]``, never the tool's own arguments, so a module that parses its command line at import
finds nothing of ours there. A ``KeyboardInterrupt`` is not fenced: it cannot be told from
Ctrl-C (or the SIGTERM the command line turns into one), so the run ends as interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from onnx_conv2matmul.errors import ValidationError, first_line
from onnx_conv2matmul.files.checks import fingerprint

DEFAULT_MAX_DROP = 0.01
"""The default largest drop of the score: 0.01 absolute (NNCF's default too)."""

Validate = Callable[[str], float]


@dataclasses.dataclass(frozen=True)
class MetricTarget:
    """A validation function and the largest drop of its score a quantized model may show.

    Attributes:
        validate: Called with the path of a model file; returns its score (higher is better).
        max_drop: The largest drop allowed, at least 0.
        relative: The drop is ``(original - score) / |original|`` instead of ``original - score``.
        name: How reports name the function (``package.module:function``); the function's
            qualified name when empty.
    """

    validate: Validate
    max_drop: float = DEFAULT_MAX_DROP
    relative: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.validate):
            raise ValueError("the validation function must be callable")
        if isinstance(self.max_drop, bool) or not math.isfinite(self.max_drop) or self.max_drop < 0:
            raise ValueError(f"the largest drop must be a finite number >= 0, got {self.max_drop!r}")

    @property
    def label(self) -> str:
        """The function's name for reports."""
        if self.name:
            return self.name
        module = getattr(self.validate, "__module__", None) or "?"
        return f"{module}:{getattr(self.validate, '__qualname__', type(self.validate).__name__)}"

    @property
    def max_drop_text(self) -> str:
        """``0.01`` or ``1%``."""
        return f"{self.max_drop * 100:g}%" if self.relative else f"{self.max_drop:g}"

    def score(self, path: str, what: str) -> float:
        """The function's score of the model at ``path`` (``what`` names it in errors).

        Raises:
            ValidationError: the function raised, or returned something other than a finite number.
        """
        before = _fingerprints(path)
        with fenced(f"the validation function {self.label}", f"on {what}", capture=True):
            value = self.validate(path)
            number = _as_float(value)
        changed = sorted(name for name, mark in before.items() if fingerprint(name) != mark)
        if changed:
            raise ValidationError(
                f"the validation function {self.label} changed {', '.join(changed)} while scoring {what}:"
                " the model it scored is not the one that would be written (it may only read the file)"
            )
        if number is None or not math.isfinite(number):
            raise ValidationError(
                f"the validation function {self.label} returned {_short(value)} for {what}:"
                " a finite number is needed"
            )
        return number

    def drop(self, original: float, score: float) -> float:
        """How far ``score`` fell below ``original`` (negative when it rose)."""
        difference = original - score
        if not self.relative:
            return difference
        if original == 0:
            return 0.0 if difference <= 0 else math.inf
        return difference / abs(original)

    def meets(self, original: float, score: float) -> bool:
        return score >= original or self.drop(original, score) <= self.max_drop

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.label, "max_drop": self.max_drop, "relative": self.relative}


def _fingerprints(path: str) -> dict[str, tuple[int, ...] | None]:
    """The :func:`~onnx_conv2matmul.files.checks.fingerprint` of the model at ``path`` and of
    each data file it reads."""
    from onnx_conv2matmul.files.paths import files_read_by

    return {name: fingerprint(name) for name in files_read_by(path)}


def _as_float(value: object) -> float | None:
    """A Python or numpy number (a 0-d or one-element array too) as a float; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        import numpy as np

        array = np.asarray(value)
    except Exception:
        return None
    if array.size != 1 or not np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_:
        return None
    return float(array.reshape(()))


_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _short(value: object) -> str:
    """A one-line repr of the user's value, at most 60 characters (a failing repr is named as such)."""
    try:
        text = repr(value)
    except Exception:
        text = f"a {type(value).__name__} whose repr fails"
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def _named(err: BaseException) -> str:
    """``err``'s type and first line: a user's function can raise anything."""
    return f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else type(err).__name__


@contextlib.contextmanager
def fenced(who: str, when: str, *, capture: bool = False) -> Iterator[None]:
    """Run the user's code in the block as a guest: see the module docstring.

    ``who`` names the code (``the validation function m:f``), ``when`` the moment (``on the
    input model``). With ``capture``, what it prints while the block runs is held back and
    written to stderr only when it succeeds (a module's usage text on a failed import is not
    shown as if it were the tool's).

    Raises:
        ValidationError: the code raised (``KeyboardInterrupt`` aside), exited, or changed the process.
    """
    cwd = _cwd()
    argv, argv_list = sys.argv, list(sys.argv)
    environ = dict(os.environ)
    streams = (sys.stdin, sys.stdout, sys.stderr)
    handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    held = io.StringIO()
    failure: str | None = None
    given = [who.rsplit(" ", 1)[-1]]
    sys.argv = given
    if capture:
        sys.stdout = sys.stderr = held
    try:
        yield
    except (KeyboardInterrupt, ValidationError):
        raise
    except SystemExit as err:
        failure = f"{who} called sys.exit({err.code!r}) {when}"
    except BaseException as err:  # the user's code: any failure is theirs to fix
        failure = f"{who} failed {when}: {_named(err)}"
    finally:
        if capture:  # the streams held back are ours: put back whatever the user's code left as is
            if sys.stdout is held:
                sys.stdout = streams[1]
            if sys.stderr is held:
                sys.stderr = streams[2]
        changed = (
            ["sys.argv"] if sys.argv is not given or given != [who.rsplit(" ", 1)[-1]] else []
        ) + _put_back(cwd, argv, argv_list, environ, streams, handlers)
        if capture and failure is None and held.getvalue():
            sys.stderr.write(held.getvalue())
    if failure is not None:
        raise ValidationError(failure)
    if changed:
        raise ValidationError(
            f"{who} changed {', '.join(changed)} {when}: it must leave the process as it found it (put back)"
        )


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:
        return None


def _put_back(
    cwd: str | None,
    argv: list[str],
    argv_list: list[str],
    environ: dict[str, str],
    streams: tuple[Any, Any, Any],
    handlers: dict[int, Any],
) -> list[str]:
    """Restore what :func:`fenced` saw before the user's code ran; name what had changed."""
    changed = []
    if cwd is not None and _cwd() != cwd:
        changed.append("the working directory")
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    if argv[:] != argv_list:
        argv[:] = argv_list
    sys.argv = argv
    if dict(os.environ) != environ:
        changed.append("the environment")
        for key in [k for k in os.environ if k not in environ]:
            del os.environ[key]
        os.environ.update(environ)
    if (sys.stdin, sys.stdout, sys.stderr) != streams:
        changed.append("the standard streams")
        sys.stdin, sys.stdout, sys.stderr = streams
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler:
            changed.append(f"the handler of {signal.Signals(signum).name}")
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
    return changed


def load_function(spec: str) -> Validate:
    """The callable ``spec`` names: ``package.module:function`` (importable from ``sys.path``)
    or ``path/to/file.py:function`` (its folder is added to ``sys.path``, so modules beside it
    import); the attribute may be dotted (``module:Class.method``).

    Raises:
        ValidationError: ``spec`` is malformed, the module cannot be imported, or it has no such callable.
    """
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValidationError(f"name the validation function as package.module:function, got {spec!r}")
    if module_name.endswith(".py") and not os.path.isfile(module_name):
        raise ValidationError(f"no such file for the validation function: {module_name}")
    with fenced(f"the validation function {spec}", "at the import of its module", capture=True):
        if module_name.endswith(".py"):
            module = _module_from_file(module_name)
        else:
            module = importlib.import_module(module_name)
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValidationError(f"{module_name} has no {attribute} for the validation function")
    if not callable(target):
        raise ValidationError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def _module_from_file(path: str) -> Any:
    name = "_onnx_conv2matmul_validate_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValidationError(f"cannot import {path} for the validation function")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # its own helpers beside it import too
    spec.loader.exec_module(module)
    return module
