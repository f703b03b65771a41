"""Publishing: no kill, interrupt or second writer may leave a mismatched model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import run
from onnx_conv2matmul import InputError, convert_file
from onnx_conv2matmul.files import owned
from onnx_conv2matmul.files.publish import Destination, DestinationBusy, referenced_files
from processes import run_python

RNG = np.random.default_rng(5)
CHANNELS = 32

# Runs the command line with a SIGKILL at the KILL_AT-th call of os.rename, os.replace,
# os.unlink or os.fsync (counted over the whole process); prints the calls it made, in
# order, when it gets to the end.
_HARNESS = """
import os, signal, sys
kill_at = int(os.environ["KILL_AT"])
calls = []
def counted(name, real):
    def call(*args, **kwargs):
        calls.append(name)
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call
for name in ("rename", "replace", "unlink", "fsync"):
    setattr(os, name, counted(name, getattr(os, name)))
from onnx_conv2matmul.cli.app import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print("CALLS", ",".join(calls), file=sys.stderr)
"""


def _calls(stderr: str) -> list[str]:
    listed = stderr.split("CALLS")[-1].strip()
    return listed.split(",") if listed else []


def kill_points(calls: list[str], every: bool) -> list[int]:
    """The calls (numbered from 1) to kill the run at: every one, or the first of each run of
    calls of one kind (the first fsync after the renames, the first unlink after them, ...)
    and the last, so that each step of the publishing is cut at least once."""
    if every:
        return list(range(1, len(calls) + 1))
    chosen = {i + 1 for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name}
    return sorted(chosen | {len(calls)}) if calls else []


def test_the_chosen_kill_points_cut_every_step() -> None:
    calls = ["fsync", "fsync", "rename", "fsync", "unlink", "unlink"]
    assert kill_points(calls, every=False) == [1, 3, 4, 5, 6]
    assert kill_points(calls, every=True) == [1, 2, 3, 4, 5, 6]
    assert kill_points([], every=False) == []


def _model() -> onnx.ModelProto:
    """Pointwise convs between Transposes; the middle one has stride 2, so it is converted
    only in extended mode and the two modes lay out the data file differently."""
    nodes = [helper.make_node("Transpose", ["x"], ["h0"], perm=[0, 2, 1])]
    inits = []
    for i in range(3):
        w = (RNG.standard_normal((CHANNELS, CHANNELS, 1)) / np.sqrt(CHANNELS)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        attrs = {"strides": [2]} if i == 1 else {}
        nodes.append(helper.make_node("Conv", [f"h{i}", f"w{i}"], [f"c{i}"], name=f"pw{i}", **attrs))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("Transpose", ["h3"], ["y"], perm=[0, 2, 1]))
    graph = helper.make_graph(
        nodes,
        "pw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", CHANNELS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "U", CHANNELS])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FEEDS = [{"x": RNG.standard_normal((b, t, CHANNELS)).astype(np.float32)} for b, t in ((1, 7), (2, 40))]


def _outputs(path: Path) -> list[np.ndarray]:
    return [run(str(path), feeds)[0] for feeds in FEEDS]


def _assert_computes(path: Path, expected: list[np.ndarray]) -> None:
    for want, got in zip(expected, _outputs(path), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _visible(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if not p.name.startswith(".")}


def _cli(*args: str, kill_at: int = 0) -> subprocess.CompletedProcess[str]:
    return run_python(_HARNESS, *args, env={**os.environ, "KILL_AT": str(kill_at)})


def _setup(directory: Path) -> tuple[Path, list[np.ndarray]]:
    directory.mkdir()
    model = _model()
    src = directory / "m.onnx"
    onnx.save(model, src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return src, _outputs(src)


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["steps", "every"])
@pytest.mark.parametrize("scenario", ["inplace", "overwrite"])
def test_a_kill_at_any_rename_unlink_or_fsync_leaves_a_working_model(
    tmp_path: Path, scenario: str, every: bool
) -> None:
    """Killed at a rename, unlink or fsync (at each in turn with ``every``; in the default
    run at the first of each step, see :func:`kill_points`), the destination always loads in
    onnxruntime and computes the original's outputs; the next run leaves no trace of it."""
    template, expected = _setup(tmp_path / "template")
    if scenario == "overwrite":
        # An earlier output made without extended mode: its data file is laid out differently.
        assert _cli(str(template), str(tmp_path / "template" / "o.onnx"), "-q").returncode == 0
    args_for = {
        "inplace": lambda d: [str(d / "m.onnx"), "--inplace", "--extended-conv1x1"],
        "overwrite": lambda d: [str(d / "m.onnx"), str(d / "o.onnx"), "--extended-conv1x1"],
    }[scenario]
    destination_name = "m.onnx" if scenario == "inplace" else "o.onnx"
    clean = tmp_path / "clean"
    shutil.copytree(tmp_path / "template", clean)
    finished = _cli(*args_for(clean), "-q")
    assert finished.returncode == 0, finished.stderr
    calls = _calls(finished.stderr)
    _assert_computes(clean / destination_name, expected)
    shutil.rmtree(clean)
    assert len(calls) >= 6 and {"fsync", "rename", "unlink"} <= set(calls), calls  # every step reached
    for kill_at in kill_points(calls, every):
        work = tmp_path / f"kill{kill_at}"
        shutil.copytree(tmp_path / "template", work)
        result = _cli(*args_for(work), "-q", kill_at=kill_at)
        assert result.returncode == -9, f"killed at call {kill_at} of {calls}: {result.stderr}"
        destination = work / destination_name
        _assert_computes(destination, expected)
        # The next run takes over whatever the killed one left.
        assert _cli(*args_for(work), "-q").returncode == 0
        _assert_computes(destination, expected)
        data = {Path(p).name for p in referenced_files(str(destination)) or ()}
        assert len(data) == 1
        kept = {"m.onnx"} if scenario == "inplace" else {"m.onnx", "m.onnx.data", "o.onnx"}
        assert {p.name for p in work.iterdir()} == kept | data, f"killed at call {kill_at}"
        shutil.rmtree(work)


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    src, expected = _setup(tmp_path / "m")
    out = tmp_path / "m" / "o.onnx"
    with Destination(out):
        with pytest.raises(DestinationBusy, match="another run is writing"):
            convert_file(src, out)
        result = _cli(str(src), str(out), "-q")
        assert result.returncode == 2
        assert "another run is writing" in result.stderr and "Traceback" not in result.stderr
        assert not out.exists()
    convert_file(src, out)
    _assert_computes(out, expected)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "lock file removed"


def test_a_stale_lock_file_does_not_block(tmp_path: Path) -> None:
    """A killed run leaves its lock file, but not the lock: the next run proceeds."""
    src, expected = _setup(tmp_path / "m")
    (tmp_path / "m" / ".o.onnx.lock").write_text("")
    convert_file(src, tmp_path / "m" / "o.onnx")
    _assert_computes(tmp_path / "m" / "o.onnx", expected)


def test_recovery_removes_what_a_killed_run_left(tmp_path: Path) -> None:
    """A staging directory whose journal names data files: those the destination does not
    read are removed with it; the one it reads stays."""
    src, expected = _setup(tmp_path / "m")
    directory = tmp_path / "m"
    out = directory / "o.onnx"
    convert_file(src, out)
    (directory / "o.onnx.1.data").write_bytes(b"left by a killed run")
    stale = directory / ".o.onnx.abcd1234.tmp"
    stale.mkdir()
    owned.mark(str(stale))  # as the killed run made it
    journal = [str(directory / "o.onnx.data"), str(directory / "o.onnx.1.data"), str(src)]
    (stale / "obsolete.json").write_text(json.dumps(journal))
    with Destination(directory / "o.onnx.x"):  # another destination, with a run writing it
        other = directory / ".o.onnx.x.abcd1234.tmp"  # ... and its staging
        other.mkdir()
        owned.mark(str(other))
        with Destination(out) as destination:
            assert destination.data_name == "o.onnx.1.data"
        assert not stale.exists() and other.exists()
    assert _visible(directory) == {"m.onnx", "m.onnx.data", "o.onnx", "o.onnx.data"}
    _assert_computes(out, expected)


def test_abandoned_staging_of_other_destinations_is_removed(tmp_path: Path) -> None:
    """Staging and scratch directories of destinations no run holds go with any run in the
    directory, with their lock files; one that holds a journal is left to its own destination."""
    for name in (".a.onnx.abcd1234.tmp", ".b.onnx.auto-abcd1234.tmp", ".c.onnx.gptq-abcd1234.tmp"):
        (tmp_path / name).mkdir()
        owned.mark(str(tmp_path / name))
        (tmp_path / name / "model.onnx.data").write_bytes(b"a copy of the weights")
    (tmp_path / ".b.onnx.lock").write_text("")  # what a killed run leaves
    journaled = tmp_path / ".d.onnx.abcd1234.tmp"
    journaled.mkdir()
    owned.mark(str(journaled))
    (journaled / "obsolete.json").write_text(json.dumps([str(tmp_path / "d.onnx.data")]))
    (tmp_path / "d.onnx.data").write_bytes(b"")
    not_staging = [tmp_path / ".e.onnx.abcd123.tmp", tmp_path / ".f.onnx.ABCD1234.tmp"]
    for path in not_staging:
        path.mkdir()
    # Named like a staging directory, but the user's: it holds no mark of this tool.
    users = tmp_path / ".g.onnx.abcd1234.tmp"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    not_staging.append(users)
    with Destination(tmp_path / "o.onnx"):
        pass
    left = {journaled.name, "d.onnx.data"} | {p.name for p in not_staging}
    assert {p.name for p in tmp_path.iterdir()} == left
    assert (users / "notes.txt").read_text() == "mine"


def test_recovery_leaves_a_look_alike_of_the_users(tmp_path: Path) -> None:
    """A folder named like this destination's staging, but without the tool's mark, is not
    removed, nor are the files a journal in it names (class 2 of issue 32)."""
    src, _ = _setup(tmp_path / "m")
    out = tmp_path / "m" / "o.onnx"
    convert_file(src, out)
    (tmp_path / "m" / "o.onnx.1.data").write_bytes(b"the user's")
    look_alike = tmp_path / "m" / ".o.onnx.abcd1234.tmp"
    look_alike.mkdir()
    (look_alike / "obsolete.json").write_text(json.dumps([str(tmp_path / "m" / "o.onnx.1.data")]))
    (look_alike / "keep.txt").write_text("mine")
    convert_file(src, out)
    assert (look_alike / "keep.txt").read_text() == "mine"
    assert (tmp_path / "m" / "o.onnx.1.data").read_bytes() == b"the user's"
    empty = tmp_path / "m" / ".o.onnx.efgh5678.tmp"
    empty.mkdir()  # what a run killed before its mark leaves: nothing to lose, removed
    convert_file(src, out)
    assert not empty.exists()


def test_staging_left_by_an_interrupt_is_removed_with_the_destination(tmp_path: Path) -> None:
    """A staging directory that no output took over goes when the destination is released."""
    with Destination(tmp_path / "o.onnx") as destination:
        staging = Path(destination.staging_dir())
        assert staging.is_dir()
    assert not staging.exists()
    assert list(tmp_path.iterdir()) == []


def test_data_names_avoid_every_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    for name in ("o.onnx.data", "o.onnx.1.data"):
        (tmp_path / name).write_bytes(b"")
    with Destination(out) as destination:
        assert destination.data_name == "o.onnx.2.data"


@pytest.mark.usefixtures("sigint_raises")
def test_interrupt_during_publish_is_held_until_the_model_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGINT that arrives between the two renames is delivered after the switch, when the
    caller defers interruptions as the command line does."""
    import signal

    from onnx_conv2matmul.cli import signals
    from onnx_conv2matmul.files import publish as _publish

    src, expected = _setup(tmp_path / "m")
    out = tmp_path / "m" / "o.onnx"
    real_rename = os.rename
    renames: list[str] = []

    def rename(a: str, b: str) -> None:
        real_rename(a, b)
        renames.append(b)
        if len(renames) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(_publish.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt), _publish.interruptions_deferred_by(signals.held):
        convert_file(src, out)
    assert [Path(p).name for p in renames] == ["o.onnx.data", "o.onnx"]
    _assert_computes(out, expected)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_the_library_alone_never_touches_signal_handlers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called from a host program, publishing leaves every signal handler as the host set it."""
    import signal

    from onnx_conv2matmul.files import publish as _publish

    src, expected = _setup(tmp_path / "m")
    out = tmp_path / "m" / "o.onnx"
    real_rename = os.rename
    seen: list[object] = []

    def rename(a: str, b: str) -> None:
        seen.extend(signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
        real_rename(a, b)

    swapped: list[int] = []
    real_signal = signal.signal

    def spy(signum: int, handler: object) -> object:
        swapped.append(signum)
        return real_signal(signum, handler)  # type: ignore[arg-type]

    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    monkeypatch.setattr(_publish.os, "rename", rename)
    monkeypatch.setattr(signal, "signal", spy)
    convert_file(src, out)
    assert swapped == []
    assert seen == before * (len(seen) // 3) and seen
    _assert_computes(out, expected)


def test_output_that_is_an_input_data_file_is_refused(tmp_path: Path) -> None:
    src, _ = _setup(tmp_path / "m")
    with pytest.raises(InputError, match="would overwrite a file the input model needs"):
        convert_file(src, tmp_path / "m" / "m.onnx.data")
