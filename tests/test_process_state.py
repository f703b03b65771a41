"""The library leaves the caller's process as it found it: a host program (tests/host_program.py,
in a fresh interpreter, so no test runner's handlers hide a change) calls every public function
and finds its root logger, signal handlers, standard streams, umask, warnings filters, switch
interval, working directory and environment as they were, from the main thread or a worker."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HOST = Path(__file__).with_name("host_program.py")
REPORTS = [
    "ConvertReport",
    "ConvertReport",
    "VerifyCommandReport",
    "QuantizeReport",
    "QuantizeReport",
    "QuantizeReport",
    "QuantizeReport",
    "InspectReport",
    "BundleReport",
    "BenchReport",
    "BundleBuildReport",
]


@pytest.mark.parametrize(("where", "host"), [("main", "bare"), ("worker", "bare"), ("main", "configured")])
def test_every_public_function_leaves_the_process_alone(where: str, host: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    done = subprocess.run(
        [sys.executable, str(HOST), str(tmp_path), where, host],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout[-4000:]  # nothing printed by the library
    seen = json.loads(lines[0])
    assert seen["reports"] == REPORTS
    before, after = seen["before"], seen["after"]
    assert set(before) == set(after)
    for key in sorted(before):
        assert after[key] == before[key], key
    assert len(before["signals"]) > 10 and before["umask"]
    assert before["root_handlers"] == ([] if host == "bare" else [before["root_handlers"][0]])


def test_the_host_program_sees_a_change(tmp_path: Path) -> None:
    """The comparison itself: a root handler, a level, a signal handler, a stream or a umask
    changed between the two looks shows."""
    sys.path.insert(0, str(HOST.parent))
    try:
        import host_program
    finally:
        sys.path.remove(str(HOST.parent))
    import logging
    import signal

    before = host_program.state()
    root = logging.getLogger()
    handler = logging.NullHandler()
    level, stdout, mask = root.level, sys.stdout, os.umask(0o077)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    root.addHandler(handler)
    root.setLevel(logging.INFO if level != logging.INFO else logging.ERROR)
    sys.stdout = sys.stderr
    try:
        after = host_program.state()
    finally:
        sys.stdout = stdout
        root.removeHandler(handler)
        root.setLevel(level)
        os.umask(mask)
        signal.signal(signal.SIGUSR1, previous)
    changed = {k for k in before if before[k] != after[k]}
    assert changed >= {"root_handlers", "root_level", "signals", "stdout", "umask"}
    assert host_program.state() == before


def _imports_quantizer(node: ast.AST) -> bool:
    names = (
        [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        if isinstance(node, ast.ImportFrom)
        else [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else []
    )
    return any(n.startswith("onnxruntime") and n.endswith("matmul_nbits_quantizer") for n in names)


def unguarded_quantizer_imports(source: str) -> list[int]:
    """The lines importing onnxruntime's matmul_nbits_quantizer with no call of
    ``matmul_nbits_quantizer()`` before them in the same function (or module)."""
    tree = ast.parse(source)
    scopes: list[ast.AST] = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]
    found = []
    for scope in scopes:
        inner = [n for n in ast.walk(scope) if n is not scope and isinstance(n, ast.FunctionDef)]
        nested = {id(m) for f in inner for m in ast.walk(f)}
        own = [n for n in ast.walk(scope) if id(n) not in nested]
        guards = [
            n.lineno
            for n in own
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "matmul_nbits_quantizer"
        ]
        found += [n.lineno for n in own if _imports_quantizer(n) and not any(g < n.lineno for g in guards)]
    return sorted(found)


def test_the_quantizer_module_is_imported_through_the_guard() -> None:
    """Every import of onnxruntime's matmul_nbits_quantizer in the package comes after a call of
    ``quantize.weight_only.matmul_nbits_quantizer`` (the import that leaves the root logger alone)."""
    src = HOST.parent.parent / "src" / "onnx_conv2matmul"
    unguarded = {p.name: unguarded_quantizer_imports(p.read_text()) for p in sorted(src.rglob("*.py"))}
    assert {name: lines for name, lines in unguarded.items() if lines} == {}
    sample = (
        "from onnxruntime.quantization.matmul_nbits_quantizer import A\n"
        "def f():\n    matmul_nbits_quantizer()\n"
        "    from onnxruntime.quantization import matmul_nbits_quantizer\n"
        "def g():\n    from onnxruntime.quantization.matmul_nbits_quantizer import B\n"
        "    def h():\n        matmul_nbits_quantizer()\n"
    )
    assert unguarded_quantizer_imports(sample) == [1, 6]


def test_basic_config_changes_nothing_while_the_root_logger_is_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no root handler, basicConfig in the block adds none and sets no level, and a warning
    still reaches stderr through ``logging.lastResort`` as it would with no handler at all; a
    root logger with handlers is not touched."""
    import logging

    from onnx_conv2matmul.quantize.weight_only import root_logger_kept

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)
    with root_logger_kept():
        logging.basicConfig(level=logging.INFO)
        logging.getLogger("somewhere.else").warning("still shown")
        logging.getLogger("somewhere.else").info("not shown")
        assert len(root.handlers) == 1
    assert (root.handlers, root.level) == ([], logging.WARNING)
    err = capsys.readouterr().err
    assert "still shown" in err and "not shown" not in err
    own = logging.NullHandler()
    root.handlers = [own]
    with root_logger_kept():
        assert root.handlers == [own]
        logging.getLogger("somewhere.else").warning("to the host's handler only")
    assert root.handlers == [own] and "host" not in capsys.readouterr().err
