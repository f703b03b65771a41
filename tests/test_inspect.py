"""``inspect``: it agrees with what ``convert`` then does, projects MatMulNBits sizes exactly,
reads no weight and writes nothing; and ``--help`` shows convert's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from helpers import ALL, conv_model, no_bench, stack_model
from onnx_conv2matmul import ConvertOptions, Status, api
from onnx_conv2matmul.api import quantize_file
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.files.load import tensor_bytes
from onnx_conv2matmul.quantize.inspection import inspect_file
from onnx_conv2matmul.quantize.options import QuantizeOptions
from onnx_conv2matmul.quantize.projection import matmul_nbits_sizes
from onnx_conv2matmul.verify.check import VerifyOptions
from processes import TIMEOUT
from test_real_models import MODELS, _fetch
from test_skips import CASES
from test_subgraphs import _if_loop_model

DATA = Path(__file__).resolve().parent / "data"
CONFORMER = DATA / "conformer_small.onnx"
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schema" / "report.schema.json"
EXTENDED = ConvertOptions(extended=True)
EVERYTHING = ConvertOptions(extended=True, allow_non_unit_dilation=True, allow_added_transposes=True)


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), prog_name="onnx-conv2matmul", catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def _validate(validator: jsonschema.Draft202012Validator, data: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]
    assert errors == [], errors


def _files_in(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


# ---- inspect agrees with convert, node by node ------------------------------------------------


def _mixed_skips_model() -> onnx.ModelProto:
    """Convs skipped for several reasons in one graph, beside one that is converted:
    kernel 3, grouped, a weight that is a graph input, strides (extended mode), dilation."""
    rng = np.random.default_rng(3)
    c = 8

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["xt", "w_pw"], ["a"], name="pw"),
        helper.make_node("Conv", ["a", "w_k3"], ["b"], name="k3", pads=[1, 1]),
        helper.make_node("Conv", ["b", "w_grp"], ["c"], name="grouped", group=2),
        helper.make_node("Conv", ["c", "w_in"], ["d"], name="weight_input"),
        helper.make_node("Conv", ["d", "w_s2"], ["e"], name="strided", strides=[2]),
        helper.make_node("Conv", ["e", "w_dil"], ["f"], name="dilated", dilations=[2]),
        helper.make_node("Conv", ["f", "w_dil"], ["g"], name="", dilations=[2]),  # unnamed, shared weight
        helper.make_node("Transpose", ["g"], ["y"], perm=[0, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", c]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [c, c, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T2", c])],
        [
            weight("w_pw", (c, c, 1)),
            weight("w_k3", (c, c, 3)),
            weight("w_grp", (c, c // 2, 1)),
            weight("w_s2", (c, c, 1)),
            weight("w_dil", (c, c, 1)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


_ENTRY_KEYS = ("name", "scope", "op_type", "domain", "status", "reason", "detail", "matmul", "extra_ops")


def _assert_agree(path: Path, options: ConvertOptions, tmp_path: Path, *, checker: bool = False) -> None:
    """inspect's report, then convert's on the same file: the same entries and totals, and the
    written model holds what inspect announced."""
    before = _files_in(path.parent)
    inspected = inspect_file(path, options, run_checker=checker)
    assert _files_in(path.parent) == before  # inspect writes nothing
    out = tmp_path / "converted.onnx"
    converted = api.convert_file(path, out, options, run_checker=checker)
    assert len(inspected.nodes) == len(converted.entries)
    for node, entry in zip(inspected.nodes, converted.entries, strict=True):
        mine, theirs = node.entry.to_dict(), entry.to_dict()
        assert {k: mine[k] for k in _ENTRY_KEYS} == {k: theirs[k] for k in _ENTRY_KEYS}
        if theirs["weight_shape"] is not None:  # inspect may know more: never something else
            assert (
                mine["weight_shape"] == theirs["weight_shape"]
                and mine["weight_bytes"] == theirs["weight_bytes"]
            )
    assert inspected.rewrite.totals() == converted.totals()
    written = onnx.load(out, load_external_data=False)
    names = {n.name: n.op_type for g in _graphs(written.graph) for n in g.node}
    for node in inspected.nodes:
        if node.entry.status is Status.CONVERTED:
            assert names[node.entry.matmul or ""] == "MatMul"
    transposes = sum(t == "Transpose" for t in names.values())
    assert transposes == inspected.rewrite.transposes_after
    added = [n.transposes_added for n in inspected.nodes if n.entry.status is Status.CONVERTED]
    # A Gemm's MatMul form has no channel Transposes to predict: inspect leaves its cost out.
    assert all(
        (a is None) == (n.entry.op_type == "Gemm")
        for n, a in zip(
            [n for n in inspected.nodes if n.entry.status is Status.CONVERTED], added, strict=True
        )
    )
    assert (
        sum(a or 0 for a in added) == inspected.rewrite.transposes_after - inspected.rewrite.transposes_before
    )


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                found.extend(_graphs(sub))
    return found


@pytest.mark.parametrize(
    "options", [ConvertOptions(), EXTENDED, EVERYTHING], ids=["default", "extended", "everything"]
)
def test_agrees_with_convert_on_the_conformer(options: ConvertOptions, tmp_path: Path) -> None:
    _assert_agree(CONFORMER, options, tmp_path, checker=True)


@pytest.mark.parametrize(
    ("build", "options"),
    [
        (_mixed_skips_model, ConvertOptions()),
        (_mixed_skips_model, ConvertOptions(extended=True, allow_non_unit_dilation=True)),
        (_mixed_skips_model, EVERYTHING),
        (_if_loop_model, ConvertOptions()),
        (_if_loop_model, ALL),
        (stack_model, ConvertOptions()),
    ],
    ids=[
        "mixed-default",
        "mixed-dilation",
        "mixed-everything",
        "subgraphs-default",
        "subgraphs-all",
        "stack",
    ],
)
def test_agrees_with_convert_on_built_models(build: Any, options: ConvertOptions, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    onnx.save(build(), source / "m.onnx")
    _assert_agree(source / "m.onnx", options, tmp_path)


@pytest.mark.network
@pytest.mark.parametrize("model", MODELS, ids=[m.id for m in MODELS])
@pytest.mark.parametrize(
    "options", [ConvertOptions(extended=True), EVERYTHING], ids=["extended", "everything"]
)
def test_agrees_with_convert_on_real_models(model: Any, options: ConvertOptions, tmp_path: Path) -> None:
    _assert_agree(_fetch(model), options, tmp_path)


def test_agrees_with_convert_on_every_skip_example(tmp_path: Path) -> None:
    """Every example of every skip reason (tests/test_skips.py): the same entries and totals."""
    for i, (reason, example) in enumerate(CASES):
        source = tmp_path / f"case{i}"
        source.mkdir()
        onnx.save(example.build(), source / "m.onnx")
        out = tmp_path / f"case{i}" / "out"
        out.mkdir()
        inspected = inspect_file(source / "m.onnx", example.options, run_checker=False)
        converted = api.convert_file(source / "m.onnx", out / "o.onnx", example.options, run_checker=False)
        assert [n.entry.reason for n in inspected.nodes] == [e.reason for e in converted.entries], example.id
        assert reason in [n.entry.reason for n in inspected.nodes], example.id
        assert inspected.rewrite.totals() == converted.totals(), example.id


def test_nodes_show_their_attributes(tmp_path: Path) -> None:
    onnx.save(_mixed_skips_model(), tmp_path / "m.onnx")
    report = inspect_file(tmp_path / "m.onnx", ConvertOptions(extended=True), run_checker=False)
    by_name = {n.entry.name: n for n in report.nodes}
    assert by_name["k3"].kernel == [3] and by_name["k3"].pads == [1, 1]
    # Extended mode takes grouped convs too; this one's Transposes would stay.
    assert by_name["grouped"].group == 2 and by_name["grouped"].entry.reason.value == "adds_transposes"  # type: ignore[union-attr]
    assert by_name["strided"].strides == [2]  # extended mode takes it; its Transposes would stay
    assert by_name["strided"].entry.reason.value == "adds_transposes"  # type: ignore[union-attr]
    assert by_name["dilated"].dilations == [2]
    assert by_name["dilated"].entry.reason.value == "dilation_needs_opt_in"  # type: ignore[union-attr]
    # The weight is a graph input: convert reports no shape; inspect does not invent one either.
    assert by_name["weight_input"].entry.weight_shape is None
    assert by_name["pw"].transposes_added is not None


def test_an_op_convert_does_not_rewrite_still_shows_its_weight(tmp_path: Path) -> None:
    model = conv_model(spatial=1, bias=False)
    model.graph.node[0].op_type = "NhwcFusedConv"
    model.graph.node[0].domain = "com.microsoft"
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, tmp_path / "m.onnx")
    (node,) = inspect_file(tmp_path / "m.onnx", run_checker=False).nodes
    assert node.entry.reason is not None and node.entry.reason.value == "unsupported_op"
    assert node.entry.weight_shape == [5, 6, 1] and node.entry.weight_bytes == 120 and node.kernel == [1]


# ---- the MatMulNBits projection -----------------------------------------------------------------


@pytest.mark.parametrize(("bits", "block"), [(4, 16), (4, 64), (8, 32), (4, 256)])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize(("k", "n"), [(64, 32), (100, 7), (17, 48)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_tensor_sizes_are_onnxruntimes(
    bits: int, block: int, symmetric: bool, k: int, n: int, dtype: type
) -> None:
    """The sizes of what onnxruntime's per-node quantizer returns, for K within, across and
    below a block."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    config = DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=symmetric, quant_format=QuantFormat.QOperator, bits=bits
    )
    weight = np.random.default_rng(0).standard_normal((k, n)).astype(dtype)
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
    options = QuantizeOptions(bits=bits, block_size=block, symmetric=symmetric)
    assert matmul_nbits_sizes(k, n, np.dtype(dtype).itemsize, options) == (
        packed.nbytes,
        scales.nbytes,
        0 if symmetric else zero_points.nbytes,
    )


def _projection_model() -> onnx.ModelProto:
    """MatMuls with K across blocks, a weight shared by two MatMuls, one also read by an
    Identity (it stays in float), a pointwise conv between Transposes and a 3-D weight (not quantized)."""
    rng = np.random.default_rng(5)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),  # [100, 40]
        helper.make_node("MatMul", ["h1", "w2"], ["h2"], name="mm2"),  # [40, 40], shared
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="mm3"),
        helper.make_node("MatMul", ["h3", "w3"], ["h4"], name="mm4"),  # [40, 40], also an output
        helper.make_node("Identity", ["w3"], ["w3_out"], name="copy"),
        helper.make_node("Transpose", ["h4"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["t", "wc", "bc"], ["c"], name="pw"),
        helper.make_node("Transpose", ["c"], ["h6"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h6", "w4"], ["y"], name="mm5"),  # [1, 40, 24]: not 2-D
    ]
    graph = helper.make_graph(
        nodes,
        "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 100])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", 24])],
        [
            w("w1", 100, 40),
            w("w2", 40, 40),
            w("w3", 40, 40),
            w("wc", 40, 40, 1),
            w("bc", 40),
            w("w4", 1, 40, 24),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    ("bits", "block", "symmetric"),
    [(4, 64, False), (4, 16, True), (8, 32, False)],
    ids=["4-64-asym", "4-16-sym", "8-32-asym"],
)
@pytest.mark.parametrize("external", [False, True], ids=["one-file", "external-data"])
def test_projection_is_what_quantize_writes(
    tmp_path: Path, bits: int, block: int, symmetric: bool, external: bool
) -> None:
    """The projected tensor bytes are exactly those of quantize's output; the projected file
    size is within 1% plus 512 bytes per MatMulNBits of it (what differs is the graph's own
    protobuf: the new nodes, their attributes, the new tensors' names)."""
    src = tmp_path / "m.onnx"
    if external:
        onnx.save(_projection_model(), src, save_as_external_data=True, location="m.data", size_threshold=0)
    else:
        onnx.save(_projection_model(), src)
    options = QuantizeOptions(bits=bits, block_size=block, symmetric=symmetric)
    projection = inspect_file(src, EVERYTHING, options).projection
    report = quantize_file(
        src,
        tmp_path / "q.onnx",
        convert_options=EVERYTHING,
        options=options,
        verify=VerifyOptions(lengths=(3,), report_only=True),  # sizes, whatever the accuracy
    )
    assert report.quantized_nodes == projection.weights_with_rewrite.quantizable_matmuls == 5
    assert projection.weights_without_rewrite.quantizable_matmuls == 4
    assert projection.projected_tensor_bytes == tensor_bytes(ir.load(tmp_path / "q.onnx"))
    tolerance = 0.01 * report.output_bytes + 512 * report.quantized_nodes
    assert abs(projection.projected_model_bytes - report.output_bytes) <= tolerance


def test_projection_on_the_conformer(tmp_path: Path) -> None:
    """Exact tensor bytes; the file within 10% (the export's node metadata, which onnxruntime's
    quantizer does not carry over to MatMulNBits, is most of the difference)."""
    options = QuantizeOptions()
    projection = inspect_file(CONFORMER, EVERYTHING, options).projection
    report = quantize_file(
        CONFORMER,
        tmp_path / "q.onnx",
        convert_options=EVERYTHING,
        options=options,
        verify=VerifyOptions(lengths=(64,)),
    )
    assert projection.projected_tensor_bytes == tensor_bytes(ir.load(tmp_path / "q.onnx"))
    assert abs(projection.projected_model_bytes - report.output_bytes) <= 0.1 * report.output_bytes
    assert report.weights_with_rewrite is not None and report.weights_without_rewrite is not None
    assert projection.weights_with_rewrite.to_dict() == report.weights_with_rewrite.to_dict()
    assert projection.weights_without_rewrite.to_dict() == report.weights_without_rewrite.to_dict()
    assert projection.weights_with_rewrite.share > projection.weights_without_rewrite.share


# ---- no weight is read, nothing is written ------------------------------------------------------


def _sparse_external_model(directory: Path, layers: int, channels: int) -> Path:
    """Pointwise convs between Transposes whose weights lie in a sparse data file of zeros."""
    size = channels * channels * 4
    inits = []
    nodes = [helper.make_node("Transpose", ["x"], ["h0"], perm=[0, 2, 1])]
    for i in range(layers):
        tensor = onnx.TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[channels, channels, 1])
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "m.data"), ("offset", str(i * size)), ("length", str(size))):
            tensor.external_data.add(key=key, value=value)
        inits.append(tensor)
        nodes.append(helper.make_node("Conv", [f"h{i}", f"w{i}"], [f"h{i + 1}"], name=f"pw{i}"))
    nodes.append(helper.make_node("Transpose", [f"h{layers}"], ["y"], perm=[0, 2, 1]))
    graph = helper.make_graph(
        nodes,
        "sparse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", channels])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", channels])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, directory / "m.onnx")
    with open(directory / "m.data", "wb") as handle:
        handle.truncate(layers * size)  # a hole: no disk used
    return directory / "m.onnx"


def test_no_external_data_is_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _sparse_external_model(tmp_path, layers=4, channels=64)

    def refuse(self: object) -> None:
        raise AssertionError("inspect read a weight")

    monkeypatch.setattr(ir.ExternalTensor, "_load", refuse)
    report = inspect_file(path)
    assert report.external_data and report.rewrite.totals()["converted"] == 4
    assert report.projection.weights_with_rewrite.quantizable_matmuls == 4


_RSS_SCRIPT = """
import resource, sys
from onnx_conv2matmul.cli import app as cli
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    cli.main([*sys.argv[1:], "--json", "-q"])
except SystemExit as exit_:
    assert exit_.code == 0, exit_.code
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024, file=sys.stderr)
"""


def test_peak_memory_stays_far_below_the_weights(tmp_path: Path) -> None:
    """512 MiB of external weights: the command's peak RSS grows by less than 64 MiB."""
    path = _sparse_external_model(tmp_path, layers=32, channels=2048)
    before = _files_in(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, "inspect", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT,
    )
    data = json.loads(done.stdout)
    assert data["totals"]["converted"] == 32 and data["files"]["external_data"] is True
    growth = int(done.stderr.strip().splitlines()[-1])
    assert growth < 64 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB"
    assert _files_in(tmp_path) == before


# ---- the command line -----------------------------------------------------------------------------


def test_json_is_one_object_and_nothing_is_written(tmp_path: Path, validator: Any) -> None:
    onnx.save(_mixed_skips_model(), tmp_path / "m.onnx")
    before = _files_in(tmp_path)
    code, stdout, stderr = invoke("inspect", str(tmp_path / "m.onnx"), "--extended-conv1x1", "--json")
    assert code == 0 and _files_in(tmp_path) == before
    data = json.loads(stdout)
    _validate(validator, data)
    assert list(data)[:7] == ["schema_version", "tool", "version", "command", "input", "return_code", "error"]
    assert data["command"] == "inspect" and data["error"] is None
    assert len(data["convs"]) == data["totals"]["convs"] == 7
    assert {c["status"] for c in data["convs"]} == {"converted", "skipped"}
    assert data["projection"]["bits"] == 4 and data["projection"]["block_size"] == 64
    assert "What convert would do" in stderr and "MatMulNBits projection" in stderr


def test_tables_show_every_node_and_scope(tmp_path: Path) -> None:
    onnx.save(_if_loop_model(), tmp_path / "m.onnx")
    code, stdout, stderr = invoke("inspect", str(tmp_path / "m.onnx"), "--allow-added-transposes")
    assert code == 0 and stdout == ""
    for text in ("then_conv", "else_conv", "nested_conv", "loop_conv", "if0/then_branch", "loop0/body"):
        assert text in stderr
    assert "Nothing was written" in stderr


def test_quantize_settings_reach_the_projection(tmp_path: Path, validator: Any) -> None:
    onnx.save(_projection_model(), tmp_path / "m.onnx")
    code, stdout, _ = invoke(
        "inspect", str(tmp_path / "m.onnx"), "--bits", "8", "--block-size", "16", "--symmetric", "--json"
    )
    assert code == 0
    projection = json.loads(stdout)["projection"]
    assert (projection["bits"], projection["block_size"], projection["symmetric"]) == (8, 16, True)
    assert projection["zero_point_bytes"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "input not found"),
        (["{empty}"], "input is empty"),
        (["{garbage}"], "not a valid ONNX file"),
        (["{truncated}"], "not a valid ONNX file"),
        (["{model}", "--block-size", "100"], "block size"),
        (["{model}", "--bits", "3"], "'3' is not one of"),
        (["{model}", "--max-dilation", "0"], "x>=1"),
        (["{model}", "--no-such-option"], "No such option"),
        ([], "Missing argument"),
    ],
    ids=[
        "missing",
        "empty",
        "garbage",
        "truncated",
        "block-size",
        "bits",
        "max-dilation",
        "usage",
        "no-model",
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, validator: Any, args: list[str], message: str
) -> None:
    onnx.save(conv_model(), tmp_path / "m.onnx")
    data = (tmp_path / "m.onnx").read_bytes()
    (tmp_path / "t.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "e.onnx").write_bytes(b"")
    (tmp_path / "g.onnx").write_bytes(b"\xff" * 100)
    paths = {
        "model": str(tmp_path / "m.onnx"),
        "missing": str(tmp_path / "nope.onnx"),
        "empty": str(tmp_path / "e.onnx"),
        "garbage": str(tmp_path / "g.onnx"),
        "truncated": str(tmp_path / "t.onnx"),
    }
    argv = ["inspect", *(a.format(**paths) for a in args)]
    code, stdout, stderr = invoke(*argv)
    assert code == 2 and stdout == "" and message in stderr and "Traceback" not in stderr
    code, stdout, _ = invoke(*argv, "--json")
    assert code == 2
    error = json.loads(stdout)
    _validate(validator, error)
    assert error["command"] == "inspect" and error["return_code"] == 2 and message in error["error"]


def test_missing_external_data_is_an_input_error(tmp_path: Path) -> None:
    path = _sparse_external_model(tmp_path, layers=2, channels=8)
    os.truncate(tmp_path / "m.data", 10)
    code, _, stderr = invoke("inspect", str(path))
    assert code == 2 and "truncated" in stderr


def test_checker_rejection_names_skip_checker(tmp_path: Path) -> None:
    model = conv_model()
    model.graph.node[0].input[0] = "undefined"
    onnx.save(model, tmp_path / "m.onnx")
    code, _, stderr = invoke("inspect", str(tmp_path / "m.onnx"))
    assert code == 2 and "--skip-checker" in stderr
    code, _, _ = invoke("inspect", str(tmp_path / "m.onnx"), "--skip-checker")
    assert code == 0


def test_schema_is_strict_about_inspect_nodes(validator: Any, tmp_path: Path) -> None:
    onnx.save(conv_model(), tmp_path / "m.onnx")
    data = inspect_file(tmp_path / "m.onnx").to_dict()
    _validate(validator, data)
    without_kernel = {k: v for k, v in data["convs"][0].items() if k != "kernel"}
    assert not validator.is_valid({**data, "convs": [without_kernel]})
    assert not validator.is_valid({**data, "convs": [{**data["convs"][0], "extra": 1}]})


# ---- --help ------------------------------------------------------------------------------------


def test_help_shows_converts_usage_and_options_then_the_commands() -> None:
    code, stdout, _ = invoke("--help")
    assert code == 0
    assert stdout.startswith("Usage: onnx-conv2matmul [OPTIONS] INPUT [OUTPUT]")
    options, commands = stdout.index("--extended-conv1x1"), stdout.index("Commands:")
    assert options < commands
    for flag in (
        "--inplace",
        "--allow-non-unit-dilation",
        "--max-dilation",
        "--verify",
        "--report-json",
        "--version",
    ):
        assert flag in stdout[:commands]
    for command in ("convert", "inspect", "quantize", "verify", "bundle"):
        assert f"  {command} " in stdout[commands:]
    assert stdout.count("--help") == 2  # "-h, --help" once, and the closing line
    code, short, _ = invoke("-h")
    assert code == 0 and short == stdout
    code, own, _ = invoke("convert", "-h")  # still convert's own help, with -h
    assert code == 0 and own.startswith("Usage: onnx-conv2matmul convert") and "-h, --help" in own


@pytest.mark.parametrize("name", ["convert", "verify", "quantize", "inspect", "bundle", "bench"])
def test_every_command_takes_dash_h_after_being_parsed_on_its_own(name: str) -> None:
    """click keeps the help option a command is first asked for: a command first parsed in a
    context of its own (as a caller's code or another test may) must still take -h in the group."""
    command = main.commands[name]  # type: ignore[attr-defined]
    with click.Context(command, info_name=name) as ctx:  # --help alone, as click's default
        command.get_help_option(ctx)
    code, own, _ = invoke(name, "-h")
    assert code == 0 and own.startswith(f"Usage: onnx-conv2matmul {name}") and "-h, --help" in own


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_command_help_is_its_own(command: str) -> None:
    code, stdout, _ = invoke(command, "--help")
    assert code == 0 and stdout.startswith(f"Usage: onnx-conv2matmul {command} [OPTIONS]")
    assert "--extended-conv1x1" in stdout and "Commands:" not in stdout
    assert ("--bits" in stdout) is (command == "inspect")


def test_help_of_the_console_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "onnx_conv2matmul", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT,
    )
    assert "--extended-conv1x1" in done.stdout and "inspect" in done.stdout


def test_rewrite_and_nbits_options_are_shared() -> None:
    """inspect takes every rewrite option convert takes, and quantize's MatMulNBits settings."""
    from onnx_conv2matmul.cli.flags import nbits_options, rewrite_options

    def declared(decorator: Any) -> set[str]:
        return {param.name for param in decorator(lambda: None).__click_params__}

    params = {
        name: {p.name for p in main.commands[name].params} for name in ("convert", "inspect", "quantize")
    }
    assert declared(rewrite_options) <= params["convert"] & params["inspect"]
    assert declared(nbits_options) == {"bits", "block_size", "symmetric"}
    assert declared(nbits_options) <= params["quantize"] & params["inspect"]
