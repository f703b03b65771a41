"""The user's own accuracy measure as the quantization target.

A validation function takes the path of a model file and returns a score, higher is better
(top-1 accuracy, ``1 - CER``, ``-WER``, a BLEU score...). The original model is scored once;
a quantized model meets the target when its score has dropped by at most ``max_drop``: an
absolute difference (``original - score``), or with ``relative`` that difference over the
original's magnitude. A score above the original's is no drop at all. These are the
semantics of NNCF's ``quantize_with_accuracy_control`` (``max_drop``, ``DropType``), with a
file path in place of an in-memory model, so that any runtime can load it.

The function runs in this process, on files the tool writes; it must not keep them open or
change them. Whatever it raises, and a result that is not a finite number, is the user's to
fix: :class:`~onnx_conv2matmul.errors.ValidationError` (exit code 2).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from onnx_conv2matmul.errors import ValidationError

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
        try:
            value = self.validate(path)
        except Exception as err:  # the user's code: any failure is theirs to fix
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            detail = f"{type(err).__name__}: {first}" if first else type(err).__name__
            raise ValidationError(f"the validation function {self.label} failed on {what}: {detail}") from err
        number = _as_float(value)
        if number is None or not math.isfinite(number):
            raise ValidationError(
                f"the validation function {self.label} returned {value!r} for {what}:"
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
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except ValidationError:
        raise
    except Exception as err:  # an ImportError, or whatever the module raises on import
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValidationError(f"cannot import {module_name} for the validation function: {first}") from err
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValidationError(f"{module_name} has no {attribute} for the validation function")
    if not callable(target):
        raise ValidationError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def _module_from_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ValidationError(f"no such file for the validation function: {path}")
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
