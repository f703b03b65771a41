"""Defer onnx-ir's import of sympy until something uses it: for the console script only.

onnx-ir imports sympy, a large share of a command's start-up, for arithmetic on symbolic
dimensions (``SymbolicDim("T") + 1``), which this tool never does. :func:`install` changes
how the interpreter imports onnx-ir, so only the console entry point calls it, in a process
of its own (:func:`onnx_conv2matmul.cli.entry.run`); importing the library never does.

While onnx-ir's package first runs, wherever it is imported from, its ``import sympy`` gets
a stand-in, and its expression parser (which reads sympy attributes when it runs) is a
stand-in module. The first attribute read from either imports the real module and is
answered by it, so symbolic arithmetic still works, unchanged. ``sys.modules`` never holds a
stand-in for sympy. (``importlib.util.LazyLoader`` cannot do this: a later ``import`` of a
lazy module reads its ``__spec__``, which makes it load at once.)
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

_LOCK = threading.RLock()
_PARSER = "onnx_ir._symbolic_shapes"


class _Sympy:
    """What onnx-ir's modules see as ``sympy``: the real one, imported on first use."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module("sympy"), attr)


class _Parser(types.ModuleType):
    """Holds the parser's place in ``sys.modules`` until one of its attributes is read."""

    def __getattr__(self, attr: str) -> Any:
        with _LOCK:
            if sys.modules.get(_PARSER) is self:
                del sys.modules[_PARSER]
                try:
                    importlib.import_module(_PARSER)
                except BaseException:
                    sys.modules[_PARSER] = self
                    raise
        return getattr(importlib.import_module(_PARSER), attr)


class _Finder:  # a meta path finder and loader, without importing importlib.abc (slow to import)
    """Finds ``onnx_ir`` once, and runs its package with sympy deferred."""

    def find_spec(self, fullname: str, *_: Any) -> importlib.machinery.ModuleSpec | None:
        if fullname != "onnx_ir":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # used once
        spec = importlib.util.find_spec("onnx_ir")
        if spec is not None and spec.loader is not None and "sympy" not in sys.modules:
            self._loader = spec.loader
            spec.loader = self  # type: ignore[assignment]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader  # its own loader back (resource readers, reloads)
        spec = module.__spec__
        locations = spec.submodule_search_locations if spec is not None else None
        if spec is not None:
            spec.loader = self._loader
        parser = importlib.machinery.PathFinder.find_spec(_PARSER, list(locations)) if locations else None
        if parser is None:
            self._loader.exec_module(module)
            return
        stand_in = _Parser(_PARSER)
        stand_in.__spec__ = parser  # a real attribute: the import system reads it
        sys.modules[_PARSER] = stand_in
        real_import = builtins.__import__

        def import_hook(
            name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
        ) -> Any:
            importer = str((globals or {}).get("__name__", ""))
            if name == "sympy" and level == 0 and not fromlist and importer.startswith("onnx_ir"):
                return _SYMPY
            return real_import(name, globals, locals, fromlist or (), level)

        builtins.__import__ = import_hook
        try:
            self._loader.exec_module(module)
        except BaseException:
            if sys.modules.get(_PARSER) is stand_in:
                del sys.modules[_PARSER]
            raise
        finally:
            builtins.__import__ = real_import


_SYMPY = _Sympy()
_FINDER = _Finder()


def install() -> None:
    """Have the first import of onnx-ir, wherever it happens, defer sympy.

    Nothing is imported here: the command imports onnx-ir when it needs it, after it
    has started copying a model's data file.
    """
    if "onnx_ir" in sys.modules or "sympy" in sys.modules or _FINDER in sys.meta_path:
        return
    sys.meta_path.insert(0, _FINDER)
