"""Importing the library changes nothing: the interpreter is as a plain ``import onnx_ir`` leaves it.

Each check runs in a fresh interpreter (this test process has long since imported everything)
and compares what it sees with a baseline interpreter that imports only onnx-ir.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import onnx
import pytest

from helpers import conv_model
from processes import TIMEOUT

# Prints what an import could change: import hooks, the import function, the switch
# interval, signal handlers, and the modules of onnx-ir and sympy (type, file, loader).
_SNAPSHOT = """
import builtins, json, signal, sys, types
_import = builtins.__import__
def snapshot():
    def handler(h):
        if h is signal.default_int_handler:
            return "default_int_handler"
        return h.name if isinstance(h, signal.Handlers) else repr(h)
    def qualified(f):
        kind = f if isinstance(f, type) or callable(f) and hasattr(f, "__qualname__") else type(f)
        return kind.__module__ + "." + kind.__qualname__
    modules = {}
    for name, m in sorted(sys.modules.items()):
        if name.split(".")[0] in ("onnx_ir", "sympy"):
            spec = getattr(m, "__spec__", None)
            loader = type(spec.loader).__name__ if spec is not None else None
            kind = type(m).__module__ + "." + type(m).__qualname__
            modules[name] = [kind, getattr(m, "__file__", None), loader]
    return {
        "meta_path": [qualified(f) for f in sys.meta_path],
        "path_hooks": [qualified(h) for h in sys.path_hooks],
        "import_unchanged": builtins.__import__ is _import,
        "switch_interval": sys.getswitchinterval(),
        "signals": {s.name: handler(signal.getsignal(s)) for s in signal.Signals},
        "modules": modules,
    }
"""

IMPORTS = [
    "import onnx_conv2matmul",
    "from onnx_conv2matmul import convert, convert_file",
    "import onnx_conv2matmul.api",
    "import onnx_conv2matmul.verify.check",
    "import onnx_conv2matmul.quantize.nbits",
    "import onnx_conv2matmul.quantize.workflow",
    "import onnx_conv2matmul.quantize.inspection",
    "import onnx_conv2matmul.cli.render",
    "import onnx_conv2matmul.cli.app",
]


def _state(statements: str) -> dict[str, Any]:
    """The snapshot after ``statements``, and again after ``import onnx_ir``, in a new process."""
    after = "import onnx_ir\nprint(json.dumps({'before': before, 'after': snapshot()}))\n"
    code = _SNAPSHOT + textwrap.dedent(statements) + "\nbefore = snapshot()\n" + after
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    state: dict[str, Any] = json.loads(proc.stdout)
    return state


@pytest.fixture(scope="module")
def baseline() -> dict[str, Any]:
    return _state("")


@pytest.mark.parametrize("statement", IMPORTS)
def test_importing_changes_nothing(baseline: dict[str, Any], statement: str) -> None:
    ours = _state(statement)
    kinds = {tuple(entry[0::2]) for entry in baseline["after"]["modules"].values()}  # plain modules
    for moment in ("before", "after"):
        theirs, mine = dict(baseline[moment]), dict(ours[moment])
        their_modules, my_modules = theirs.pop("modules"), mine.pop("modules")
        assert mine == theirs, moment
        # Our modules may import more of onnx-ir than a plain import does (onnx_ir.passes, say),
        # never anything else in place of a module.
        shared = their_modules.keys() & my_modules.keys()
        assert {name: my_modules[name] for name in shared} == {name: their_modules[name] for name in shared}
        assert {tuple(entry[0::2]) for entry in my_modules.values()} <= kinds, moment
    assert baseline["after"]["modules"].keys() <= ours["after"]["modules"].keys()
    assert "onnx_ir._symbolic_shapes" in ours["after"]["modules"]


def test_onnx_ir_works_as_usual_after_a_conversion(tmp_path: Path) -> None:
    """Symbolic dimension arithmetic, and onnx-ir's own modules, after the library has run."""
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(conv_model(), src)
    code = f"""
        import sys, types
        import onnx_conv2matmul
        onnx_conv2matmul.convert_file({str(src)!r}, {str(dst)!r})
        import onnx_ir as ir, sympy
        from onnx_ir import _core, _symbolic_shapes
        assert type(_symbolic_shapes) is types.ModuleType
        assert sys.modules["onnx_ir._symbolic_shapes"] is _symbolic_shapes
        assert _core.sympy is sympy and _core._symbolic_shapes is _symbolic_shapes
        assert str(ir.SymbolicDim("T") + 1) == "T + 1"
        assert str(ir.SymbolicDim("max(T, 2) * 2")) == "max(T, 2) * 2"
        assert (ir.SymbolicDim("N") * 2).evaluate({{"N": 3}}) == 6
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr


def test_running_the_command_in_process_changes_nothing(tmp_path: Path) -> None:
    """``cli.main`` called from a host program (as click's test runner does) leaves the
    interpreter's switch interval and signal handlers as they were."""
    import signal

    from click.testing import CliRunner

    from onnx_conv2matmul.cli import app as cli

    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    interval = sys.getswitchinterval()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    result = CliRunner().invoke(cli.main, [str(src), str(tmp_path / "o.onnx"), "-q"])
    assert result.exit_code == 0, result.output
    assert sys.getswitchinterval() == interval
    assert {s: signal.getsignal(s) for s in handlers} == handlers


# The console script: only it may change the interpreter, and it keeps exit codes and output.

ROOT = Path(__file__).resolve().parents[1]


def console(prelude: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script declared in pyproject.toml, run after ``prelude`` in a new process."""
    import tomllib

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["onnx-conv2matmul"]
    module, _, function = target.partition(":")
    start = f"from {module} import {function}\nsys.exit({function}())\n"
    code = textwrap.dedent(prelude) + "\nimport sys\nsys.argv[0] = 'onnx-conv2matmul'\n" + start
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, timeout=TIMEOUT
    )


# Says on stderr whether the interpreter's teardown ran (atexit handlers run first in it).
TEARDOWN = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("teardown\\n"))
"""


def test_the_console_script_skips_the_teardown_and_keeps_exit_codes_and_output(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    ok = console(TEARDOWN, str(src), str(tmp_path / "o.onnx"), "--report-json-stdout", "-q")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["return_code"] == 0  # stdout a pipe: flushed before the exit
    assert ok.stderr == ""  # no teardown
    missing = console(TEARDOWN, str(tmp_path / "nope.onnx"), str(tmp_path / "o.onnx"), "--report-json-stdout")
    assert missing.returncode == 2
    assert json.loads(missing.stdout)["return_code"] == 2
    assert "input not found" in missing.stderr and "teardown" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    usage = console(TEARDOWN, "--no-such-option")
    assert usage.returncode == 2 and "teardown" not in usage.stderr
    version = console(TEARDOWN, "--version")
    assert version.returncode == 0 and version.stdout.strip().startswith("onnx-conv2matmul")


def test_cli_run_ends_as_any_program_does(tmp_path: Path) -> None:
    """``cli.run`` (the command line without the console script's shortcuts) ends with the
    interpreter's teardown, and the same exit code and output."""
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    code = TEARDOWN + "from onnx_conv2matmul.cli import app as cli\ncli.run()\n"
    args = [str(src), str(tmp_path / "o.onnx"), "--report-json-stdout", "-q"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["return_code"] == 0
    assert proc.stderr == "teardown\n"


def test_the_console_script_defers_sympy_and_onnx_ir_still_works(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    prelude = """
        import sys
        from onnx_conv2matmul import api
        _convert_file = api.convert_file
        def convert_file(*args, **kwargs):
            report = _convert_file(*args, **kwargs)
            import onnx_ir as ir
            sys.stderr.write(f"sympy after the conversion: {'sympy' in sys.modules}\\n")
            assert str(ir.SymbolicDim("T") + 1) == "T + 1"
            assert (ir.SymbolicDim("max(N, 2)") * 2).evaluate({"N": 3}) == 6
            import sympy
            assert sympy.Integer(2) + 1 == 3
            return report
        api.convert_file = convert_file
    """
    proc = console(prelude, str(src), str(tmp_path / "o.onnx"), "--report-json-stdout", "-q")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["return_code"] == 0
    assert proc.stderr == "sympy after the conversion: False\n"


def _python(code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr


def test_the_deferral_is_undone_by_the_first_use_of_sympy() -> None:
    """What the console script's ``_lazy.install`` does to onnx-ir, and what is left after."""
    _python("""
        import builtins, importlib, sys, types
        original_import, meta_path = builtins.__import__, list(sys.meta_path)
        from onnx_conv2matmul.cli import lazy_import as _lazy
        _lazy.install()
        import onnx_ir as ir
        from onnx_ir import _core
        assert "sympy" not in sys.modules, "sympy was imported"
        assert sys.meta_path == meta_path and builtins.__import__ is original_import
        assert type(ir.__spec__.loader).__name__ == "SourceFileLoader" and ir.__loader__ is ir.__spec__.loader
        assert str(ir.SymbolicDim("T") + 1) == "T + 1"
        assert (ir.SymbolicDim("max(N, 2)") * 2).evaluate({"N": 3}) == 6  # the parser, imported on first use
        import sympy, sympy.core.numbers
        assert type(sys.modules["onnx_ir._symbolic_shapes"]) is types.ModuleType
        assert sympy.Integer(2) + 1 == 3 and _core.sympy.Integer is sympy.Integer
        importlib.reload(ir)
    """)


def test_the_deferral_does_nothing_once_sympy_is_imported() -> None:
    _python("""
        import sys, sympy, types
        meta_path = list(sys.meta_path)
        from onnx_conv2matmul.cli import lazy_import as _lazy
        _lazy.install()
        assert sys.meta_path == meta_path
        import onnx_ir as ir
        from onnx_ir import _core
        assert _core.sympy is sympy and type(sys.modules["onnx_ir._symbolic_shapes"]) is types.ModuleType
    """)


_HEAVY = ("numpy", "onnx", "onnx_ir", "onnxruntime", "rich", "ml_dtypes", "sympy")


@pytest.mark.parametrize(
    "args",
    [["--version"], ["--help"], ["-h"]]
    + [[command, "--help"] for command in ("convert", "verify", "quantize", "inspect", "bundle", "bench")],
    ids=lambda args: " ".join(args),
)
def test_version_and_help_import_nothing_heavy(args: list[str]) -> None:
    """``--version`` and every ``--help`` answer without numpy, onnx, onnxruntime or rich:
    a command imports what it uses when it runs (the start of the console script, as
    ``python -X importtime`` lists every module it imports)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "onnx_conv2matmul", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "onnx-conv2matmul" in done.stdout or "Usage" in done.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.count("|") == 2}
    assert "onnx_conv2matmul.cli.app" in imported  # the listing is the real one
    assert sorted(m for m in imported if m.split(".")[0] in _HEAVY) == []
