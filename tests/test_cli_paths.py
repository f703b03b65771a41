"""Output and report paths: never replace a file the input reads, a device, a FIFO or a link to one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import conv_model
from onnx_conv2matmul.cli import main


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry of ``directory``: a file's bytes, or what a link or special file is."""
    entries: dict[str, bytes | str] = {}
    for path in directory.iterdir():
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            entries[path.name] = f"link to {os.readlink(path)}"
        elif stat.S_ISREG(mode):
            entries[path.name] = path.read_bytes()
        else:
            entries[path.name] = f"mode {stat.S_IFMT(mode):o}"
    return entries


def _char_device(path: Path) -> Path:
    """A private stand-in for /dev/null (same device numbers), or skip when it cannot be made."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with open(path, "w") as handle:  # a nodev mount refuses to open it
            handle.write("x")
    except OSError as err:
        pytest.skip(f"cannot make a character device here: {err}")
    return path


# ---- 1. the report never replaces a file the input model reads --------------------------------


def _save_external(src: Path, layout: str) -> list[Path]:
    """Save a model at ``src`` with external data; return the data files it reads."""
    before = set(src.parent.iterdir())
    if layout == "named-file":
        onnx.save(conv_model(), src, save_as_external_data=True, location="weights.bin", size_threshold=0)
    elif layout == "per-tensor-files":
        onnx.save(
            conv_model(), src, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0
        )
    else:  # the weight in a Constant node's attribute
        onnx.save(
            conv_model(weight_source="constant"),
            src,
            save_as_external_data=True,
            location="const.bin",
            size_threshold=0,
        )
    return sorted(set(src.parent.iterdir()) - before - {src})


@pytest.mark.parametrize("layout", ["named-file", "per-tensor-files", "constant-attribute"])
@pytest.mark.parametrize("command", ["convert", "verify", "quantize"])
def test_report_never_replaces_a_file_the_input_reads(tmp_path: Path, layout: str, command: str) -> None:
    src = tmp_path / "m.onnx"
    data_files = _save_external(src, layout)
    assert data_files
    out = str(tmp_path / "o.onnx")
    for data in data_files:
        before = snapshot(tmp_path)
        args = {
            "convert": [str(src), out],
            "verify": ["verify", str(src), str(src)],
            "quantize": ["quantize", str(src), out],
        }[command]
        code, _, stderr = invoke(*args, "--report-json", str(data))
        assert code == 2, stderr
        assert "would overwrite a model file" in stderr and len(stderr.strip().splitlines()) == 1
        assert snapshot(tmp_path) == before


def test_report_through_a_link_to_a_data_file_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    _save_external(src, "named-file")
    (tmp_path / "r.json").symlink_to(tmp_path / "weights.bin")
    before = snapshot(tmp_path)
    code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"), "--report-json", str(tmp_path / "r.json"))
    assert code == 2 and "would overwrite a model file" in stderr
    assert snapshot(tmp_path) == before


def test_files_read_by_lists_subgraph_tensors(tmp_path: Path) -> None:
    """An external tensor of an If branch counts as well."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    then = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [64])],
        [numpy_helper.from_array(np.ones(64, np.float32), "c")],
    )
    other = helper.make_graph(
        [helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(np.zeros(64, np.float32)))],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [64])],
    )
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
    )
    src = tmp_path / "if.onnx"
    onnx.save(
        helper.make_model(graph), src, save_as_external_data=True, location="branch.bin", size_threshold=0
    )
    from onnx_conv2matmul._paths import files_read_by

    assert files_read_by(str(src)) == {os.path.realpath(src), os.path.realpath(tmp_path / "branch.bin")}
