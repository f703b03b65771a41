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
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files import owned, publish
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


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_the_swap_exchanges_two_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relative: bool
) -> None:
    """Relative paths are taken from the working directory (an --out the user typed)."""
    if ctypes.util.find_library("c") is None:
        pytest.skip("no C library to call renameat2 from")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "in_a").write_text("a")
    (b / "in_b").write_text("b")
    probe = tmp_path / "probe"
    probe.mkdir()
    if not publish._exchange(str(probe), str(a)):  # absolute paths: the working directory unused
        pytest.skip("the system cannot exchange two paths")
    publish._exchange(str(probe), str(a))  # back
    monkeypatch.chdir(tmp_path)
    first, second = ("a", "b") if relative else (str(a), str(b))
    assert publish._exchange(first, second)
    assert _folder(a) == {"in_b": "b"}
    assert _folder(b) == {"in_a": "a"}
    assert not publish._exchange(first, "missing")  # a failed call says so


def test_no_swap_where_the_c_library_has_no_renameat2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class OldLibrary:  # a C library from before renameat2: no such attribute
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setattr(ctypes, "CDLL", OldLibrary)
    assert publish._exchange(str(a), str(b)) is False


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


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "move-aside"])
def test_an_old_folder_that_cannot_be_removed_entirely_does_not_stop_the_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "stuck.onnx").write_text("old")
    staging = _staging(tmp_path, files={"model.onnx": "new"})
    real_unlink = os.unlink

    def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.path.basename(os.fspath(path)) == "stuck.onnx":
            raise PermissionError(13, "not allowed", "stuck.onnx")
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    with contextlib.ExitStack() as stack:
        if not swap:
            stack.enter_context(_no_exchange(monkeypatch))
        publish.publish_directory(str(staging), str(destination))
    assert _folder(destination) == {"model.onnx": "new"}


def test_referenced_files_parses_a_model_up_to_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _model_with_data(tmp_path)
    monkeypatch.setattr(publish, "_PARSE_LIMIT_BYTES", os.path.getsize(path))
    assert publish.referenced_files(str(path)) == {str(tmp_path / "encoder.onnx.data")}
    monkeypatch.setattr(publish, "_PARSE_LIMIT_BYTES", os.path.getsize(path) - 1)
    assert publish.referenced_files(str(path)) is None  # larger than the limit: not parsed


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
    assert publish.referenced_files(str(path)) == {str(tmp_path / "encoder.onnx.data")}  # and still read
    loaded = onnx.load(str(path))
    assert np.array_equal(
        numpy_helper.to_array(loaded.graph.initializer[0]), np.arange(4096, dtype=np.float32).reshape(64, 64)
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx", "encoder.onnx.data"]


@pytest.mark.parametrize("leaves", [True, False], ids=["partial-file", "no-file"])
def test_set_metadata_that_fails_leaves_the_model_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leaves: bool
) -> None:
    """The new copy is written beside the model under a hidden temporary name; when writing it
    fails, the model is as it was and the copy is gone (whether or not the failure left it)."""
    path = _model_with_data(tmp_path)
    before = path.read_bytes()
    targets: list[str] = []

    def failing_save(proto: onnx.ModelProto, target: str) -> None:
        targets.append(target)
        if leaves:
            Path(target).write_bytes(b"partial")
        else:
            os.unlink(target)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", failing_save)
    with pytest.raises(OSError, match="No space"):
        publish.set_metadata(str(path), {"a": "changed"})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx", "encoder.onnx.data"]
    assert len(targets) == 1 and os.path.dirname(targets[0]) == str(tmp_path)
    assert re.fullmatch(r"\.encoder\.onnx\.\w+\.tmp", os.path.basename(targets[0]))


def _save(model: onnx.ModelProto, path: Path, data: str | None) -> None:
    if data is None:
        onnx.save_model(model, str(path))
    else:
        onnx.save_model(model, str(path), save_as_external_data=True, location=data, size_threshold=0)


def test_staging_and_scratch_dirs_are_named_after_the_destination_and_the_step(tmp_path: Path) -> None:
    with publish.Destination(tmp_path / "out.onnx") as destination:
        staging = destination.staging_dir()
        assert os.path.dirname(staging) == str(tmp_path)
        assert re.fullmatch(r"\.out\.onnx\.[a-z0-9_]{8}\.tmp", os.path.basename(staging))
        scratch = destination.scratch_dir("auto")
        assert os.path.dirname(scratch) == str(tmp_path)
        assert re.fullmatch(r"\.out\.onnx\.auto-[a-z0-9_]{8}\.tmp", os.path.basename(scratch))
        with pytest.raises(ValueError, match="lowercase letters, not 'Auto1'"):
            destination.scratch_dir("Auto1")
        destination.remove_scratch(scratch)
        destination.remove_scratch(scratch)  # a second time: nothing left to remove, no error
        assert not os.path.exists(scratch)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_recovery_follows_no_link_named_like_a_staging_dir(tmp_path: Path) -> None:
    """A link named like a stale staging directory, to a folder holding the mark and a journal
    that names a data file of the destination: neither the folder nor that file is touched."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    owned.mark(str(target))
    (target / "mine.txt").write_text("mine")
    (tmp_path / "out.onnx.data").write_text("data")
    (target / "obsolete.json").write_text(json.dumps([str(tmp_path / "out.onnx.data")]))
    link = tmp_path / ".out.onnx.abcdefgh.tmp"
    link.symlink_to(target, target_is_directory=True)
    with publish.Destination(tmp_path / "out.onnx"):
        pass
    assert (target / "mine.txt").read_text() == "mine"
    assert (tmp_path / "out.onnx.data").read_text() == "data"
    assert link.is_symlink()


def test_a_journal_that_is_not_a_list_removes_nothing(tmp_path: Path) -> None:
    """A stale staging directory (the mark, no journal list): its journal, an object whose key
    names a data file of the destination, is not read as a list of files to remove."""
    (tmp_path / "out.onnx.data").write_text("data")
    stale = tmp_path / ".out.onnx.abcdefgh.tmp"
    stale.mkdir()
    owned.mark(str(stale))
    (stale / "obsolete.json").write_text(json.dumps({str(tmp_path / "out.onnx.data"): 1}))
    with publish.Destination(tmp_path / "out.onnx"):
        pass
    assert not stale.exists()  # the stale directory goes
    assert (tmp_path / "out.onnx.data").read_text() == "data"  # what its odd journal names stays


@pytest.mark.parametrize("new_data", [True, False], ids=["with-data", "single-file"])
def test_publish_journals_the_replaced_data_and_keeps_what_is_not_its_own(
    tmp_path: Path, new_data: bool
) -> None:
    """The destination read its own data file and a shared one: the journal, written before the
    switch, names its own (and the new data file, if any); after, only the shared one is left."""
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    shared = numpy_helper.from_array(np.ones((4, 4), np.float32), "s")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight, shared],
    )
    old = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.external_data_helper.convert_model_to_external_data(old, location="out.onnx.data", size_threshold=0)
    old.graph.initializer[1].external_data[0].value = "shared.bin"
    onnx.save_model(old, str(tmp_path / "out.onnx"))  # writes both data files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx.data", "shared.bin"]

    seen: dict[str, object] = {}
    with publish.Destination(tmp_path / "out.onnx") as destination:
        staging = destination.staging_dir()
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        onnx_path = os.path.join(staging, "out.onnx")
        data_name = destination.data_name
        assert data_name == "out.onnx.1.data"  # the old one's name is taken
        data_path = os.path.join(staging, data_name) if new_data else None
        _save(model, Path(onnx_path), data_name if new_data else None)

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            seen["journal"] = json.loads(Path(staging, "obsolete.json").read_text())
            (tmp_path / "out.onnx.data").unlink()  # removed meanwhile (by hand): not an error
            yield

        with pytest.raises(ValueError, match=re.escape("is not named 'out.onnx.1.data'")):
            destination.publish(staging, onnx_path, os.path.join(staging, "x.data"), modes=(0o644, 0o644))
        with publish.interruptions_deferred_by(hold):
            destination.publish(staging, onnx_path, data_path, modes=(0o644, 0o640))

    expected = [str(tmp_path / "out.onnx.data")] + ([str(tmp_path / data_name)] if new_data else [])
    assert seen["journal"] == expected
    left = ["out.onnx", "shared.bin"] + ([data_name] if new_data else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left)
    assert stat.S_IMODE((tmp_path / "out.onnx").stat().st_mode) == 0o644
    if new_data:
        assert stat.S_IMODE((tmp_path / data_name).stat().st_mode) == 0o640


def test_the_lock_is_private_and_released_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    destination = publish.Destination(tmp_path / "out.onnx")
    lock = tmp_path / ".out.onnx.lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    with pytest.raises(
        publish.DestinationBusy, match=re.escape(f"another run is writing {tmp_path / 'out.onnx'}")
    ):
        publish.Destination(tmp_path / "out.onnx")
    lock.unlink()  # removed by hand: the release does not mind
    destination.release()
    closed: list[int] = []
    monkeypatch.setattr(os, "close", closed.append)
    destination.release()  # a second release closes nothing
    assert closed == []


def test_no_free_data_name_after_a_thousand(tmp_path: Path) -> None:
    (tmp_path / "out.onnx.data").write_text("")
    for index in range(1, 1000):
        (tmp_path / f"out.onnx.{index}.data").write_text("")
    with pytest.raises(InputError, match=r"no free name .* remove old out\.onnx\.N\.data files"):
        publish.Destination(tmp_path / "out.onnx")
    assert not (tmp_path / ".out.onnx.lock").exists()


def _stale(folder: Path, names: list[Path]) -> Path:
    """What a run killed between its renames leaves: a marked staging directory and its journal."""
    stale = folder / ".out.onnx.abcdefgh.tmp"
    stale.mkdir()
    owned.mark(str(stale))
    (stale / "obsolete.json").write_text(json.dumps([str(p) for p in names]))
    return stale


def _reads(folder: Path, name: str, location: str) -> Path:
    """A model in ``folder`` whose weight is in ``location``."""
    path = _model_with_data(folder)
    model = onnx.load(str(path))
    onnx.save_model(
        model, str(folder / name), save_as_external_data=True, location=location, size_threshold=0
    )
    path.unlink()
    (folder / "encoder.onnx.data").unlink()
    return folder / name


def test_recovery_removes_the_journals_own_data_when_nothing_reads_it(tmp_path: Path) -> None:
    (tmp_path / "out.onnx.1.data").write_text("left by the killed run")
    stale = _stale(tmp_path, [tmp_path / "out.onnx.1.data"])
    with publish.Destination(tmp_path / "out.onnx"):
        pass
    assert not stale.exists() and not (tmp_path / "out.onnx.1.data").exists()


@pytest.mark.parametrize("source", ["reads-it", "reads-another", "unreadable"])
def test_recovery_spares_what_the_input_may_read(tmp_path: Path, source: str) -> None:
    """The input (converted into out.onnx) reads out.onnx.1.data, or another file, or cannot be
    parsed: the journal's out.onnx.1.data is removed only when the input is known not to read it."""
    if source == "unreadable":
        model = tmp_path / "in.onnx"
        model.write_bytes(b"not a model")
        (tmp_path / "out.onnx.1.data").write_text("maybe the input's")
    else:
        model = _reads(tmp_path, "in.onnx", "out.onnx.1.data" if source == "reads-it" else "in.data")
        if source == "reads-another":
            (tmp_path / "out.onnx.1.data").write_text("left by the killed run")
    stale = _stale(tmp_path, [tmp_path / "out.onnx.1.data"])
    with publish.Destination(tmp_path / "out.onnx", source=str(model)):
        pass
    assert not stale.exists()
    assert (tmp_path / "out.onnx.1.data").exists() == (source != "reads-another")


def test_the_sweep_moves_nothing_out_of_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another destination's abandoned staging directory is removed, through this run's own."""
    models = tmp_path / "models"
    models.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    abandoned = models / ".other.onnx.abcdefgh.tmp"
    abandoned.mkdir()
    owned.mark(str(abandoned))
    (abandoned / "part.onnx").write_text("")
    with publish.Destination(models / "out.onnx"):
        pass
    assert sorted(p.name for p in models.iterdir()) == []
    assert list(elsewhere.iterdir()) == []


def test_a_staging_dir_that_cannot_be_emptied_is_released_without_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release removes what it can, without an error: what cannot be removed stays, in the
    staging directory (an empty one is what recovery recognises)."""
    destination = publish.Destination(tmp_path / "out.onnx")
    staging = Path(destination.staging_dir())
    (staging / "stuck.onnx").write_text("")
    (staging / "part").mkdir()
    (staging / "part" / "stuck.data").write_text("")
    (staging / "free.onnx").write_text("")
    real_unlink = os.unlink

    def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.path.basename(os.fspath(path)).startswith("stuck"):
            raise PermissionError(13, "not allowed", os.fspath(path))
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    destination.release()
    monkeypatch.undo()
    assert sorted(p.name for p in staging.iterdir()) == ["part", "stuck.onnx"]
    assert [p.name for p in (staging / "part").iterdir()] == ["stuck.data"]
