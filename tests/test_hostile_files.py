"""Nothing the user did not name as the output is deleted or overwritten (issue 32, class 2).

The tool removes or replaces only what it can prove it wrote (a bundle's manifest record, the
mark of its own folders), and refuses, before any work, an output or report path that is one of
the files the run reads. The refusals are table-driven over every command that writes a report
or a file and every file a run reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from helpers import conv_model, no_bench, stack_model
from onnx_conv2matmul.cli.app import main

SOURCE = Path(__file__).parent / "data" / "parakeet_small"


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, no_bench(args))
    return result.exit_code, result.output


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bundle_does_not_delete_an_unrelated_folder_with_a_manifest(tmp_path: Path) -> None:
    """The example: OUT merely holds a file named manifest.json (and a subfolder): refused, untouched."""
    out = tmp_path / "project"
    (out / "src").mkdir(parents=True)
    (out / "manifest.json").write_text('{"name": "my web app"}')
    (out / "src" / "main.py").write_text("print('hello')")
    before = _snapshot(out)
    code, text = _invoke("bundle", SOURCE, out, "-q")
    assert code == 2, text
    assert "not a bundle this tool wrote" in text
    assert _snapshot(out) == before


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle the tool wrote, then replaced by a second run (its own, unchanged)."""
    out = tmp_path_factory.mktemp("built") / "b"
    assert _invoke("bundle", SOURCE, out, "-q")[0] == 0
    run = json.loads((out / "manifest.json").read_text())["written"]["run"]
    assert _invoke("bundle", SOURCE, out, "-q")[0] == 0
    assert json.loads((out / "manifest.json").read_text())["written"]["run"] != run
    return out


@pytest.mark.parametrize(
    "tamper",
    [
        "added_file",
        "added_folder",
        "changed_size",
        "record_removed",
        "manifest_replaced",
    ],
)
def test_bundle_replaces_only_its_own_unchanged_bundle(built: Path, tmp_path: Path, tamper: str) -> None:
    """A bundle the tool wrote is replaced; after any change it cannot account for, refused and kept."""
    out = tmp_path / "b"
    shutil.copytree(built, out)
    manifest = out / "manifest.json"
    if tamper == "added_file":
        (out / "notes.txt").write_text("mine")
    elif tamper == "added_folder":
        (out / "extra").mkdir()
        (out / "extra" / "x.txt").write_text("mine")
    elif tamper == "changed_size":
        (out / "vocab.txt").write_text((out / "vocab.txt").read_text() + "my token\n")
    elif tamper == "record_removed":
        data = json.loads(manifest.read_text())
        del data["written"]
        manifest.write_text(json.dumps(data))
    else:
        manifest.write_text('{"name": "something else"}')
    before = _snapshot(out)
    code, text = _invoke("bundle", SOURCE, out, "-q")
    assert code == 2, text
    assert _snapshot(out) == before


def _break_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every transposed weight off by 0.1 in its first element: verification fails."""
    from onnx_conv2matmul.rewrite import apply

    original = apply.transpose_2d

    def wrong(array: np.ndarray) -> np.ndarray:
        out = original(array)
        out[0, 0] += out.dtype.type(0.1)
        return out

    monkeypatch.setattr(apply, "transpose_2d", wrong)


def test_keep_on_failure_does_not_replace_a_users_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OUTPUT.verify-failed/ is replaced only when the tool kept a failed output there, unchanged."""
    _break_rewrite(monkeypatch)
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(spatial=1), src)
    kept = tmp_path / "o.onnx.verify-failed"
    args = (src, tmp_path / "o.onnx", "--allow-added-transposes", "--verify", "--keep-on-failure", "-q")
    assert _invoke(*args)[0] == 1
    assert (kept / "o.onnx").is_file()
    assert _invoke(*args)[0] == 1  # its own kept folder: replaced
    (kept / "notes.txt").write_text("mine")
    code, text = _invoke(*args)
    assert code == 2, text
    assert (kept / "notes.txt").read_text() == "mine"
    shutil.rmtree(kept)
    kept.mkdir()  # a folder of the user's by that name, even an empty one
    (kept / "o.onnx").write_text("not a model")
    assert _invoke(*args)[0] == 2
    assert (kept / "o.onnx").read_text() == "not a model"


# --- outputs and reports that are one of the run's inputs, table-driven -------------------------


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "m.onnx"
    onnx.save(stack_model(layers=2, channels=64), model)
    x = np.random.default_rng(0).standard_normal((1, 20, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    (tmp_path / "calib").mkdir()
    np.savez(tmp_path / "calib" / "a.npz", x=x)
    (tmp_path / "score.py").write_text("def score(path):\n    return 1.0\n")
    (tmp_path / "cfg.json").write_text('{"config_version": 1}')
    return {
        "model": model,
        "inputs": tmp_path / "in.npz",
        "inputs_folder": tmp_path / "calib" / "a.npz",
        "validate": tmp_path / "score.py",
        "config": tmp_path / "cfg.json",
        "out": tmp_path / "o.onnx",
    }


# What each read file is given as: (the option, its value from the file's path).
READ = {
    "inputs": ("--inputs", lambda p: p),
    "inputs_folder": ("--inputs", lambda p: p.parent),
    "validate": ("--validate", lambda p: f"{p}:score"),
    "config": ("--config", lambda p: p),
}
# Commands and the outputs they write: (command words before the options, the outputs' options,
# which read files the command takes).
WRITERS = {
    "quantize": (["quantize", "{model}", "{out}"], ["--report-json", "--save-config", "OUTPUT"], list(READ)),
    "verify": (["verify", "{model}", "{model}"], ["--report-json"], ["inputs", "inputs_folder"]),
    "bundle": (
        ["bundle", str(SOURCE), "{tmp}/bundle"],
        ["--report-json"],
        ["inputs", "inputs_folder", "config"],
    ),
}
CASES = [
    (command, output, read)
    for command, (_, outputs, reads) in WRITERS.items()
    for output in outputs
    for read in reads
    if (output, read) != ("--save-config", "config")  # --auto refuses --config first
]


@pytest.mark.parametrize(("command", "output", "read"), CASES)
def test_no_output_overwrites_a_file_the_run_reads(
    files: dict[str, Path], tmp_path: Path, command: str, output: str, read: str
) -> None:
    words, _, _ = WRITERS[command]
    args = [w.format(model=files["model"], out=files["out"], tmp=tmp_path) for w in words]
    flag, value = READ[read]
    target = files[read]
    if output == "OUTPUT":
        args[2] = str(target)
    else:
        args += [output, str(target)]
    if output == "--save-config":
        args.append("--auto")
    before = target.read_bytes()
    code, text = _invoke(*args, flag, value(target))
    assert code == 2, text
    assert "would overwrite a file this run reads" in text
    assert target.read_bytes() == before


def test_the_read_files_themselves_are_accepted(files: dict[str, Path], tmp_path: Path) -> None:
    """The refusals above are about the paths, not the options: elsewhere the same run works."""
    code, text = _invoke(
        "quantize",
        files["model"],
        files["out"],
        "--inputs",
        files["inputs"],
        "--config",
        files["config"],
        "--report-json",
        tmp_path / "r.json",
    )
    assert code == 0, text
    assert json.loads((tmp_path / "r.json").read_text())["return_code"] == 0


def test_bundle_check_manifest_overwrites_nothing_in_the_folder(built: Path, tmp_path: Path) -> None:
    """``bundle --check DIR --manifest FILE``: no file of the checked folder can be FILE."""
    out = tmp_path / "b"
    shutil.copytree(built, out)
    before = _snapshot(out)
    for name in sorted(before):
        code, text = _invoke("bundle", "--check", out, "--manifest", out / name)
        assert code == 2, (name, text)
    assert _snapshot(out) == before
    code, text = _invoke("bundle", "--check", out, "--manifest", tmp_path / "m.json")
    assert code == 0, text
