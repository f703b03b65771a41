"""benchmarks/_process.py: a command's peak RSS is its own, not that of the benchmark that runs it.

Forked straight from a Python parent, a command's ``ru_maxrss`` starts at the parent's peak; the
benchmarks run each command through a small launcher instead. Memory, not time, is asserted."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

PROCESS = Path(__file__).resolve().parent.parent / "benchmarks" / "_process.py"
ALLOCATE = "import sys; b = bytearray({} * 2**20); print('made', file=sys.stderr); sys.exit({})"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_process", PROCESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_command_reports_its_own_peak_not_its_parents() -> None:
    run_measured = _module().run_measured
    held = np.ones(400 * 2**20 // 8)  # this process now peaks above 400 MiB
    held[::4096] += 1  # every page touched
    small = run_measured(["/bin/true"])
    assert small.returncode == 0 and small.ru_maxrss < 100 * 1024
    big = run_measured([sys.executable, "-c", ALLOCATE.format(200, 3)], stderr=subprocess.PIPE, text=True)
    assert big.returncode == 3 and big.stderr == "made\n"
    assert 200 * 1024 <= big.ru_maxrss < 300 * 1024 and big.peak_bytes == big.ru_maxrss * 1024
    assert big.seconds > 0 and big.ru_utime + big.ru_stime > 0
    del held


def test_a_missing_command_and_a_killed_one() -> None:
    run_measured = _module().run_measured
    missing = run_measured(["/nonexistent/command"], stderr=subprocess.PIPE, text=True)
    assert missing.returncode == 127 and "No such file" in missing.stderr
    killed = run_measured([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.returncode == -signal.SIGKILL
