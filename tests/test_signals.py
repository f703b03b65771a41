"""SIGINT and SIGTERM on a real process: staging removed, exit 128 + signal, no traceback.

Each process runs the console entry point declared in pyproject.toml; the test holds it at a
chosen step by replacing one function with a long sleep (a signal interrupts the sleep), and
sends the signal once the process says it has reached that step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import onnx
import pytest

from helpers import conv_model
from processes import LineReader, run_python, spawn_console


def spawn(prelude: str, *args: str) -> tuple[subprocess.Popen[str], LineReader]:
    """Run the console entry point after ``prelude`` (Python code) in a new process."""
    proc = spawn_console(prelude, *args)
    return proc, LineReader(proc)


MARKER = "stalled"


def stall(module: str, function: str) -> str:
    """Prelude: ``module.function`` says so on stderr, then sleeps instead of working."""
    return f"""
        import sys, time
        import {module} as _target
        def _stall(*args, **kwargs):
            sys.stderr.write("{MARKER}\\n")
            sys.stderr.flush()
            time.sleep(600)
        _target.{function} = _stall
    """


def staging(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


SIGNALS = [(signal.SIGINT, 130), (signal.SIGTERM, 143)]
SIGNAL_IDS = ["SIGINT", "SIGTERM"]


@pytest.fixture
def external_model(tmp_path: Path) -> Path:
    src = tmp_path / "m.onnx"
    onnx.save(
        conv_model(spatial=1, attrs={"strides": [2]}),
        src,
        save_as_external_data=True,
        location="m.onnx.data",
        size_threshold=0,
    )
    return src


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize(
    ("command", "target"),
    [
        ("convert", ("onnx_conv2matmul.api", "convert")),  # the data file is being copied
        ("convert --verify", ("onnx_conv2matmul.api", "verify_models")),  # a staged output
        ("quantize", ("onnx_conv2matmul.quantize.onepass", "verify_staged")),  # staged, quantized
    ],
    ids=["convert-copying", "convert-verifying", "quantize-measuring"],
)
def test_signal_while_staging_removes_everything(
    tmp_path: Path, external_model: Path, signum: int, code: int, command: str, target: tuple[str, str]
) -> None:
    before = {p.name for p in tmp_path.iterdir()}
    out = tmp_path / "o.onnx"
    name, *flags = command.split()
    args = (
        [str(external_model), str(out), *flags]
        if name == "convert"
        else [name, str(external_model), str(out)]
    )
    proc, stderr_lines = spawn(stall(*target), *args)
    stderr_lines.wait_for(MARKER)
    assert staging(tmp_path), "the step is reached with an output staged"
    proc.send_signal(signum)
    stdout, stderr = stderr_lines.finish()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and stdout == ""
    assert stderr.strip().splitlines()[-1].endswith("nothing was written"), stderr
    assert {p.name for p in tmp_path.iterdir()} == before, "staging directory left behind"


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
def test_signal_while_timing_candidates_removes_every_staging(tmp_path: Path, signum: int, code: int) -> None:
    """quantize --bench full stages one model per block size tried, with accuracy-level copies
    beside each: an interrupt while they are timed removes them all."""
    src = tmp_path / "enc.onnx"
    onnx.save(
        onnx.load(Path(__file__).parent / "data" / "conformer_small.onnx"),
        src,
        save_as_external_data=True,
        location="enc.onnx.data",
    )
    before = {p.name for p in tmp_path.iterdir()}
    proc, stderr_lines = spawn(
        stall("onnx_conv2matmul.quantize.kernel", "choose_kernel"),
        *("quantize", str(src), str(tmp_path / "o.onnx"), "--verify-lengths", "64", "--bench", "full"),
    )
    stderr_lines.wait_for(MARKER)
    staged = staging(tmp_path)
    assert len(staged) == 3, "one staging directory per block size"
    assert any(p.name.endswith(".level4.onnx") for d in staged for p in d.iterdir())
    proc.send_signal(signum)
    stdout, stderr = stderr_lines.finish()
    assert stdout == ""
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines()[-1].endswith("nothing was written"), stderr
    assert {p.name for p in tmp_path.iterdir()} == before, "staging directories left behind"


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
def test_signal_after_publishing_says_what_was_written(
    tmp_path: Path, external_model: Path, signum: int, code: int
) -> None:
    out = tmp_path / "o.onnx"
    proc, stderr_lines = spawn(
        stall("onnx_conv2matmul.cli.render.convert", "print_convert_report"), str(external_model), str(out)
    )
    stderr_lines.wait_for(MARKER)
    assert out.exists() and not staging(tmp_path)
    proc.send_signal(signum)
    _, stderr = stderr_lines.finish()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert "nothing was written" not in stderr
    assert str(out) in stderr
    onnx.checker.check_model(str(out))


@pytest.mark.parametrize(("signum", "code"), SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("onnx_conv2matmul.cli.app", ["{model}", "{out}"]),  # the entry point importing the CLI
        ("onnx_conv2matmul.cli.render", ["verify", "{model}", "{model}"]),  # a command importing
    ],
    ids=["importing-cli", "importing-in-a-command"],
)
def test_signal_during_start_up(tmp_path: Path, signum: int, code: int, module: str, args: list[str]) -> None:
    """Ctrl-C (or SIGTERM) while modules are imported: one line, no traceback, 128 + signal."""
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    prelude = f"""
        import sys, time
        class _SlowImport:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    sys.stderr.write("importing\\n")
                    sys.stderr.flush()
                    time.sleep(600)
                return None
        sys.meta_path.insert(0, _SlowImport())
    """
    values = {"model": str(src), "out": str(tmp_path / "o.onnx")}
    proc, stderr_lines = spawn(prelude, *[a.format(**values) for a in args], "--report-json-stdout")
    assert stderr_lines.wait_for("importing") == ""
    proc.send_signal(signum)
    stdout, stderr = stderr_lines.finish()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr
    assert stderr.strip().endswith("nothing was written") and len(stderr.strip().splitlines()) == 1
    assert json.loads(stdout)["return_code"] == code
    assert {p.name for p in tmp_path.iterdir()} == {"m.onnx"}


def test_importing_the_package_leaves_signal_handling_alone() -> None:
    """Only the console entry point installs handlers: a library import changes nothing."""
    code = (
        "import signal\n"
        "import onnx_conv2matmul.cli.entry, onnx_conv2matmul.cli.app, onnx_conv2matmul.api\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


# The scratch directories of quantize (--auto's search, gptq's calibration run): under the
# same guard as the output's staging.

# Prelude: the first model written (the scratch copy: the search's fp32 model, gptq's model to
# calibrate) is written, then the process says so and sleeps instead of going on. With
# CLEANING set, the first removal of a directory after that says so too, then waits for a line
# on stdin before it goes on: the test sends a second signal during the cleanup.
SCRATCH_STALL = f"""
    import os, shutil, sys, time
    import onnx_conv2matmul.files.output as _out
    import onnx_conv2matmul.files.publish as _pub
    _save, _rmtree, _remove_dir, _stalled = _out.save, shutil.rmtree, _pub._remove_dir, []
    def _stall(*args, **kwargs):
        _save(*args, **kwargs)
        _stalled.append(True)
        sys.stderr.write("{MARKER}\\n")
        sys.stderr.flush()
        time.sleep(600)
    def _slow(remove):
        def slow(*args, **kwargs):
            if _stalled and os.environ.get("CLEANING"):
                _stalled.clear()
                sys.stderr.write("cleaning\\n")
                sys.stderr.flush()
                sys.stdin.readline()
            return remove(*args, **kwargs)
        return slow
    _out.save = _stall
    shutil.rmtree = _slow(_rmtree)
    _pub._remove_dir = _slow(_remove_dir)  # the staging and scratch directories' own removal
"""


@pytest.fixture
def quantizable(tmp_path: Path) -> Path:
    """A model whose pointwise convs become quantizable MatMuls, with external data, and one
    real input for gptq's calibration."""
    import numpy as np

    from helpers import stack_model

    src = tmp_path / "m.onnx"
    model = stack_model(layers=2)
    onnx.save(model, src, save_as_external_data=True, location="m.onnx.data")
    x = np.random.default_rng(3).standard_normal((1, 20, 32)).astype(np.float32)
    np.savez(tmp_path / "feed.npz", x=x)
    return src


SEARCH = ["--auto", "--min-cosine", "0.9", "--verify-lengths", "16,24"]
GPTQ = ["--algorithm", "gptq", "--block-size", "16", "--inputs", "{feed}"]


def _interrupt_scratch_run(tmp_path: Path, src: Path, flags: list[str], how: str) -> tuple[int, str]:
    """Start ``quantize src tmp_path/q.onnx flags``, stall it with its scratch directory written,
    end it ``how``; return its exit code and stderr."""
    feed = tmp_path / "feed.npz"
    args = ["quantize", str(src), str(tmp_path / "q.onnx"), *(f.format(feed=feed) for f in flags)]
    env = {k: v for k, v in os.environ.items() if k != "ONNX_CONV2MATMUL_DEBUG"}
    if how == "double-SIGINT":
        env["CLEANING"] = "1"
    proc = spawn_console(SCRATCH_STALL, *args, "-q", env=env, stdin=subprocess.PIPE)
    stderr_lines = LineReader(proc)
    stderr_lines.wait_for(MARKER)
    scratch = [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert len(scratch) == 1 and any(scratch[0].iterdir()), "the scratch copy is written when the run stalls"
    if how == "double-SIGINT":
        proc.send_signal(signal.SIGINT)
        stderr_lines.wait_for("cleaning")
        proc.send_signal(signal.SIGINT)  # while the first one's cleanup runs
        assert proc.stdin is not None
        proc.stdin.write("go on\n")
        proc.stdin.flush()
    else:
        proc.send_signal({"SIGKILL": signal.SIGKILL, "SIGHUP": signal.SIGHUP, "SIGTERM": signal.SIGTERM}[how])
    _, stderr = stderr_lines.finish()
    return proc.returncode, stderr


INPUTS = {"m.onnx", "m.onnx.data", "feed.npz"}


@pytest.mark.parametrize(("how", "code"), [("SIGHUP", 129), ("SIGTERM", 143), ("double-SIGINT", 130)])
def test_an_interrupted_search_removes_its_scratch_directory(
    tmp_path: Path, quantizable: Path, how: str, code: int
) -> None:
    returncode, stderr = _interrupt_scratch_run(tmp_path, quantizable, SEARCH, how)
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].endswith("nothing was written"), stderr
    assert {p.name for p in tmp_path.iterdir()} == INPUTS, "scratch, staging or lock left behind"


def test_sighup_during_gptq_removes_its_scratch_directory(tmp_path: Path, quantizable: Path) -> None:
    returncode, stderr = _interrupt_scratch_run(tmp_path, quantizable, GPTQ, "SIGHUP")
    assert returncode == 129, stderr
    assert {p.name for p in tmp_path.iterdir()} == INPUTS


@pytest.mark.parametrize("flags", [SEARCH, GPTQ], ids=["auto", "gptq"])
@pytest.mark.parametrize("next_run", ["same-output", "other-output"])
def test_a_later_run_removes_the_scratch_a_killed_one_left(
    tmp_path: Path, quantizable: Path, flags: list[str], next_run: str
) -> None:
    """SIGKILL leaves the scratch copy and the lock file; the next run onto the same output,
    or onto another one in the same directory, removes them and succeeds."""
    from onnx_conv2matmul.api import quantize_file

    returncode, _ = _interrupt_scratch_run(tmp_path, quantizable, flags, "SIGKILL")
    assert returncode == -signal.SIGKILL
    left = {p.name for p in tmp_path.iterdir()} - INPUTS
    assert any((tmp_path / name).is_dir() for name in left) and ".q.onnx.lock" in left
    out = "q.onnx" if next_run == "same-output" else "other.onnx"
    report = quantize_file(quantizable, tmp_path / out)
    assert report.return_code == 0 and report.output_path is not None
    written = {out, f"{out}.data"}
    assert {p.name for p in tmp_path.iterdir()} == INPUTS | written


def test_a_scratch_directory_a_live_run_holds_is_left_alone(tmp_path: Path, quantizable: Path) -> None:
    """Another destination's staging or scratch directory whose lock is held is in use."""
    from onnx_conv2matmul.api import quantize_file
    from onnx_conv2matmul.files.publish import Destination

    with Destination(tmp_path / "q.onnx") as busy:
        scratch = Path(busy.scratch_dir("auto"))
        (scratch / "fp32.onnx").write_bytes(b"in use")
        report = quantize_file(quantizable, tmp_path / "other.onnx")
        assert report.return_code == 0
        assert (scratch / "fp32.onnx").read_bytes() == b"in use"
    assert not scratch.exists()
