"""Output and report paths: never replace a file the input reads, a device, a FIFO or a link to one."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import conv_model, no_bench
from onnx_conv2matmul import api
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files.checks import check_output_path
from processes import TIMEOUT


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
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
    from onnx_conv2matmul.files.paths import files_read_by

    assert files_read_by(str(src)) == {os.path.realpath(src), os.path.realpath(tmp_path / "branch.bin")}


# ---- 2. devices, FIFOs and links to them are never replaced ------------------------------------


def _special(tmp_path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(tmp_path / "special")
    else:
        _char_device(tmp_path / "special")
    return tmp_path / "special"


def _is_special(path: Path, kind: str) -> bool:
    mode = os.stat(path).st_mode
    return stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode)


@pytest.mark.parametrize("via_link", [False, True], ids=["direct", "symlink"])
@pytest.mark.parametrize("kind", ["fifo", "char-device"])
@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_model_output_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, kind: str, via_link: bool, command: str
) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    target = _special(tmp_path, kind)
    out = target
    if via_link:
        out = tmp_path / "link.onnx"
        out.symlink_to(target)
    before = snapshot(tmp_path)
    args = [str(src), str(out)] if command == "convert" else ["quantize", str(src), str(out)]
    code, _, stderr = invoke(*args)
    assert code == 2, stderr
    assert "not a regular file" in stderr and len(stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before
    assert _is_special(out, kind)


def test_model_output_data_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    os.mkfifo(tmp_path / "o.onnx.data")
    code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"))
    assert code == 2 and "not a regular file" in stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "o.onnx.data").st_mode)
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("via_link", [False, True], ids=["direct", "symlink"])
def test_report_to_a_fifo_is_written_through(tmp_path: Path, via_link: bool) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    fifo = _special(tmp_path, "fifo")
    report = fifo
    if via_link:
        report = tmp_path / "r.json"
        report.symlink_to(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer's open does not wait
    try:
        code, stdout, stderr = invoke(
            str(src), str(tmp_path / "o.onnx"), "--report-json", str(report), "--report-json-stdout", "-q"
        )
        assert code == 0, stderr
        received = os.read(reader, 1 << 20).decode()
    finally:
        os.close(reader)
    assert json.loads(received) == json.loads(stdout)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.path.islink(report) == via_link
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_report_to_a_character_device_is_written_through(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    null = _special(tmp_path, "char-device")
    link = tmp_path / "r.json"
    link.symlink_to(null)
    for report in (null, link):
        code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"), "--report-json", str(report), "-q")
        assert code == 0, stderr
        assert stat.S_ISCHR(os.lstat(null).st_mode) and link.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_stdout_link_is_never_replaced(tmp_path: Path) -> None:
    """A link to /proc/self/fd/1 (what /dev/stdout is): the model is refused, the report goes to stdout."""
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    captured = tmp_path / "captured.txt"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        with open(captured, "w") as stdout:  # stdout a regular file: the link resolves to it
            return subprocess.run(
                [sys.executable, "-m", "onnx_conv2matmul", *args],
                stdout=stdout,
                stderr=subprocess.PIPE,
                text=True,
                check=False,
                timeout=TIMEOUT,
            )

    refused = run(str(src), str(link))
    assert refused.returncode == 2 and "not a regular file" in refused.stderr, refused.stderr
    assert link.is_symlink()
    written = run(str(src), str(tmp_path / "o.onnx"), "--report-json", str(link), "-q")
    assert written.returncode == 0, written.stderr
    assert link.is_symlink()
    assert json.loads(captured.read_text())["return_code"] == 0


def test_write_text_atomic_keeps_a_character_device(tmp_path: Path) -> None:
    null = _char_device(tmp_path / "null")
    _io.write_text_atomic(str(null), "{}\n")
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert {p.name for p in tmp_path.iterdir()} == {"null"}


def test_report_to_a_block_device_or_socket_is_refused(tmp_path: Path) -> None:
    import socket

    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "sock"))
        before = snapshot(tmp_path)
        code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"), "--report-json", str(tmp_path / "sock"))
    finally:
        sock.close()
    assert code == 2 and "report is not a regular file" in stderr
    assert snapshot(tmp_path) == before


# ---- 3. empty output paths and paths naming a directory ----------------------------------------


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_empty_output_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    args = [str(src), ""] if command == "convert" else ["quantize", str(src), ""]
    code, _, stderr = invoke(*args)
    assert code == 2 and "output path is empty" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before and not list(work.iterdir())


def test_empty_report_path(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    before = snapshot(tmp_path)
    code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"), "--report-json", "")
    assert code == 2 and "report path is empty" in stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("what", ["output", "report"])
def test_path_ending_in_a_slash_names_a_directory(tmp_path: Path, what: str) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    before = snapshot(tmp_path)
    missing = str(tmp_path / "nodir") + "/"
    if what == "output":
        code, _, stderr = invoke(str(src), missing)
    else:
        code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"), "--report-json", missing)
    assert code == 2, stderr
    assert f"{what} path ends with '/'" in stderr and len(stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before


def test_check_output_path_contract(tmp_path: Path) -> None:
    from onnx_conv2matmul import InputError

    with pytest.raises(InputError, match="output path is empty"):
        check_output_path("")
    with pytest.raises(InputError, match="ends with '/'"):
        check_output_path(str(tmp_path / "x") + "/")
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="is a directory"):
        check_output_path(str(tmp_path / "d") + "/")
    check_output_path(str(tmp_path / "new.onnx"))


# ---- 4. --keep-on-failure and an existing OUTPUT.verify-failed that is not a directory ----------


@pytest.mark.parametrize("kind", ["file", "link-to-directory"])
def test_keep_on_failure_target_must_be_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    kept = tmp_path / "o.onnx.verify-failed"
    if kind == "file":
        kept.write_text("notes")
    else:
        (tmp_path / "elsewhere").mkdir()
        kept.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    before = snapshot(tmp_path)

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api, "load_input", no_work)
    code, _, stderr = invoke(str(src), str(tmp_path / "o.onnx"), "--verify", "--keep-on-failure")
    assert code == 2, stderr
    assert "o.onnx.verify-failed" in stderr and "not a directory" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before
    with pytest.raises(InputError, match="not a directory"):
        api.convert_file(
            src, tmp_path / "o.onnx", verify=api.VerifyOptions(), keep_on_failure=True, run_checker=False
        )


# A file name that is not valid UTF-8 reaches Python with surrogates in place of its bytes
# (os.fsdecode); onnx's checker, onnxruntime and data-file locations take text only.
NOT_UTF8 = os.fsdecode(b"m\xff.onnx")


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["{bad}", "{out}"], "input"),
        (["{good}", "{bad}"], "output"),
        (["quantize", "{bad}", "{out}"], "input"),
        (["quantize", "{good}", "{bad}"], "output"),
        (["verify", "{good}", "{bad}"], "input"),
        (["inspect", "{bad}"], "input"),
    ],
    ids=["convert-input", "convert-output", "quantize-input", "quantize-output", "verify", "inspect"],
)
def test_a_file_name_that_is_not_utf8_is_refused(tmp_path: Path, args: list[str], what: str) -> None:
    good = tmp_path / "good.onnx"
    onnx.save(conv_model(), good)
    if args[-1] != "{bad}" or args[0] in ("verify", "inspect"):
        onnx.save(conv_model(), os.path.join(os.fsencode(tmp_path), os.fsencode(NOT_UTF8)))
    before = snapshot(tmp_path)
    values = {"good": str(good), "bad": str(tmp_path / NOT_UTF8), "out": str(tmp_path / "o.onnx")}
    code, _, stderr = invoke(*[a.format(**values) for a in args])
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"{what} path is not valid UTF-8: " in lines[0], stderr
    assert "m\\xff.onnx" in lines[0]
    assert snapshot(tmp_path) == before


def test_a_directory_name_that_is_not_utf8_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path in a working directory whose name is not UTF-8."""
    directory = os.path.join(os.fsencode(tmp_path), b"d\xfe")
    os.mkdir(directory)
    onnx.save(conv_model(), os.path.join(directory, b"m.onnx"))
    monkeypatch.chdir(directory)
    code, _, stderr = invoke("m.onnx", "o.onnx")
    assert code == 2 and "input path is not valid UTF-8" in stderr and "d\\xfe" in stderr, stderr
    assert os.listdir(directory) == [b"m.onnx"]
