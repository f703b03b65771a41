"""The command line: exit codes, one-line errors, JSON on stdout, nothing written on failure."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import unwritable
from helpers import conv_model, no_bench
from onnx_conv2matmul import ConvertOptions, __version__
from onnx_conv2matmul.cli.app import main
from processes import TIMEOUT


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(conv_model(spatial=1, attrs={"strides": [2]}), path)
    return path


def invoke(*args: str) -> tuple[int, str, str]:
    runner = CliRunner()
    result = runner.invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_version() -> None:
    code, out, _ = invoke("--version")
    assert code == 0 and __version__ in out


def test_convert_default_and_extended(model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    code, stdout, stderr = invoke(str(model_path), str(out))
    assert code == 0 and stdout == ""
    assert "needs_extended_mode" in stderr
    code, _, stderr = invoke(str(model_path), str(out), "--extended-conv1x1")
    assert code == 0 and "adds_transposes" in stderr  # a lone conv: both its Transposes would stay
    assert [n.op_type for n in onnx.load(out).graph.node] == ["Conv"]
    code, _, stderr = invoke(str(model_path), str(out), "--extended-conv1x1", "--allow-added-transposes")
    assert code == 0
    assert "MatMul" in [n.op_type for n in onnx.load(out).graph.node]


def test_report_json_stdout_is_only_json(model_path: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    code, stdout, stderr = invoke(
        str(model_path),
        str(tmp_path / "o.onnx"),
        "--extended-conv1x1",
        "--allow-added-transposes",
        "--report-json-stdout",
        "--report-json",
        str(report),
    )
    assert code == 0
    data = json.loads(stdout)
    assert data == json.loads(report.read_text())
    assert data["tool"] == "onnx-conv2matmul" and data["version"] == __version__
    assert data["options"]["extended"] is True and data["options"]["allow_added_transposes"] is True
    assert data["totals"]["converted"] == 1
    node = data["nodes"][0]
    assert node["status"] == "converted" and node["reason"] is None
    assert node["weight_shape"] == [5, 6, 1] and node["params"] == 30
    assert node["matmul"] == "pw/MatMul" and node["extra_ops"] == ["Slice"]
    assert "Pointwise Conv" in stderr


def test_inplace(model_path: Path) -> None:
    code, _, _ = invoke(str(model_path), "--inplace", "--extended-conv1x1", "--allow-added-transposes", "-q")
    assert code == 0
    assert "Conv" not in [n.op_type for n in onnx.load(model_path).graph.node]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}", "{out}"], "input not found"),
        (["{empty}", "{out}"], "input is empty"),
        (["{text}", "{out}"], "not a valid ONNX file"),
        (["{model}", "{tmp}/nodir/o.onnx"], "output directory does not exist"),
        (["{model}", "{model}"], "use --inplace"),
        (["{model}", "{out}", "--inplace"], "cannot be used together"),
        (["{model}"], "give an output path"),
        (["{model}", "{out}", "--max-dilation", "0"], "0 is not in the range"),
        (
            ["{model}", "{out}", "--report-json", "{tmp}/nodir/r.json"],
            "report directory does not exist",
        ),
        (["{model}", "{out}", "--no-such-option"], "No such option"),
    ],
)
def test_bad_input_exit_2_one_line_nothing_written(
    model_path: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "text.onnx").write_text("hello")
    values = {
        "missing": str(tmp_path / "missing.onnx"),
        "empty": str(tmp_path / "empty.onnx"),
        "text": str(tmp_path / "text.onnx"),
        "model": str(model_path),
        "out": str(tmp_path / "o.onnx"),
        "tmp": str(tmp_path),
    }
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, _stdout, stderr = invoke(*[a.format(**values) for a in args])
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")}


@pytest.mark.parametrize("kind", unwritable.KINDS)
@pytest.mark.parametrize(
    ("command", "target"), [("convert", "output"), ("convert", "report"), ("quantize", "output")]
)
def test_unwritable_directory_exit_2_one_line_nothing_written(
    model_path: Path, tmp_path: Path, kind: str, command: str, target: str
) -> None:
    """An output or report directory nobody can create files in (root included, as CI runs)."""
    with unwritable.unwritable_directory(kind, tmp_path) as directory:
        listing = sorted(os.listdir(directory))
        before = _tree(tmp_path)
        args = [command, str(model_path)]
        if target == "output":
            args.append(str(directory / "o.onnx"))
        else:
            args += [str(tmp_path / "o.onnx"), "--report-json", str(directory / "r.json")]
        code, stdout, stderr = invoke(*args)
        assert code == 2
        assert stdout == ""
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and f"{target} directory is not writable: {directory}" in lines[0]
        assert "Traceback" not in stderr
        assert _tree(tmp_path) == before
        assert sorted(os.listdir(directory)) == listing


def test_console_script_runs_as_a_process(model_path: Path, tmp_path: Path) -> None:
    """A real process: exit code, stderr one line, stdout clean."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnx_conv2matmul",
            str(tmp_path / "nope.onnx"),
            str(tmp_path / "o.onnx"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1


ANSI = r"\x1b\[[0-9;?]*[A-Za-z]"
BAR = r"(?m)(?:^|\r)Publishing +━{10}"  # the bar's last frame: the last phase and the bar


def _last_frame(output: str) -> str:
    """The last frame a live bar drew (it is redrawn in place after a carriage return)."""
    text = re.sub(ANSI, "", output)
    return text.split("\n", 1)[0].rsplit("\r", 1)[-1]


def test_progress_only_on_a_terminal_for_big_models(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from onnx_conv2matmul.cli import common

    def terminal() -> Console:
        return Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)

    pipe = Console(file=io.StringIO(), force_terminal=False)
    assert common.progress_for(terminal(), str(model_path), quiet=False) is None, "small model: no bar"
    monkeypatch.setattr(common, "PROGRESS_MIN_BYTES", 1)
    assert common.progress_for(pipe, str(model_path), quiet=False) is None
    assert common.progress_for(terminal(), str(model_path), quiet=True) is None

    def shown(*calls: tuple[str, ...] | tuple[str, int, int]) -> str:
        """What the bar shows after ``calls`` (its last frame, drawn when it is closed)."""
        console = terminal()
        bar = common.progress_for(console, str(model_path), quiet=False)
        assert bar is not None
        for name, *args in calls:
            getattr(bar, name)(*args)
        bar.close()
        return _last_frame(console.file.getvalue())  # type: ignore[attr-defined]

    assert shown().startswith("Starting")
    # A phase without a count yet shows its name and no percentage.
    loading = shown(("phase", "Loading"))
    assert loading.startswith("Loading") and "%" not in loading
    saving = shown(("phase", "Saving"), ("advance", 1, 4), ("advance", 3, 4))
    assert saving.startswith("Saving") and "75%" in saving
    assert "100%" in shown(("phase", "Saving"), ("advance", 4, 4))
    # A new phase starts from nothing: the label changes and the count is cleared.
    after = shown(("phase", "Saving"), ("advance", 4, 4), ("phase", "Publishing"))
    assert after.startswith("Publishing") and "%" not in after  # not "0%" of the save's total


PHASES = {
    "convert": ["Loading", "Checking the input", "Rewriting", "Saving", "Checking the output", "Publishing"],
    "quantize": [  # the one pass: the original measured once, the candidate checked in memory
        "Loading",
        "Checking the input",
        "Rewriting",
        "Measuring the original",
        "Measuring the original on the check's inputs",
        "Quantizing",
        "Checking the candidate (uniform settings)",
        "Saving",
        "Checking the output",
        "Publishing",
    ],
}


def _external_model(tmp_path: Path) -> Path:
    """A pointwise conv whose weights are in a data file: 16 KiB, and 2 KiB as int4, both above
    the inline limit."""
    src = tmp_path / "m.onnx"
    model = conv_model(spatial=1, in_channels=64, out_channels=64)
    onnx.save(model, src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return src


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_progress_reports_each_phase_and_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """What a command tells the bar: every phase in order, then close; while the data file is
    written the count only grows, the total stays, and the last count is the total."""
    from rich.console import Console

    from onnx_conv2matmul.api import convert_file, quantize_file
    from onnx_conv2matmul.cli import common
    from onnx_conv2matmul.files import datafile as _datafile

    src = _external_model(tmp_path)
    events: list[str | tuple[int, int]] = []
    reported = threading.Event()
    monkeypatch.setattr(common, "PROGRESS_MIN_BYTES", 1)
    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    bar = common.progress_for(console, str(src), quiet=False)
    assert bar is not None

    class Recording:
        """Passes everything on to the real bar and keeps a copy."""

        def phase(self, name: str) -> None:
            events.append(name)
            bar.phase(name)

        def advance(self, done: int, total: int) -> None:
            events.append((done, total))
            reported.set()
            bar.advance(done, total)

        def close(self) -> None:
            events.append("closed")
            bar.close()

    payload = _datafile._payload

    def held_payload(tensor: object) -> object:
        # A new tensor is written only once the save has reported its count: the writer is
        # still busy when the save starts waiting for it, however fast the machine is.
        reported.wait(timeout=120)  # against a hang only: the outcome does not depend on it
        return payload(tensor)  # type: ignore[arg-type]

    monkeypatch.setattr(_datafile, "_payload", held_payload)
    out = tmp_path / "o.onnx"
    options = ConvertOptions(extended=True, allow_added_transposes=True)
    if command == "convert":
        report = convert_file(src, out, options, progress=Recording())
        assert report.return_code == 0 and len(report.converted) == 1
    else:
        q_report = quantize_file(src, out, convert_options=options, progress=Recording())
        assert q_report.return_code == 0 and q_report.quantized_nodes == 1

    assert [e for e in events if isinstance(e, str)] == [*PHASES[command], "closed"]
    saving = events.index("Saving")
    after = events.index(PHASES[command][PHASES[command].index("Saving") + 1])
    counts = events[saving + 1 : after]
    assert counts, "the save reported its count"
    assert all(isinstance(c, tuple) for c in events[saving + 1 : after])
    assert not any(isinstance(e, tuple) for e in events[:saving] + events[after:]), "counts only while saving"
    done = [c[0] for c in counts]  # type: ignore[index]
    totals = {c[1] for c in counts}  # type: ignore[index]
    assert len(totals) == 1, totals
    (total,) = totals
    assert done == sorted(done) and done[0] >= 0 and done[-1] == total
    assert total > 0
    assert _last_frame(console.file.getvalue()).startswith("Publishing")  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("command", ["convert", "quantize"])
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_the_command_draws_the_bar_only_on_a_terminal(tmp_path: Path, command: str, terminal: bool) -> None:
    """The command as a process with stderr on a pseudo-terminal (or a pipe), every model
    counting as big: the bar is drawn, and closed on the last phase, only on the terminal."""
    src = _external_model(tmp_path)
    code = (
        "import sys; from onnx_conv2matmul.cli import app, common; common.PROGRESS_MIN_BYTES = 1; app.run()"
    )
    argv = [
        sys.executable,
        "-c",
        code,
        command,
        str(src),
        str(tmp_path / "o.onnx"),
        "--allow-added-transposes",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR")}
    if not terminal:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        assert not re.search(BAR, proc.stderr)
        return
    leader, follower = os.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the last writer closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env, timeout=300
        )
    finally:
        os.close(follower)
    reader.join(timeout=60)
    os.close(leader)
    output = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, output
    assert re.search(BAR, re.sub(ANSI, "", output))


def test_report_never_overwrites_a_model_file(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(
        conv_model(spatial=1), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0
    )
    out = tmp_path / "o.onnx"
    for report in (src, out, Path(str(out) + ".data"), Path(str(src) + ".data")):
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        code, _, stderr = invoke(str(src), str(out), "--report-json", str(report))
        assert code == 2 and "would overwrite a model file" in stderr
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    code, _, stderr = invoke("verify", str(src), str(src), "--report-json", str(src))
    assert code == 2


def test_written_files_get_the_inputs_permissions(tmp_path: Path) -> None:
    """The output's files take the input's permission bits (private weights stay private);
    the report gets the usual bits of a new file."""
    import os
    import stat

    src = tmp_path / "m.onnx"
    onnx.save(
        conv_model(spatial=1), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0
    )
    os.chmod(src, 0o644)
    os.chmod(tmp_path / "m.onnx.data", 0o640)
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    code, _, _ = invoke(str(src), str(out), "--report-json", str(report), "-q")
    assert code == 0
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert stat.S_IMODE(Path(str(out) + ".data").stat().st_mode) == 0o640
    assert stat.S_IMODE(report.stat().st_mode) == 0o666 & ~mask
    os.chmod(src, 0o600)
    code, _, _ = invoke(str(src), "--inplace", "-q")
    assert code == 0
    assert stat.S_IMODE(src.stat().st_mode) == 0o600
    (data,) = [p for p in tmp_path.iterdir() if p.name.startswith("m.onnx.") and p.name.endswith(".data")]
    assert stat.S_IMODE(data.stat().st_mode) == 0o640


def test_console_script_exit_codes(tmp_path: Path) -> None:
    """The installed entry point ends the process quickly but keeps exit codes and output."""
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        code = (
            "import sys; from onnx_conv2matmul.cli.entry import run; sys.argv[0] = 'onnx-conv2matmul'; run()"
        )
        return subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=TIMEOUT
        )

    encoder = Path(__file__).parent / "data" / "conformer_small.onnx"
    ok = run(str(encoder), str(tmp_path / "o.onnx"), "--report-json-stdout", "-q")
    assert ok.returncode == 0 and json.loads(ok.stdout)["return_code"] == 0
    missing = run(str(tmp_path / "missing.onnx"), str(tmp_path / "o.onnx"))
    assert missing.returncode == 2 and "input not found" in missing.stderr
