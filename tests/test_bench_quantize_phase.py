"""benchmarks/bench_quantize_phase.py's timed script still calls the workflow as it stands (it runs
on the full-size encoder only, so nothing else would notice a changed signature)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from helpers import matmul_model

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quantize_phase.py"


def test_the_timed_script_runs_the_workflow_up_to_the_accuracy_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH.parent))  # as when the script runs: its folder first
    spec = importlib.util.spec_from_file_location("bench_quantize_phase", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)
    proc = subprocess.run(
        [sys.executable, "-c", bench.OURS_SCRIPT, str(src), str(tmp_path / "q.onnx"), "--profile"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Quantizing" in result["phases"] and result["profile"]
    assert not (tmp_path / "q.onnx").exists()  # stopped at the check: nothing published
