"""convert_file: external data layouts, output size, atomic writes, bad input."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import pytest
from onnx import TensorProto

import unwritable
from helpers import assert_equivalent, conv_model, stack_feeds, stack_model
from onnx_conv2matmul import ConvertOptions, InputError, convert_file
from onnx_conv2matmul.errors import Hint
from onnx_conv2matmul.files import load as io_mod

RNG = np.random.default_rng(11)


def _files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _size(path: Path) -> int:
    """The .onnx plus the data files it refers to."""
    from onnx_conv2matmul.files.publish import referenced_files

    return path.stat().st_size + sum(os.path.getsize(p) for p in referenced_files(str(path)) or ())


def test_single_file_in_single_file_out(tmp_path: Path) -> None:
    model = stack_model()
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    report = convert_file(src, dst)
    assert report.external_data is False
    assert _files(tmp_path) == {"in.onnx", "out.onnx"}
    assert report.output_bytes == dst.stat().st_size
    assert dst.stat().st_size <= src.stat().st_size * 1.01 + 2048
    # Every Transpose cancels: the outer pairs with ours, the inner ones through each Relu.
    assert (report.transposes_before, report.transposes_after) == (2, 0)
    assert_equivalent(str(src), str(dst), stack_feeds())


@pytest.mark.parametrize("one_file", [True, False], ids=["one-data-file", "per-tensor-files"])
def test_external_data_in_one_data_file_out(
    tmp_path: Path, one_file: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = stack_model()
    reference = tmp_path / "ref.onnx"
    onnx.save(model, reference)
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "model.onnx"
    onnx.save(
        model,
        src,
        save_as_external_data=True,
        all_tensors_to_one_file=one_file,
        location="model.onnx.data" if one_file else None,
        size_threshold=0,
    )
    assert len(_files(src_dir)) == (2 if one_file else 10)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # Run from another working directory: paths resolve against the model file.
    monkeypatch.chdir(tmp_path)
    report = convert_file("src/model.onnx", "out/rewritten.onnx")
    assert report.external_data is True
    assert report.checker == "passed"
    assert _files(out_dir) == {"rewritten.onnx", "rewritten.onnx.data"}
    dst = out_dir / "rewritten.onnx"
    # Small tensors (the Reshape shape) stay inline; weights go to the data file.
    proto = onnx.load(dst, load_external_data=False)
    inline = {t.name for t in proto.graph.initializer if t.data_location != TensorProto.EXTERNAL}
    assert "shape" in inline
    assert all(
        t.name in inline or t.external_data[0].value == "rewritten.onnx.data" for t in proto.graph.initializer
    )
    # Weights are not duplicated: only the new nodes add a little graph structure.
    assert _size(dst) <= report.input_bytes * 1.01 + 4096  # type: ignore[operator]
    # onnxruntime refuses the input (its Reshape shape is external); the output loads.
    assert_equivalent(str(reference), str(dst), stack_feeds())


def test_rerun_replaces_data_file(tmp_path: Path) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    convert_file(src, dst)
    first = (tmp_path / "o.onnx.data").stat().st_size
    assert _files(tmp_path) == {"m.onnx", "m.onnx.data", "o.onnx", "o.onnx.data"}
    # The old o.onnx reads o.onnx.data until the new one is in place: the new data file
    # takes a name of its own, and the old one goes once nothing refers to it.
    convert_file(src, dst)
    assert (tmp_path / "o.onnx.1.data").stat().st_size == first, "the data file is new, never appended to"
    assert _files(tmp_path) == {"m.onnx", "m.onnx.data", "o.onnx", "o.onnx.1.data"}
    convert_file(src, dst)
    assert _files(tmp_path) == {"m.onnx", "m.onnx.data", "o.onnx", "o.onnx.data"}


def test_inplace_with_external_data(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    model = stack_model()
    reference = tmp_path / "ref.onnx"
    onnx.save(model, reference)
    onnx.save(model, src, save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    report = convert_file(src, None, inplace=True)
    assert len(report.converted) == 4
    assert _files(tmp_path) == {"m.onnx", "m.onnx.1.data", "ref.onnx"}
    assert_equivalent(str(reference), str(src), stack_feeds())


def test_large_output_switches_to_external_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io_mod, "SINGLE_FILE_LIMIT_BYTES", 10_000)
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src)
    report = convert_file(src, dst)
    assert report.external_data is True
    assert (tmp_path / "o.onnx.data").exists()
    assert_equivalent(str(src), str(dst), stack_feeds())


def test_failure_during_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_ir, "save", boom)
    with pytest.raises(OSError):
        convert_file(src, dst)
    with pytest.raises(OSError):
        convert_file(src, None, inplace=True)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_checker_failure_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_conv2matmul import CheckerError

    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src)
    dst.write_bytes(b"previous output")
    calls = []

    def reject(path: str, label: str | None = None) -> None:
        calls.append(path)
        if len(calls) == 2:  # the input passes, the output is rejected
            raise CheckerError("ONNX checker rejected it: test")

    monkeypatch.setattr(io_mod, "run_checker", reject)
    with pytest.raises(CheckerError):
        convert_file(src, dst)
    assert dst.read_bytes() == b"previous output"
    assert _files(tmp_path) == {"m.onnx", "o.onnx"}


# ---- bad input: one clear error, nothing written -------------------------------------------


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = tmp_path / "good.onnx"
    onnx.save(stack_model(), good)
    data = good.read_bytes()
    cases = {}
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    cases["empty"] = (empty, "empty")
    text = tmp_path / "text.onnx"
    text.write_text("this is not a model\n")
    cases["not-onnx"] = (text, "not a valid ONNX")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    cases["truncated"] = (truncated, "not a valid ONNX")
    cases["missing"] = (tmp_path / "missing.onnx", "not found")
    ext = tmp_path / "ext.onnx"
    onnx.save(stack_model(), ext, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    short = tmp_path / "short.onnx"
    short.write_bytes(ext.read_bytes().replace(b"ext.onnx.data", b"sho.onnx.data"))
    blob = (tmp_path / "ext.onnx.data").read_bytes()
    (tmp_path / "sho.onnx.data").write_bytes(blob[: len(blob) // 2])
    cases["truncated-data"] = (short, "truncated")
    nodata = tmp_path / "nodata.onnx"
    nodata.write_bytes(ext.read_bytes().replace(b"ext.onnx.data", b"gone.onnx.dat"))
    cases["missing-data"] = (nodata, "external data file not found")
    return cases


@pytest.mark.parametrize(
    "case", ["empty", "not-onnx", "truncated", "missing", "truncated-data", "missing-data"]
)
def test_bad_input_is_one_clear_error(tmp_path: Path, case: str) -> None:
    path, message = _bad_inputs(tmp_path)[case]
    before = _files(tmp_path)
    with pytest.raises(InputError, match=message):
        convert_file(path, tmp_path / "out.onnx")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink", "file-symlink", "symlink-then-parent"])
@pytest.mark.parametrize("run_checker", [True, False])
def test_external_data_outside_the_models_directory_is_refused(
    tmp_path: Path, where: str, run_checker: bool
) -> None:
    """A location that leaves the model's directory is an input error, and the file is never copied."""
    outside = tmp_path / "ext.onnx"
    onnx.save(stack_model(), outside, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    proto = onnx.load(outside, load_external_data=False)
    locations = {
        "parent": "../ext.onnx.data",
        "absolute": str(tmp_path / "ext.onnx.data"),
        "symlink": "link/ext.onnx.data",  # through a link to a directory outside
        "file-symlink": "link",  # a link to a file outside
        # Inside as text (link/.. is the model's directory), outside once the link is
        # followed first, as the system does: link/.. is the directory above the target.
        "symlink-then-parent": "link/../ext.onnx.data",
    }
    location = locations[where]
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    if where == "symlink":
        (model_dir / "link").symlink_to(tmp_path, target_is_directory=True)
    elif where == "symlink-then-parent":
        (tmp_path / "elsewhere").mkdir()
        (model_dir / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        (model_dir / "ext.onnx.data").write_bytes((tmp_path / "ext.onnx.data").read_bytes())
    elif where == "file-symlink":
        (model_dir / "link").symlink_to(tmp_path / "ext.onnx.data")
    onnx.save(proto, model_dir / "m.onnx")
    with pytest.raises(InputError, match="outside the model's directory"):
        convert_file(model_dir / "m.onnx", model_dir / "out.onnx", run_checker=run_checker)
    kept = {"link"} if "symlink" in where else set()
    kept |= {"ext.onnx.data"} if where == "symlink-then-parent" else set()
    assert _files(model_dir) == {"m.onnx"} | kept


def test_a_parent_step_inside_the_models_directory_is_read_where_the_system_reads(tmp_path: Path) -> None:
    """sub/../w.data with sub a real directory is the model's directory's w.data: accepted."""
    model_dir = tmp_path / "model"
    (model_dir / "sub").mkdir(parents=True)
    onnx.save(stack_model(), model_dir / "m.onnx", save_as_external_data=True, location="w.data",
              size_threshold=0)  # fmt: skip
    expected = onnx.load(model_dir / "m.onnx")
    proto = onnx.load(model_dir / "m.onnx", load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "sub/../w.data"
    onnx.save(proto, model_dir / "m.onnx")
    convert_file(model_dir / "m.onnx", model_dir / "o.onnx")
    assert_equivalent(expected, onnx.load(model_dir / "o.onnx"), stack_feeds())


def test_bad_output_paths(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(conv_model(), src)
    with pytest.raises(InputError, match="directory does not exist"):
        convert_file(src, tmp_path / "nope" / "o.onnx")
    with pytest.raises(InputError, match="output is the input") as raised:
        convert_file(src, src)
    assert raised.value.hint is Hint.OUTPUT_IS_INPUT
    with pytest.raises(InputError, match="cannot be used together"):
        convert_file(src, tmp_path / "o.onnx", inplace=True)
    with pytest.raises(ValueError, match="max_dilation"):
        ConvertOptions(max_dilation=0)


@pytest.mark.parametrize("kind", unwritable.KINDS)
def test_unwritable_output_directory(tmp_path: Path, kind: str) -> None:
    """Refused before anything is read or written, for root too (see ``unwritable``)."""
    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    with unwritable.unwritable_directory(kind, tmp_path) as directory:
        listing = sorted(os.listdir(directory))
        with pytest.raises(
            InputError, match=f"output directory is not writable: {re.escape(str(directory))}$"
        ):
            convert_file(src, directory / "o.onnx")
        assert sorted(os.listdir(directory)) == listing
    assert _files(tmp_path) == {"m.onnx", "m.onnx.data"} | ({directory.name} if kind != "procfs" else set())


@pytest.mark.parametrize(
    "error", [OSError(5, "I/O error"), KeyboardInterrupt()], ids=["io-error", "interrupt"]
)
def test_failure_in_the_middle_of_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """A weight that fails while the data file is half written: nothing published, temp removed."""
    from onnx_conv2matmul.rewrite import apply as rewrite_mod

    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    convert_file(src, dst)  # an earlier output that must survive
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    original = rewrite_mod.transpose_2d
    calls = []

    def failing(array: np.ndarray) -> np.ndarray:  # runs as each new weight is written
        calls.append(array.shape)
        if len(calls) == 3:
            raise error
        return original(array)

    monkeypatch.setattr(rewrite_mod, "transpose_2d", failing)
    for target, inplace in ((dst, False), (None, True)):
        calls.clear()
        with pytest.raises(type(error)):
            convert_file(src, target, inplace=inplace)
        assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_output_never_overwrites_the_inputs_data(tmp_path: Path) -> None:
    """a.onnx keeps its weights in b.onnx.data: writing b.onnx gives its data file another
    name, and a later run replacing b.onnx does not remove a file a.onnx reads."""
    src = tmp_path / "a.onnx"
    model = stack_model()
    reference = tmp_path / "ref.onnx"
    onnx.save(model, reference)
    onnx.save(model, src, save_as_external_data=True, location="b.onnx.data", size_threshold=0)
    before = (tmp_path / "b.onnx.data").read_bytes()
    for _ in range(3):
        convert_file(src, tmp_path / "b.onnx")
        assert (tmp_path / "b.onnx.data").read_bytes() == before
        assert_equivalent(str(reference), str(tmp_path / "b.onnx"), stack_feeds())
    assert _files(tmp_path) == {"a.onnx", "b.onnx", "b.onnx.data", "b.onnx.1.data", "ref.onnx"}
    with pytest.raises(InputError, match="would overwrite a file the input model needs"):
        convert_file(src, tmp_path / "b.onnx.data")


# ---- tensors stored in the model whose data does not fit their shape ------------------------


def _with_tensor_data(tmp_path: Path, case: str) -> Path:
    """stack_model with its first weight's data changed: raw bytes cut short or extended,
    or stored as too few float values."""
    proto = stack_model()
    weight = proto.graph.initializer[0]
    if case == "raw-short":
        weight.raw_data = weight.raw_data[:100]
    elif case == "raw-long":
        weight.raw_data = weight.raw_data + bytes(64)
    else:
        values = onnx.numpy_helper.to_array(weight).ravel()[:10]
        weight.ClearField("raw_data")
        weight.float_data.extend(values.tolist())
    path = tmp_path / f"{case}.onnx"
    onnx.save(proto, path)
    return path


@pytest.mark.parametrize("command", ["convert", "quantize"])
@pytest.mark.parametrize(
    ("case", "skip_checker"),
    [("raw-short", True), ("raw-long", False), ("raw-long", True), ("typed-short", True)],
)
def test_tensor_data_that_does_not_fit_its_shape_is_an_input_error(
    tmp_path: Path, command: str, case: str, skip_checker: bool
) -> None:
    """The checker refuses data that is too short (and its message suggests skipping it), but
    not data that is too long: either way the loader says which tensor, exit 2."""
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    path = _with_tensor_data(tmp_path, case)
    args = [str(path), str(tmp_path / "o.onnx"), *(["--skip-checker"] if skip_checker else [])]
    result = CliRunner().invoke(main, ["quantize", *args] if command == "quantize" else args)
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor 'w0' holds" in lines[0], result.stderr
    assert "[32, 32, 1] and type FLOAT need" in lines[0]
    assert _files(tmp_path) == {path.name}


def test_external_data_beyond_its_file_is_the_truncated_error_in_every_command(tmp_path: Path) -> None:
    """An external length of 1e18: convert said "File too large" (its copy started first);
    now every command says which tensor and file, as quantize did."""
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    proto = onnx.load(src, load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "length":
            entry.value = str(10**18)
    onnx.save(proto, src)
    before = _files(tmp_path)
    for command in ([], ["quantize"], ["--inplace"]):
        args = [*command, str(src)] + ([] if command == ["--inplace"] else [str(tmp_path / "o.onnx")])
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.stderr
        assert (
            "external data file is truncated" in result.stderr
            and "needs 1000000000000000000" in result.stderr
        )
        assert _files(tmp_path) == before


@pytest.mark.parametrize("length", [0, 100, 4095, 4097], ids=lambda n: f"length-{n}")
def test_an_external_length_that_contradicts_the_shape_is_refused_in_every_command(
    tmp_path: Path, length: int
) -> None:
    """The tensor's declared length is checked against its shape and type, not only against the
    file (issue 43, rule 2): a mismatch is one line naming the tensor, the file and the field."""
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    proto = onnx.load(src, load_external_data=False)
    weight = proto.graph.initializer[0]
    assert list(weight.dims) == [32, 32, 1]  # 4096 bytes of float
    for entry in weight.external_data:
        if entry.key == "length":
            entry.value = str(length)
    onnx.save(proto, src)
    before = _files(tmp_path)
    for command in ([], ["quantize"], ["--inplace"], ["inspect"]):
        other = [str(tmp_path / "o.onnx")] if command in ([], ["quantize"]) else []
        result = CliRunner().invoke(main, [*command, str(src), *other])
        assert result.exit_code == 2, (command, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (command, result.stderr)
        assert f"tensor 'w0' declares a length of {length} bytes in" in lines[0], (command, lines[0])
        assert "its shape [32, 32, 1] and type FLOAT take 4096" in lines[0]
        assert _files(tmp_path) == before


@pytest.mark.parametrize("command", [[], ["quantize"]], ids=["convert", "quantize"])
def test_outputs_take_the_inputs_permission_bits_without_setuid_or_setgid(
    tmp_path: Path, command: list[str]
) -> None:
    """An input that is setuid, setgid and sticky gives outputs with its rwx bits alone, as
    ``install`` copies them (issue 43, rule 4)."""
    import stat

    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    for path in (src, tmp_path / "m.onnx.data"):
        os.chmod(path, 0o7754)
        if stat.S_IMODE(os.stat(path).st_mode) != 0o7754:
            pytest.skip("this filesystem does not keep setuid/setgid bits")
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    result = CliRunner().invoke(main, [*command, str(src), str(out)])
    assert result.exit_code == 0, result.stderr
    for path in out.parent.iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o754, (path.name, oct(os.stat(path).st_mode))


@pytest.mark.parametrize("name", ["o.onnx.data", "o.onnx.1.data", "o.onnx.12.data"])
@pytest.mark.parametrize("command", [[], ["quantize"]], ids=["convert", "quantize"])
def test_a_report_named_like_the_outputs_data_file_is_refused_before_any_work(
    tmp_path: Path, command: list[str], name: str
) -> None:
    """With o.onnx.data taken, the output's weights go to o.onnx.1.data: a report of that name
    overwrote them at exit 0 (issue 43, rule 4). Every name the data file may take is refused."""
    from click.testing import CliRunner

    from onnx_conv2matmul.cli.app import main

    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    (out.parent / "o.onnx.data").write_bytes(b"someone else's weights")
    before = _files(out.parent)
    result = CliRunner().invoke(main, [*command, str(src), str(out), "--report-json", str(out.parent / name)])
    assert result.exit_code == 2, result.stderr
    assert (
        "would take a name the output's data file may be given" in result.stderr
        or "would overwrite a model file" in result.stderr  # o.onnx.data: the output's own name
    ), result.stderr
    assert _files(out.parent) == before
