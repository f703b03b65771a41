"""--inputs of 2,000 samples are checked in chunks, far below holding the file (issue 28, point 2).

The memory is each command's peak resident set, from the kernel (``wait4``), never a time: the
same ``quantize`` on a file of 2 samples is the baseline (Python, onnxruntime, the model). The
2,000-sample file holds 78 MiB of inputs and as much again of outputs per model: held at once,
inputs, reference and candidate outputs would be about 234 MiB above the baseline.

Measured on 2026-12-03: 125 MiB above the baseline with the default 64 MiB budget (``verify``
alone: 148 MiB; 40 MiB at a 16 MiB budget, 205 MiB at 256 MiB). Python's own allocations peak
at 22 MiB (tracemalloc); the rest is onnxruntime's and the allocator's anonymous memory, which
the chunk plan does not count (the model's intermediate tensors, the output buffers onnxruntime
allocates). The issue's "within the default budget plus one model" is therefore not met yet; the
test holds the line at 2.5 budgets plus the model, well below the 234 MiB of a whole-file check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_conv2matmul.verify.options import DEFAULT_MEMORY
from processes import ROOT

SAMPLES = 2000
ROWS, WIDTH = 16, 640  # 40 KiB a sample


def _model(path: Path) -> int:
    """x [N, 16, 640] -> MatMul W [640, 640] -> Relu -> y: outputs as large as the inputs."""
    w = np.random.default_rng(0).standard_normal((WIDTH, WIDTH)).astype(np.float32) / 25
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="proj"), helper.make_node("Relu", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", ROWS, WIDTH])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", ROWS, WIDTH])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path.stat().st_size


def _inputs(path: Path, samples: int) -> None:
    """An uncompressed .npz (as numpy.savez writes it), written in slices of 100 samples."""
    npy = path.with_suffix(".npy")
    x = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32, shape=(samples, ROWS, WIDTH))
    rng = np.random.default_rng(1)
    for start in range(0, samples, 100):
        stop = min(samples, start + 100)
        x[start:stop] = rng.standard_normal((stop - start, ROWS, WIDTH), dtype=np.float32)
    x.flush()
    del x
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.write(npy, "x.npy")
    npy.unlink()


def _run(args: list[str]) -> tuple[int, int, dict]:  # type: ignore[type-arg]
    """Exit code, peak RSS in bytes (``wait4``) and the JSON report of ``quantize`` in its own process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    argv = [sys.executable, "-m", "onnx_conv2matmul", "quantize", *args, "--report-json-stdout"]
    with open(os.devnull, "w") as devnull:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=devnull, env=env)
        assert process.stdout is not None
        out = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, json.loads(out)


def test_two_thousand_samples_are_checked_in_chunks_of_the_default_budget(tmp_path: Path) -> None:
    model_bytes = _model(tmp_path / "m.onnx")
    _inputs(tmp_path / "few.npz", 2)
    _inputs(tmp_path / "many.npz", SAMPLES)
    common = ["--no-bench", "--block-size", "32"]
    model = str(tmp_path / "m.onnx")
    code, base, _ = _run([model, str(tmp_path / "a.onnx"), "--inputs", str(tmp_path / "few.npz"), *common])
    assert code == 0
    code, peak, report = _run(
        [model, str(tmp_path / "b.onnx"), "--inputs", str(tmp_path / "many.npz"), *common]
    )
    assert code == 0, report.get("error")
    (row,) = report["verification"]["results"]
    assert row["samples"] == SAMPLES and row["passed"]
    assert (tmp_path / "b.onnx").exists()
    held_at_once = 3 * SAMPLES * ROWS * WIDTH * 4
    assert held_at_once > 3 * DEFAULT_MEMORY  # the file could not be checked whole within the budget
    assert peak - base <= 2.5 * DEFAULT_MEMORY + model_bytes < held_at_once, (peak - base) / 2**20
