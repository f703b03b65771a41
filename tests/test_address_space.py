"""Under a limit on the address space (``ulimit -v``, ``prlimit --as``: shared servers, batch
schedulers), a model whose tensors sit in one large data file is rewritten and quantized (issue
42, item 4). onnx-ir maps the whole data file for each tensor it reads; 128 small tensors of a
64 MiB file reserved 8 GiB, and the run ended "out of memory" at a fraction of that in use. Where a
limit is too low all the same, the error names it."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import session

C, LAYERS, SMALL = 1024, 16, 8
LIMIT = 3 << 30  # 3 GiB: the interpreter, numpy, onnx and onnxruntime fit in it with room to spare

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")


def _model(directory: Path) -> Path:
    """16 pointwise convs (4 MiB each) and 128 small tensors (256 bytes each), all in one file."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Transpose", ["x"], ["h0"], perm=[0, 2, 1])]
    inits, outputs = [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", C])]
    for i in range(LAYERS):
        inits.append(
            numpy_helper.from_array((rng.standard_normal((C, C, 1)) / 32).astype(np.float32), f"w{i}")
        )
        nodes += [
            helper.make_node("Conv", [f"h{i}", f"w{i}"], [f"c{i}"], name=f"pw{i}"),
            helper.make_node("Relu", [f"c{i}"], [f"h{i + 1}"]),
        ]
        for j in range(SMALL):
            inits.append(numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), f"s{i}_{j}"))
            nodes.append(helper.make_node("Identity", [f"s{i}_{j}"], [f"o{i}_{j}"]))
            outputs.append(helper.make_tensor_value_info(f"o{i}_{j}", TensorProto.FLOAT, [64]))
    nodes.append(helper.make_node("Transpose", [f"h{LAYERS}"], ["y"], perm=[0, 2, 1]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", C])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = directory / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return path


def _limited(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _run(*args: str, limit: int = LIMIT) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "onnx_conv2matmul", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, preexec_fn=lambda: _limited(limit), timeout=600
    )


@pytest.mark.parametrize("command", [("convert", "--extended-conv1x1"), ("quantize", "--no-bench", "-q")])
def test_a_large_data_file_of_many_tensors_runs_under_an_address_space_limit(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    src = _model(tmp_path)
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    name, *flags = command
    done = _run(name, str(src), str(out), *flags)
    assert done.returncode == 0, done.stderr
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 9, C)).astype(np.float32)}
    assert session(str(out)).run(None, feeds)[1].shape == (64,)


@pytest.mark.parametrize("limit", [None, 1 << 30])
def test_memory_that_runs_out_under_a_limit_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    from click.testing import CliRunner

    from onnx_conv2matmul import api
    from onnx_conv2matmul.cli.app import main

    def out_of_memory(*_: object, **__: object) -> None:
        raise MemoryError("Unable to allocate 2.00 GiB for an array")

    soft = resource.RLIM_INFINITY if limit is None else limit
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, resource.RLIM_INFINITY))
    monkeypatch.setattr(api, "quantize_file", out_of_memory)
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [])), tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx")])
    assert result.exit_code == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: out of memory: Unable to allocate 2.00 GiB")
    named = "(this process may use at most 1.0 GiB of address space: ulimit -v sets it)"
    assert (named in line) is (limit is not None)
