"""The external-data writer: where tensors land, fallbacks, faults."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from helpers import assert_equivalent, stack_feeds, stack_model
from onnx_conv2matmul import ConvertOptions, api, convert_file
from onnx_conv2matmul._graphs import is_external
from onnx_conv2matmul.files import datafile as datafile_mod
from onnx_conv2matmul.files import ranges as ranges_mod
from processes import TIMEOUT

RNG = np.random.default_rng(5)


def _locations(path: Path) -> dict[str, tuple[str, int, int]]:
    """Initializer name -> (location, offset, length) of every external tensor."""
    proto = onnx.load(path, load_external_data=False)
    out = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            out[tensor.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]))
    return out


def _matmul_weights(path: Path) -> dict[str, str]:
    """MatMul node name -> the name of its B input."""
    proto = onnx.load(path, load_external_data=False)
    return {n.name: n.input[1] for n in proto.graph.node if n.op_type == "MatMul"}


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_converted_weights_take_the_places_of_the_originals(tmp_path: Path) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data")
    convert_file(src, dst)
    assert_equivalent(str(src), str(dst), stack_feeds())
    before, after = _locations(src), _locations(dst)
    weights = _matmul_weights(dst)
    assert len(weights) == 4
    for i in range(4):
        (node,) = [n for n in weights if f"pw{i}" in n]
        _, offset, length = after[weights[node]]
        assert (offset, length) == before[f"w{i}"][1:], node
    assert (tmp_path / "o.onnx.data").stat().st_size == (tmp_path / "m.onnx.data").stat().st_size


def test_whole_file_copies_keep_the_file_order() -> None:
    """A file the tensors use almost entirely is copied in one piece, from its first used
    byte to its last, each copy of a megabyte or more starting on a page boundary."""
    ranges = [("f", 0, 100), ("f", 100, 300), ("f", 200, 300), ("f", 300, 400), ("g", 0, 2**20)]
    copies, inside = ranges_mod._whole_file_copies(ranges)
    assert [(c.source, c.source_offset, c.length, c.offset) for c in copies] == [
        ("f", 0, 400, 0),
        ("g", 0, 2**20, 4096),
    ]
    assert sorted(inside) == sorted(ranges)
    # A file used at half its bytes is not copied whole.
    copies, inside = ranges_mod._whole_file_copies([("h", 0, 100), ("h", 200, 300)])
    assert copies == [] and inside == []


def _with_dead_bytes(path: Path, junk_share: float) -> None:
    """Save the stack model with junk between its tensors (a file another tool left bloated)."""
    model = stack_model()
    data = bytearray()
    for tensor in model.graph.initializer:
        raw = numpy_helper.to_array(tensor).tobytes()
        if len(raw) <= 1024:
            continue  # onnxruntime reads shapes only from inside the .onnx
        data += RNG.bytes(int(len(raw) * junk_share))
        offset = len(data)
        data += raw
        set_external_data(tensor, location=path.name + ".data", offset=offset, length=len(raw))
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
    Path(str(path) + ".data").write_bytes(bytes(data))
    onnx.save(model, path)


def test_dead_bytes_of_the_input_are_not_copied(tmp_path: Path) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    _with_dead_bytes(src, junk_share=0.5)
    convert_file(src, dst)
    assert_equivalent(str(src), str(dst), stack_feeds())
    data_in, data_out = (tmp_path / "m.onnx.data").stat().st_size, (tmp_path / "o.onnx.data").stat().st_size
    live = sum(length for _, _, length in _locations(dst).values())
    assert data_out == live < data_in * 0.7


def test_many_files_in_one_file_out(tmp_path: Path) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, all_tensors_to_one_file=False)
    convert_file(src, dst)
    assert_equivalent(str(src), str(dst), stack_feeds())
    assert {loc for loc, _, _ in _locations(dst).values()} == {"o.onnx.data"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("o.")) == ["o.onnx", "o.onnx.data"]


def test_external_tensor_attribute(tmp_path: Path) -> None:
    """A Constant node's tensor in external data: converted, and its place reused."""
    w = (RNG.standard_normal((32, 24, 1)) / 5).astype(np.float32)
    const = helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w, "w"))
    other = numpy_helper.from_array(RNG.standard_normal((16, 32)).astype(np.float32), "k")
    graph = helper.make_graph(
        [
            const,
            helper.make_node("Conv", ["x", "w"], ["c"], name="pw"),
            helper.make_node("MatMul", ["k", "c"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 24, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, "T"])],
        [other],
    )
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(
        model,
        src,
        save_as_external_data=True,
        location="m.onnx.data",
        size_threshold=0,
        convert_attribute=True,
    )
    assert onnx.load(src, load_external_data=False).graph.node[0].attribute[0].t.data_location == 1
    report = convert_file(src, dst, ConvertOptions(allow_added_transposes=True))
    assert report.totals()["converted"] == 1
    feeds = [{"x": RNG.standard_normal((1, 24, t)).astype(np.float32)} for t in (1, 7, 40)]
    assert_equivalent(str(src), str(dst), feeds)
    assert (tmp_path / "o.onnx.data").stat().st_size == (tmp_path / "m.onnx.data").stat().st_size


def test_without_kernel_copy_the_bytes_are_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data")
    convert_file(src, tmp_path / "kernel.onnx")

    def unsupported(*args: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(datafile_mod.os, "copy_file_range", unsupported)
    convert_file(src, tmp_path / "read.onnx")
    assert (tmp_path / "read.onnx.data").read_bytes() == (tmp_path / "kernel.onnx.data").read_bytes()
    monkeypatch.delattr(datafile_mod.os, "copy_file_range")
    convert_file(src, tmp_path / "plain.onnx")
    assert (tmp_path / "plain.onnx.data").read_bytes() == (tmp_path / "kernel.onnx.data").read_bytes()


@pytest.mark.parametrize("inplace", [False, True], ids=["output", "inplace"])
def test_copy_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inplace: bool) -> None:
    """The disk fills up in the middle of the copy: an error, the input and old output intact."""
    from onnx_conv2matmul.cli.app import main

    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    model = stack_model()
    # Besides the weights (whose old bytes may be left out of the copy), one tensor that stays.
    model.graph.initializer.append(numpy_helper.from_array(np.ones(4096, np.float32), "kept"))
    onnx.save(model, src, save_as_external_data=True, all_tensors_to_one_file=False)
    convert_file(src, dst)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def filling(*args: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datafile_mod.os, "copy_file_range", filling)
    threads = threading.active_count()
    with pytest.raises(OSError, match="No space left"):
        convert_file(src, None if inplace else dst, inplace=inplace)
    assert threading.active_count() == threads
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    result = subprocess_free_cli(main, [str(src), *(["--inplace"] if inplace else [str(dst)]), "-q"])
    assert result.exit_code != 0 and "No space left on device" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def subprocess_free_cli(main: object, args: list[str]):  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    return CliRunner().invoke(main, args)  # type: ignore[arg-type]


def test_failure_while_rewriting_stops_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data")

    def broken(*args: object) -> None:
        raise RuntimeError("rewrite failed")

    monkeypatch.setattr(api, "convert", broken)
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="rewrite failed"):
        convert_file(src, dst)
    assert threading.active_count() == threads
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_external_tensor_of_a_local_function_is_moved(tmp_path: Path) -> None:
    """A Constant inside a model-local function whose tensor is external data moves with the rest."""
    c = 32
    weight = numpy_helper.from_array(RNG.standard_normal((c, c)).astype(np.float32), "k")
    project = [
        helper.make_node("Constant", [], ["k"], value=weight),
        helper.make_node("MatMul", ["x", "k"], ["y"]),
    ]
    function = helper.make_function(
        "local", "Proj", ["x"], ["y"], project, opset_imports=[helper.make_opsetid("", 17)]
    )
    conv = numpy_helper.from_array((RNG.standard_normal((c, c, 1)) / np.sqrt(c)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["t", "w"], ["h"]),
        helper.make_node("Transpose", ["h"], ["u"], perm=[0, 2, 1]),
        helper.make_node("Proj", ["u"], ["y"], domain="local"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", "T", c]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], [conv])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function])
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(model, src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    # onnx.save leaves function tensors inline: move this one to the end of the data file.
    tensor = model.functions[0].node[0].attribute[0].t
    data_path = tmp_path / "m.onnx.data"
    offset = data_path.stat().st_size
    with data_path.open("ab") as handle:
        handle.write(tensor.raw_data)
    set_external_data(tensor, location="m.onnx.data", offset=offset, length=len(tensor.raw_data))
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    proto = onnx.load(src, load_external_data=False)
    proto.functions[0].CopyFrom(model.functions[0])
    onnx.save(proto, src)
    convert_file(src, dst)
    assert_equivalent(str(src), str(dst), stack_feeds(channels=c))
    moved = onnx.load(dst, load_external_data=False).functions[0].node[0].attribute[0].t
    assert moved.data_location == TensorProto.EXTERNAL
    assert {e.key: e.value for e in moved.external_data}["location"] == "o.onnx.data"


def test_package_lists_its_lazy_attributes() -> None:
    import onnx_conv2matmul

    assert {"convert", "convert_file", "ConvertOptions"} <= set(dir(onnx_conv2matmul))
    assert onnx_conv2matmul.api.convert_file is onnx_conv2matmul.convert_file


def test_the_copy_starts_before_onnx_ir_is_imported(tmp_path: Path) -> None:
    """convert_file parses the input and starts copying its data file, then imports the rest."""
    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    code = (
        "import sys\n"
        "from onnx_conv2matmul.cli import app as cli\n"
        "from onnx_conv2matmul.files import datafile as _datafile\n"
        "assert 'onnx_ir' not in sys.modules and 'rich' not in sys.modules, 'imported with the CLI'\n"
        "start = _datafile.DataFileWriter.start.__func__\n"
        "seen = []\n"
        "def spy(cls, *args, **kwargs):\n"
        "    seen.append('onnx_ir' in sys.modules)\n"
        "    return start(cls, *args, **kwargs)\n"
        "_datafile.DataFileWriter.start = classmethod(spy)\n"
        f"sys.argv = ['x', {str(src)!r}, {str(tmp_path / 'o.onnx')!r}, '--quiet']\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "assert seen == [False], seen\n"
        "assert 'onnx_ir' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT)
    assert (tmp_path / "o.onnx.data").exists()


def test_two_weights_on_the_same_bytes(tmp_path: Path) -> None:
    """Two convs whose weights point at the same external bytes: each new weight gets its own place."""
    model = stack_model(layers=2)
    data = bytearray()
    offsets: dict[str, int] = {}
    for tensor in model.graph.initializer:
        raw = numpy_helper.to_array(tensor).tobytes()
        if len(raw) <= 1024:
            continue
        key = "w" if tensor.name in ("w0", "w1") else tensor.name
        if key not in offsets:
            offsets[key] = len(data)
            data += raw if tensor.name != "w1" else b""
        set_external_data(tensor, location="m.onnx.data", offset=offsets[key], length=len(raw))
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    (tmp_path / "m.onnx.data").write_bytes(bytes(data))
    onnx.save(model, src)
    report = convert_file(src, dst)
    assert len(report.converted) == 2
    assert_equivalent(str(src), str(dst), stack_feeds())
    places = {_locations(dst)[w][1] for w in _matmul_weights(dst).values()}
    assert len(places) == 2


def test_one_file_per_tensor_without_lengths(tmp_path: Path) -> None:
    """The legacy torch exporter writes only a location: lengths come from the type and shape."""
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, all_tensors_to_one_file=False)
    proto = onnx.load(src, load_external_data=False)
    for tensor in proto.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            location = next(e.value for e in tensor.external_data if e.key == "location")
            del tensor.external_data[:]
            tensor.external_data.add(key="location", value=location)
    onnx.save(proto, src)
    ranges = list(ranges_mod.external_ranges(proto, str(tmp_path), 1024).values())
    assert len(ranges) == 4 and all(end - start == 32 * 32 * 4 for _, start, end in ranges)
    copies, inside = ranges_mod._whole_file_copies(ranges)
    assert len(copies) == 4 and len(inside) == 4  # every file starts copying before the rewrite
    convert_file(src, dst)
    assert_equivalent(str(src), str(dst), stack_feeds())
    assert (tmp_path / "o.onnx.data").stat().st_size == 4 * 32 * 32 * 4


def test_places_of_converted_weights_are_not_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old bytes under a transposed weight are left out of the copy when the rewrite
    placed it before the copy got there: here the copy is held in its first chunk (4 KB)
    until the tensors are placed, and copies nothing more (the whole file is 16 KB)."""
    from onnx_conv2matmul.api import convert
    from onnx_conv2matmul.files import load as _io
    from onnx_conv2matmul.files import output as _output

    src = tmp_path / "m.onnx"
    onnx.save(stack_model(), src, save_as_external_data=True, location="m.onnx.data")
    monkeypatch.setattr(datafile_mod, "CHUNK_BYTES", 4096)
    real = datafile_mod.os.copy_file_range
    copied: list[int] = []
    placed = threading.Event()

    def held(*args: int) -> int:
        assert placed.wait(10), "the tensors were never placed"
        moved = real(*args)
        copied.append(moved)
        return moved

    monkeypatch.setattr(datafile_mod.os, "copy_file_range", held)
    with _output.Output(tmp_path / "o.onnx") as output:
        proto = _io.parse_model(str(src))
        output.prefetch(proto, str(tmp_path))
        model, _ = convert(_io.build_model(proto, str(src)).model)
        with output.stage(model, external=True, progress=lambda done, total: placed.set()) as staged:
            staged.publish((0o644, 0o644))
    assert_equivalent(str(src), str(tmp_path / "o.onnx"), stack_feeds())
    # The data file holds only the four weights, all converted: at most the chunk the copy
    # had started before the tensors were placed was copied (none if it had not started).
    assert (tmp_path / "m.onnx.data").stat().st_size == 4 * 32 * 32 * 4 and sum(copied) <= 4096


def test_new_weights_ahead_of_the_copy_do_not_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the copy stuck in its first chunk, the transposed weights placed beyond it are
    written without waiting for it (the last weight is written before the copy moves on)."""
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(stack_model(channels=300), src, save_as_external_data=True, location="m.onnx.data")
    monkeypatch.setattr(datafile_mod, "CHUNK_BYTES", 4096)  # the first chunk: part of w0
    real_copy, real_pwrite = datafile_mod.os.copy_file_range, datafile_mod.os.pwrite
    last_weight = max(offset for name, (_, offset, _) in _locations(src).items() if name.startswith("w"))
    written = threading.Event()
    waited: list[bool] = []

    def stuck_first(*args: int) -> int:
        if not waited:
            waited.append(written.wait(10))
        return real_copy(*args)

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        done = real_pwrite(fd, data, offset)
        if offset >= last_weight:
            written.set()
        return done

    monkeypatch.setattr(datafile_mod.os, "copy_file_range", stuck_first)
    monkeypatch.setattr(datafile_mod.os, "pwrite", pwrite)
    convert_file(src, dst)
    assert waited == [True], "the new weights waited for the copy"
    assert_equivalent(str(src), str(dst), stack_feeds(channels=300))


def test_tensor_list_attribute_in_external_data_is_moved(tmp_path: Path) -> None:
    """A node's list of tensors kept in external data ends up in the output's data file too."""
    from onnx_conv2matmul.files import load as _io
    from onnx_conv2matmul.files import output as _output

    values = [RNG.standard_normal(512).astype(np.float32) for _ in range(2)]
    node = helper.make_node(
        "Bag",
        [],
        ["y"],
        domain="test.domain",
        items=[numpy_helper.from_array(v, f"t{i}") for i, v in enumerate(values)],
    )
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512])])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.domain", 1)]
    )
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "m.onnx"
    onnx.save(
        model,
        src,
        save_as_external_data=True,
        location="m.onnx.data",
        size_threshold=0,
        convert_attribute=True,
    )
    loaded = _io.load_model(str(src))
    with (
        _output.Output(tmp_path / "o.onnx") as output,
        output.stage(loaded.model, external=True) as staged,
    ):
        staged.publish(_output.file_modes(loaded.path, loaded.external_files))
    out = onnx.load(tmp_path / "o.onnx", load_external_data=False)
    items = out.graph.node[0].attribute[0].tensors
    assert [t.data_location for t in items] == [TensorProto.EXTERNAL] * 2
    assert {e.value for t in items for e in t.external_data if e.key == "location"} == {"o.onnx.data"}
    out = onnx.load(tmp_path / "o.onnx")
    for tensor, expected in zip(out.graph.node[0].attribute[0].tensors, values, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), expected)
    # The model in memory is left as it was.
    assert all(is_external(t) for t in loaded.model.graph.node(0).attributes["items"].value)


@pytest.mark.parametrize(
    "dtype",
    [
        ir_dtype.name
        for ir_dtype in (
            ir.DataType.FLOAT,
            ir.DataType.FLOAT16,
            ir.DataType.BFLOAT16,
            ir.DataType.INT64,
            ir.DataType.BOOL,
            ir.DataType.FLOAT8E4M3FN,
            ir.DataType.INT4,
            ir.DataType.UINT4,
            ir.DataType.COMPLEX64,
        )
    ],
)
def test_written_bytes_are_those_of_tobytes(dtype: str) -> None:
    """The writer's payload is the tensor's ``tobytes()``, also for packed types and transposed views."""
    ir_dtype = ir.DataType[dtype]
    array = RNG.integers(-7, 8, size=(6, 10)).T.astype(ir_dtype.numpy())  # not C-contiguous
    eager = ir.tensor(array, dtype=ir_dtype)
    lazy = ir.LazyTensor(lambda: eager, dtype=ir_dtype, shape=eager.shape)
    for tensor in (eager, lazy):
        assert bytes(datafile_mod._payload(tensor)) == tensor.tobytes()


_RANGE = st.tuples(st.sampled_from("ab"), st.integers(0, 60), st.integers(0, 15)).map(
    lambda r: (r[0], r[1], r[1] + r[2])
)


@given(ranges=st.sets(_RANGE, max_size=8), probe=_RANGE)
def test_range_index_finds_the_overlaps_a_scan_finds(
    ranges: set[tuple[str, int, int]], probe: tuple[str, int, int]
) -> None:
    path, start, end = probe
    expected = any(p == path and s < end and start < e for p, s, e in ranges)
    assert ranges_mod._RangeIndex(ranges).overlaps(path, start, end) == expected


def test_layout_invariants_are_checked() -> None:
    """_check_layout accepts a sound layout and refuses each broken invariant."""
    import onnx_ir as ir

    def tensor(name: str, offset: int, length: int) -> ir.ExternalTensor:
        return ir.ExternalTensor("d", offset, length, ir.DataType.UINT8, shape=ir.Shape([length]), name=name)

    check = ranges_mod._check_layout
    new = ranges_mod._Write(tensor("new", 0, 100), 100, 100)  # in a dead tensor's place
    late = ranges_mod._Copy("f", 0, 1024, 50)
    sound = [tensor("kept", 0, 100), tensor("new", 100, 100), tensor("late", 1024, 50)]
    check([late], [new], sound, 1000, 1074)
    with pytest.raises(AssertionError, match="overlaps what comes before"):
        check([ranges_mod._Copy("f", 0, 900, 50)], [], [], 1000, 1074)
    with pytest.raises(AssertionError, match="overlaps another write"):
        check([], [new, ranges_mod._Write(tensor("other", 0, 100), 150, 100)], [], 1000, 1000)
    with pytest.raises(AssertionError, match="outside the file"):
        check([], [], [tensor("far", 1000, 100)], 1000, 1000)
    with pytest.raises(AssertionError, match="written over 'kept'"):
        check([], [new], [tensor("kept", 50, 100), tensor("new", 100, 100)], 1000, 1000)
