"""Import onnx-ir without importing sympy until something uses it.

onnx-ir imports sympy when it is itself imported, for arithmetic on symbolic
dimensions (``SymbolicDim("T") + 1``), which this tool never does. sympy takes
0.3-0.4 s to import: a third of the start-up time of every command.

While :func:`import_onnx_ir` imports onnx-ir, onnx-ir's own ``import sympy`` gets a
stand-in, and its expression parser (which reads sympy attributes when it runs) is
a stand-in module. The first attribute read from either imports the real module and
is answered by it, so symbolic arithmetic still works, unchanged. ``sys.modules``
never holds a stand-in for sympy, so other code importing sympy is not affected.
Python's ``importlib.util.LazyLoader`` cannot do this: a later ``import`` of a lazy
module reads its ``__spec__``, which makes it load at once.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from typing import Any

_LOCK = threading.RLock()
_PARSER = "onnx_ir._symbolic_shapes"


class _SympyStandIn:
    """What onnx-ir's modules see as ``sympy``: the real one, imported on first use."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module("sympy"), attr)

    def __repr__(self) -> str:
        return "<sympy, imported on first use>"


class _ModuleStandIn(types.ModuleType):
    """Holds a module's place in ``sys.modules`` until one of its attributes is read."""

    def __getattr__(self, attr: str) -> Any:
        with _LOCK:
            module = sys.modules.get(self.__name__)
            if module is self:
                del sys.modules[self.__name__]
                try:
                    module = importlib.import_module(self.__name__)
                except BaseException:
                    sys.modules[self.__name__] = self
                    raise
            elif module is None:
                module = importlib.import_module(self.__name__)
        return getattr(module, attr)


def import_onnx_ir() -> None:
    """Import onnx-ir with sympy deferred; a plain import if onnx-ir or sympy is already loaded."""
    if "onnx_ir" in sys.modules or "sympy" in sys.modules:
        return
    package = importlib.util.find_spec("onnx_ir")
    if package is None or package.submodule_search_locations is None:
        return
    # Found without importing onnx_ir itself, which would import sympy.
    parser = importlib.machinery.PathFinder.find_spec(_PARSER, list(package.submodule_search_locations))
    if parser is None:
        return
    stand_in = _ModuleStandIn(_PARSER)
    stand_in.__spec__ = parser  # a real attribute: the import system reads it
    sys.modules[_PARSER] = stand_in
    sympy = _SympyStandIn()
    real_import = builtins.__import__

    def import_hook(
        name: str,
        globals: Mapping[str, object] | None = None,
        locals: Mapping[str, object] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> Any:
        importer = str((globals or {}).get("__name__", ""))
        if name == "sympy" and level == 0 and not fromlist and importer.startswith("onnx_ir"):
            return sympy
        return real_import(name, globals, locals, fromlist or (), level)

    builtins.__import__ = import_hook
    try:
        import onnx_ir  # noqa: F401
    except BaseException:
        if sys.modules.get(_PARSER) is stand_in:
            del sys.modules[_PARSER]
        raise
    finally:
        builtins.__import__ = real_import
