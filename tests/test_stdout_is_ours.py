"""Stdout carries only what the tool writes (issue 43, rule 6): with ``--report-json-stdout``
exactly one JSON object, with ``-q`` nothing, whatever a dependency, a ``--validate`` function or a
process it starts writes to stdout, at the Python level or straight to descriptor 1; that goes to
stderr (nowhere with ``-q``). Each command runs in a process of its own, as from a shell, with
its dependencies made noisy: ``onnx.load`` and onnxruntime's sessions print on both levels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from processes import ROOT

DATA = Path(__file__).parent / "data"
ENCODER = str(DATA / "conformer_small.onnx")
TIMEOUT = 240

NOISY = """
import os, sys
import onnx, onnxruntime

def noisy(real):
    def wrapper(*args, **kwargs):
        print("noise: a dependency prints")
        os.write(1, b"noise: straight to descriptor 1\\n")
        return real(*args, **kwargs)
    return wrapper

onnx.load = noisy(onnx.load)
onnxruntime.InferenceSession.__init__ = noisy(onnxruntime.InferenceSession.__init__)
from onnx_conv2matmul.cli.entry import run
sys.argv = ["onnx-conv2matmul", *sys.argv[1:]]
run()
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, "-c", NOISY, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
        check=False,
    )


def _commands(tmp: Path) -> dict[str, list[str]]:
    return {
        "convert": [ENCODER, str(tmp / "c.onnx"), "--verify"],
        "verify": ["verify", ENCODER, ENCODER],
        "quantize": ["quantize", ENCODER, str(tmp / "q.onnx"), "--no-bench"],
        "inspect": ["inspect", ENCODER],
        "bench": ["bench", ENCODER, "--bench-rounds", "3", "--bench-lengths", "16"],
        "bundle": ["bundle", str(DATA / "parakeet_small"), str(tmp / "b"), "--no-bench"],
    }


@pytest.mark.parametrize("command", ["convert", "verify", "quantize", "inspect", "bench", "bundle"])
def test_stdout_holds_one_json_object_whatever_else_writes_there(tmp_path: Path, command: str) -> None:
    result = _run(*_commands(tmp_path)[command], "--report-json-stdout")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # the whole of stdout: one object, nothing before or after
    assert data["return_code"] == 0
    assert "noise: a dependency prints" in result.stderr
    assert "noise: straight to descriptor 1" in result.stderr


@pytest.mark.parametrize("command", ["convert", "verify", "quantize", "inspect", "bench", "bundle"])
def test_quiet_leaves_stdout_empty(tmp_path: Path, command: str) -> None:
    result = _run(*_commands(tmp_path)[command], "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "noise: a dependency prints" not in result.stderr  # -q: a dependency's prints go nowhere


def test_a_validate_function_and_the_process_it_starts_write_to_stderr(tmp_path: Path) -> None:
    script = tmp_path / "metric.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "def score(path):\n"
        "    print('metric: a print')\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"metric: a child process\")'], check=True)\n"
        "    return 1.0\n"
    )
    args = ["quantize", ENCODER, str(tmp_path / "q.onnx"), "--no-bench", "--validate", f"{script}:score"]
    result = _run(*args, "--max-drop", "0.5", "--report-json-stdout")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["return_code"] == 0
    assert "metric: a print" in result.stderr and "metric: a child process" in result.stderr


def test_k_quant_progress_bars_stay_off_stdout_and_quiet_silences_them(tmp_path: Path) -> None:
    args = ["quantize", ENCODER, str(tmp_path / "q.onnx"), "--no-bench", "--algorithm", "k_quant"]
    quiet = _run(*args, "-q")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and "Progress" not in quiet.stderr
    shown = _run(*args, "--report-json-stdout")
    assert shown.returncode == 0 and json.loads(shown.stdout)["return_code"] == 0
    assert "Progress" in shown.stderr


def test_quiet_silences_a_dependency_with_json_on_stdout_too(tmp_path: Path) -> None:
    result = _run(*_commands(tmp_path)["quantize"], "-q", "--report-json-stdout")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["return_code"] == 0
    assert "noise: a dependency prints" not in result.stderr
