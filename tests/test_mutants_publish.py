"""Tests written to kill mutants of ``files/publish.py`` that survived (docs/mutation.md): how a
bundle folder is put in place (``publish_directory``, with and without the atomic swap), the swap
itself, and the metadata written into a staged encoder (``set_metadata``).

What they pin is what a user sees: the folder at the destination is the new one, with the mode a
plain ``mkdir`` gives, nothing hidden from the staging and no old folder left beside it; while the
renames run (inside the caller's deferral) the old folder is hidden beside the destination; the
files and the parent are flushed to disk before the switch; and a model's metadata is changed in
place without touching its data file or its mode.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.files import publish
from onnx_conv2matmul.files.modes import _umask


def _staging(parent: Path, *, files: dict[str, str]) -> Path:
    """A private staging folder (0700, as mkdtemp makes it) holding ``files`` and hidden leftovers:
    a hidden folder with a file in it, a hidden file and a hidden symlink to a folder."""
    staging = parent / ".out.staging"
    staging.mkdir(mode=0o700)
    for name, text in files.items():
        (staging / name).write_text(text)
    (staging / ".scratch").mkdir()
    (staging / ".scratch" / "part.onnx").write_text("scratch")
    (staging / ".lock").write_text("")
    outside = parent / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (staging / ".link").symlink_to(outside, target_is_directory=True)
    return staging


def _folder(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in path.iterdir()}


@contextlib.contextmanager
def _no_exchange(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As on a system without renameat2: the old folder is moved aside, then the new one in."""
    with monkeypatch.context() as patch:
        patch.setattr(publish, "_exchange", lambda a, b: False)
        yield


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "move-aside"])
@pytest.mark.parametrize("existing", [True, False], ids=["replaces", "new"])
def test_publish_directory_puts_the_new_folder_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool, existing: bool
) -> None:
    destination = tmp_path / "out"
    if existing:
        destination.mkdir()
        (destination / "old.onnx").write_text("old")
    staging = _staging(tmp_path, files={"model.onnx": "new", "vocab.txt": "a b"})
    with contextlib.ExitStack() as stack:
        if not swap:
            stack.enter_context(_no_exchange(monkeypatch))
        publish.publish_directory(str(staging), str(destination))

    assert _folder(destination) == {"model.onnx": "new", "vocab.txt": "a b"}  # hidden ones removed
    assert stat.S_IMODE(destination.stat().st_mode) == 0o777 & ~_umask()  # as mkdir, not 0700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "outside"]  # no staging, no old folder
    assert _folder(tmp_path / "outside") == {"keep.txt": "keep"}  # a hidden link is unlinked, not followed


def test_the_swap_exchanges_two_folders(tmp_path: Path) -> None:
    if ctypes.util.find_library("c") is None:
        pytest.skip("no C library to call renameat2 from")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "in_a").write_text("a")
    (b / "in_b").write_text("b")
    if not publish._exchange(str(a), str(b)):
        pytest.skip("the system cannot exchange two paths")
    assert _folder(a) == {"in_b": "b"}
    assert _folder(b) == {"in_a": "a"}
    assert not publish._exchange(str(a), str(tmp_path / "missing"))  # a failed call says so


def test_no_swap_without_a_c_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert publish._exchange(str(a), str(b)) is False
    assert a.is_dir() and b.is_dir() and not any(a.iterdir())


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "move-aside"])
def test_the_switch_runs_inside_the_deferral_with_the_old_folder_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "old.onnx").write_text("old")
    staging = _staging(tmp_path, files={"model.onnx": "new"})
    seen: dict[str, object] = {}

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        seen["before"] = _folder(destination)
        yield
        # Still inside the deferral: the new folder is in place, the old one lies hidden beside it.
        seen["after"] = _folder(destination)
        seen["beside"] = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("out", "outside"))
        seen["old"] = [p.read_text() for p in tmp_path.rglob("old.onnx")]

    with contextlib.ExitStack() as stack:
        if not swap:
            stack.enter_context(_no_exchange(monkeypatch))
        stack.enter_context(publish.interruptions_deferred_by(hold))
        publish.publish_directory(str(staging), str(destination))

    assert seen["before"] == {"old.onnx": "old"}
    assert seen["after"] == {"model.onnx": "new"}
    beside = seen["beside"]
    assert isinstance(beside, list) and len(beside) == 1
    if swap:
        assert beside == [staging.name]  # the swap left the old folder at the staging path
    else:
        assert beside[0].startswith(".out.old-")
    assert seen["old"] == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "outside"]  # and removed after


def test_published_files_and_the_parent_are_flushed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = publish._fsync
    monkeypatch.setattr(publish, "_fsync", lambda path: (synced.append(path), real(path)))
    staging = _staging(tmp_path, files={"model.onnx": "new", "vocab.txt": "a b"})
    publish.publish_directory(str(staging), str(tmp_path / "out"))
    assert sorted(synced) == sorted([str(staging / "model.onnx"), str(staging / "vocab.txt"), str(tmp_path)])


def test_a_hidden_entry_that_cannot_be_removed_does_not_stop_the_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = _staging(tmp_path, files={"model.onnx": "new"})
    (staging / ".gone").write_text("")
    real_unlink = os.unlink

    def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        name = os.path.basename(os.fspath(path))
        if name == "part.onnx":
            raise PermissionError(13, "not allowed", name)  # in the hidden folder: rmtree meets it
        if name == ".gone":
            real_unlink(path)
            raise FileNotFoundError(2, "removed meanwhile", name)  # another process was first
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    publish.publish_directory(str(staging), str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.onnx").read_text() == "new"
    assert not (tmp_path / "out" / ".gone").exists()


def _model_with_data(folder: Path) -> Path:
    weight = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    for key, value in [("a", "1"), ("b", "2"), ("c", "3")]:
        model.metadata_props.add(key=key, value=value)
    path = folder / "encoder.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="encoder.onnx.data", size_threshold=0
    )
    return path


def test_set_metadata_replaces_and_adds_keys_in_place(tmp_path: Path) -> None:
    path = _model_with_data(tmp_path)
    os.chmod(path, 0o640)
    data = (tmp_path / "encoder.onnx.data").read_bytes()
    publish.set_metadata(str(path), {"b": "two", "d": "4"})

    proto = onnx.load(str(path), load_external_data=False)
    entries = [(p.key, p.value) for p in proto.metadata_props]
    assert entries == [("a", "1"), ("c", "3"), ("b", "two"), ("d", "4")]
    assert (tmp_path / "encoder.onnx.data").read_bytes() == data  # the data file is left as it was
    loaded = onnx.load(str(path))
    assert np.array_equal(
        numpy_helper.to_array(loaded.graph.initializer[0]), np.arange(4096, dtype=np.float32).reshape(64, 64)
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx", "encoder.onnx.data"]


def test_set_metadata_that_fails_leaves_the_model_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _model_with_data(tmp_path)
    before = path.read_bytes()

    def failing_save(proto: onnx.ModelProto, target: str) -> None:
        Path(target).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", failing_save)
    with pytest.raises(OSError, match="No space"):
        publish.set_metadata(str(path), {"a": "changed"})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx", "encoder.onnx.data"]
