"""Import onnx-ir without importing sympy until something uses it (console script only).

onnx-ir imports sympy when it is itself imported, for arithmetic on symbolic
dimensions (``SymbolicDim("T") + 1``), which this tool never does; sympy is a large
share of the start-up of a command. This changes how the interpreter imports onnx-ir,
so only the console entry point (:func:`onnx_conv2matmul._entry.run`) calls
:func:`install`: a library import never does.

After :func:`install`, while onnx-ir's package is first imported (by whatever
code imports it first), its own ``import sympy`` gets a stand-in, and its
expression parser (which reads sympy attributes when it runs) is a stand-in
module. The first attribute read from either imports the real module and is
answered by it, so symbolic arithmetic still works, unchanged. ``sys.modules``
never holds a stand-in for sympy, so other code importing sympy is not affected.
Python's ``importlib.util.LazyLoader`` cannot do this: a later ``import`` of a lazy
module reads its ``__spec__``, which makes it load at once.
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
from collections.abc import Iterator, Mapping, Sequence
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


class _DeferSympy:  # a meta path finder (importlib.abc costs 20 ms of start-up to import)
    """Finds ``onnx_ir`` once, and has its package run with sympy deferred."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "onnx_ir":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # used once
        spec = importlib.util.find_spec("onnx_ir")
        if spec is None or spec.loader is None or "sympy" in sys.modules:
            return spec
        spec.loader = _DeferringLoader(spec.loader)  # type: ignore[assignment]
        return spec


class _DeferringLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The package gets its own loader back (resource readers and reloads use it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with _sympy_deferred(module.__spec__):
            self._loader.exec_module(module)


_FINDER = _DeferSympy()


def install() -> None:
    """Have the first import of onnx-ir, wherever it happens, defer sympy.

    Nothing is imported here: commands that start work before they need onnx-ir
    (the copy of a model's data file) import it later.
    """
    if "onnx_ir" in sys.modules or "sympy" in sys.modules or _FINDER in sys.meta_path:
        return
    sys.meta_path.insert(0, _FINDER)


@contextlib.contextmanager
def _sympy_deferred(package: importlib.machinery.ModuleSpec | None) -> Iterator[None]:
    """While onnx-ir's package runs: its ``import sympy`` gets a stand-in, its parser is one."""
    locations = package.submodule_search_locations if package is not None else None
    parser = importlib.machinery.PathFinder.find_spec(_PARSER, list(locations)) if locations else None
    if parser is None or "sympy" in sys.modules:
        yield
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
        yield
    except BaseException:
        if sys.modules.get(_PARSER) is stand_in:
            del sys.modules[_PARSER]
        raise
    finally:
        builtins.__import__ = real_import
