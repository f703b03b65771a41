"""Each converted form: numerical equivalence in onnxruntime and the graph produced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    ALL,
    all_initializers,
    assert_equivalent,
    assert_matmul_weights_2d,
    conv_feeds,
    conv_model,
    op_types,
    run,
)
from onnx_conv2matmul import ConvertOptions, ConvToMatMulPass, SkipReason, Status, convert

EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)
DILATED = ConvertOptions(allow_added_transposes=True, extended=True, allow_non_unit_dilation=True)

CASES = [
    # (id, spatial, attrs, options, extra ops expected)
    ("1d", 1, {}, ConvertOptions(allow_added_transposes=True), []),
    ("2d", 2, {}, ConvertOptions(allow_added_transposes=True), []),
    ("3d", 3, {}, ConvertOptions(allow_added_transposes=True), []),
    (
        "1d-explicit-attrs",
        1,
        {"strides": [1], "pads": [0, 0], "dilations": [1], "kernel_shape": [1]},
        ConvertOptions(allow_added_transposes=True),
        [],
    ),
    ("1d-pads", 1, {"pads": [2, 1]}, EXTENDED, ["Pad"]),
    ("2d-pads", 2, {"pads": [1, 0, 2, 3]}, EXTENDED, ["Pad"]),
    ("1d-stride", 1, {"strides": [2]}, EXTENDED, ["Slice"]),
    ("2d-stride", 2, {"strides": [2, 3]}, EXTENDED, ["Slice"]),
    ("3d-stride-one-axis", 3, {"strides": [1, 2, 1]}, EXTENDED, ["Slice"]),
    ("2d-stride-pads", 2, {"strides": [2, 2], "pads": [1, 1, 1, 1]}, EXTENDED, ["Pad", "Slice"]),
    ("1d-auto-pad-valid", 1, {"auto_pad": "VALID", "strides": [2]}, EXTENDED, ["Slice"]),
    (
        "2d-auto-pad-same-upper",
        2,
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        EXTENDED,
        ["Slice"],
    ),
    ("1d-auto-pad-same-lower", 1, {"auto_pad": "SAME_LOWER", "strides": [3]}, EXTENDED, ["Slice"]),
    ("2d-auto-pad-same-unit", 2, {"auto_pad": "SAME_UPPER"}, EXTENDED, []),
    # auto_pad with unit strides pads nothing for a kernel of 1: converted without extended mode.
    ("1d-auto-pad-valid-default", 1, {"auto_pad": "VALID"}, ConvertOptions(allow_added_transposes=True), []),
    (
        "3d-auto-pad-same-lower-default",
        3,
        {"auto_pad": "SAME_LOWER"},
        ConvertOptions(allow_added_transposes=True),
        [],
    ),
    ("1d-dilation", 1, {"dilations": [2]}, DILATED, []),
    ("2d-dilation-stride", 2, {"dilations": [3, 2], "strides": [2, 1]}, DILATED, ["Slice"]),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(("case", "spatial", "attrs", "options", "extra"), CASES, ids=[c[0] for c in CASES])
def test_converted_forms_are_exact(
    case: str,
    spatial: int,
    attrs: dict[str, object],
    options: ConvertOptions,
    extra: list[str],
    bias: bool,
) -> None:
    original = conv_model(spatial=spatial, attrs=attrs, bias=bias)
    rewritten, report = convert(original, options)
    onnx.checker.check_model(rewritten, full_check=True)

    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert report.entries[0].extra_ops == extra
    ops = op_types(rewritten)
    assert "Conv" not in ops
    assert ops.count("MatMul") == 1
    assert ops.count("Add") == (1 if bias else 0)
    assert ops.count("Transpose") == 2
    for op in ("Pad", "Slice"):
        assert ops.count(op) == (1 if op in extra else 0)
    assert_matmul_weights_2d(rewritten, 1)
    assert "W" not in all_initializers(rewritten.graph), "the original weight must be removed"
    assert_equivalent(original, rewritten, conv_feeds(6, spatial))


@pytest.mark.parametrize("opset", [7, 9, 10, 11, 13, 18, 21])
def test_every_opset_gets_ops_it_can_express(opset: int) -> None:
    original = conv_model(spatial=2, attrs={"pads": [1, 0, 0, 1], "strides": [2, 1]}, opset=opset)
    rewritten, report = convert(original, EXTENDED)
    entry = report.entries[0]
    if opset < 10:
        assert entry.reason is SkipReason.OPSET_UNSUPPORTED
        assert "Slice" in entry.detail
        assert op_types(rewritten) == ["Conv"]
        return
    assert entry.status is Status.CONVERTED
    onnx.checker.check_model(rewritten, full_check=True)
    pad = next(n for n in rewritten.graph.node if n.op_type == "Pad")
    assert (len(pad.input) == 1) == (opset < 11), "Pad takes pads as attribute before opset 11"
    assert_equivalent(original, rewritten, conv_feeds(6, 2))


def test_pads_only_work_at_old_opsets() -> None:
    original = conv_model(spatial=1, attrs={"pads": [1, 1]}, opset=7)
    rewritten, report = convert(original, EXTENDED)
    assert report.entries[0].status is Status.CONVERTED
    assert_equivalent(original, rewritten, conv_feeds(6, 1))


@pytest.mark.parametrize("spatial", [1, 2])
def test_fp16_keeps_its_type(spatial: int) -> None:
    original = conv_model(spatial=spatial, dtype=TensorProto.FLOAT16)
    rewritten, report = convert(original, ALL)
    assert report.entries[0].weight_dtype == "FLOAT16"
    inits = all_initializers(rewritten.graph)
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMul")
    assert inits[matmul.input[1]].data_type == TensorProto.FLOAT16
    assert_equivalent(original, rewritten, conv_feeds(6, spatial, dtype=np.float16), dtype=np.float16)


def test_fp64_against_numpy() -> None:
    """onnxruntime has no float64 Conv kernel: compare with the definition instead."""
    original = conv_model(spatial=1, dtype=TensorProto.DOUBLE)
    w = onnx.numpy_helper.to_array(original.graph.initializer[0])
    b = onnx.numpy_helper.to_array(original.graph.initializer[1])
    rewritten, report = convert(original, ALL)
    assert report.entries[0].weight_dtype == "DOUBLE"
    for feeds in conv_feeds(6, 1, dtype=np.float64):
        x = feeds["x"]
        expected = np.einsum("mc,nct->nmt", w[:, :, 0], x) + b[None, :, None]
        (actual,) = run(rewritten, feeds)
        assert actual.dtype == np.float64
        np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


def test_weight_from_constant_node() -> None:
    original = conv_model(spatial=1, weight_source="constant")
    rewritten, report = convert(original, ALL)
    assert report.entries[0].status is Status.CONVERTED
    assert "Constant" not in op_types(rewritten), "the dead Constant node is removed"
    assert report.tensors_removed == 1
    assert_matmul_weights_2d(rewritten, 1)
    assert_equivalent(original, rewritten, conv_feeds(6, 1))


def test_weight_is_transposed_reshape() -> None:
    original = conv_model(spatial=2, in_channels=3, out_channels=4, bias=False)
    w = onnx.numpy_helper.to_array(original.graph.initializer[0])
    rewritten, _ = convert(original, ALL)
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMul")
    wt = onnx.numpy_helper.to_array(all_initializers(rewritten.graph)[matmul.input[1]])
    assert wt.shape == (3, 4)
    np.testing.assert_array_equal(wt, w.reshape(4, 3).T)


def test_names_are_readable_and_unique() -> None:
    original = conv_model(spatial=1, name="encoder/layer0/pw1")
    # Occupy the name the rewrite would pick first.
    original.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.float32), "W_matmul"))
    rewritten, report = convert(original, ALL)
    names = [n.name for n in rewritten.graph.node]
    assert len(names) == len(set(names))
    assert report.entries[0].matmul == "encoder/layer0/pw1/MatMul"
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMul")
    assert matmul.input[1] == "W_matmul_1"
    assert rewritten.graph.output[0].name == "y", "graph output names never change"


def test_proto_input_is_not_modified() -> None:
    original = conv_model(spatial=1)
    before = original.SerializeToString()
    convert(original, ALL)
    assert original.SerializeToString() == before


def test_ir_model_is_converted_in_place() -> None:
    import onnx_ir as ir

    model = ir.serde.deserialize_model(conv_model(spatial=1))
    same, report = convert(model, ALL)
    assert same is model
    assert [n.op_type for n in model.graph] == ["Transpose", "MatMul", "Add", "Transpose"]
    assert report.converted_params == 30


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (17, 64), (100, 33), (2048, 40)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_blocked_transpose_is_the_transpose(shape: tuple[int, int], dtype: type) -> None:
    from onnx_conv2matmul.rewrite.apply import transpose_2d

    a = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    out = transpose_2d(a)
    assert out.flags.c_contiguous and out.dtype == a.dtype
    np.testing.assert_array_equal(out, a.T)


def _converted_in_ir(model: onnx.ModelProto, options: ConvertOptions) -> ir.Model:
    ir_model = ir.serde.deserialize_model(model)
    ConvToMatMulPass(options)(ir_model)
    return ir_model


@pytest.mark.parametrize("opset", [17, 10], ids=["pads-input", "pads-attribute"])
def test_created_values_have_their_names_types_and_shapes_in_the_ir(opset: int) -> None:
    """What a pass after ours sees: every Constant and the weight typed and shaped, every
    node and value named after the conv (mutation testing: ``Rewriter``)."""
    model = conv_model(spatial=2, attrs={"strides": [2, 1], "pads": [1, 0, 1, 0]}, opset=opset)
    ir_model = _converted_in_ir(model, EXTENDED)
    constants = {}
    for node in ir_model.graph:
        assert node.name is not None and node.name.startswith("pw/")
        if node.op_type == "Constant":
            (out,) = node.outputs
            tensor = node.attributes["value"].value
            assert node.name == f"{out.name}_const"
            assert (tensor.name, tensor.dtype, out.type) == (
                out.name,
                ir.DataType.INT64,
                ir.TensorType(ir.DataType.INT64),
            )
            assert out.shape == ir.Shape([tensor.shape[0]])
            constants[out.name] = tensor.numpy().tolist()
    computed = [o for n in ir_model.graph if n.op_type != "Constant" for o in n.outputs]
    assert [o.name for o in computed] == [
        "pw/channels_last",
        "pw/padded",
        "pw/strided",
        "pw/matmul",
        "pw/biased",
        "y",
    ]
    assert {o.type for o in computed} == {ir.TensorType(ir.DataType.FLOAT)}
    pads = [0, 1, 0, 0, 0, 1, 0, 0]
    assert constants == {
        **({"pw/pads": pads} if opset >= 11 else {}),
        "pw/slice_starts": [0],
        "pw/slice_ends": [2**63 - 1],
        "pw/slice_axes": [1],
        "pw/slice_steps": [2],
    }
    weight = ir_model.graph.initializers["W_matmul"]
    assert (weight.type, weight.shape) == (ir.TensorType(ir.DataType.FLOAT), ir.Shape([6, 5]))
    assert weight.const_value is not None and weight.const_value.name == "W_matmul"
    rewritten = ir.serde.serialize_model(ir_model)
    pad = ["Constant", "Pad"] if opset >= 11 else ["Pad"]
    assert op_types(rewritten) == [
        "Transpose",
        *pad,
        *["Constant"] * 4,
        "Slice",
        "MatMul",
        "Add",
        "Transpose",
    ]
    pad_node = next(n for n in rewritten.graph.node if n.op_type == "Pad")
    attrs = {a.name: helper.get_attribute_value(a) for a in pad_node.attribute}
    assert attrs == (
        {"mode": b"constant"} if opset >= 11 else {"mode": b"constant", "pads": pads, "value": 0.0}
    )
    assert_equivalent(model, rewritten, conv_feeds(6, 2))


@pytest.mark.parametrize(
    ("conv_name", "expected"), [("pw", "pw_weight_matmul"), (None, "conv_weight_matmul")]
)
def test_an_unnamed_weight_is_named_after_its_conv(conv_name: str | None, expected: str) -> None:
    model = conv_model(weight_source="constant")
    ir_model = ir.serde.deserialize_model(model)
    conv = next(n for n in ir_model.graph if n.op_type == "Conv")
    conv.name = conv_name
    assert conv.inputs[1] is not None
    conv.inputs[1].name = None
    ConvToMatMulPass(ALL)(ir_model)
    assert list(ir_model.graph.initializers) == ["B", expected]
    # Created nodes are named after the conv, or after its output when it has no name.
    prefix = f"{conv_name or 'y'}/"
    assert all(n.name is not None and n.name.startswith(prefix) for n in ir_model.graph)
    rewritten = ir.serde.serialize_model(ir_model)
    assert op_types(rewritten) == ["Transpose", "MatMul", "Add", "Transpose"]
    assert_equivalent(model, rewritten, conv_feeds(6, 1))


def test_an_external_weight_is_released_once_its_transpose_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Materializing the MatMul weight unmaps the external source (mutation testing:
    ``_transposed_weight``); an in-memory source has nothing to release."""
    released: list[str | None] = []
    original_release = ir.ExternalTensor.release

    def release(self: ir.ExternalTensor) -> None:
        released.append(self.name)
        original_release(self)

    monkeypatch.setattr(ir.ExternalTensor, "release", release)
    model = conv_model()
    path = tmp_path / "model.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(model)  # saving with external data changes the proto saved
    onnx.save_model(saved, path, save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=0)
    ir_model = ir.load(path)
    ConvToMatMulPass(ALL)(ir_model)
    weight = ir_model.graph.initializers["W_matmul"].const_value
    assert weight is not None and released == []
    expected = numpy_helper.to_array(model.graph.initializer[0]).reshape(5, 6).T
    np.testing.assert_array_equal(weight.numpy(), expected)
    assert released == ["W"]
    rewritten = ir.to_proto(ir_model)
    onnx.load_external_data_for_model(rewritten, str(tmp_path))  # the bias stays external
    assert op_types(rewritten) == ["Transpose", "MatMul", "Add", "Transpose"]
    assert_equivalent(model, rewritten, conv_feeds(6, 1))


@pytest.mark.parametrize(
    ("attrs", "detail"),
    [
        ({}, ""),
        ({"dilations": [2]}, "dilations [2]"),
        ({"strides": [2], "dilations": [2]}, "strides [2], dilations [2]"),
    ],
)
def test_a_converted_entry_details_what_the_extended_mode_took(
    attrs: dict[str, list[int]], detail: str
) -> None:
    """The detail of a converted conv lists its strides, pads and dilations (mutation testing)."""
    model = conv_model(attrs=attrs)
    rewritten, report = convert(model, DILATED)
    assert [(e.status, e.detail) for e in report.entries] == [(Status.CONVERTED, detail)]
    slice_ = ["Constant"] * 4 + ["Slice"] if "strides" in attrs else []
    assert op_types(rewritten) == ["Transpose", *slice_, "MatMul", "Add", "Transpose"]
    assert_equivalent(model, rewritten, conv_feeds(6, 1))


def test_ir_version_4_converts_and_each_dead_weight_counts() -> None:
    """IR version 4, the first without initializers as inputs, converts; two convs' weights
    go, counted one by one (mutation testing: ``analyze``, ``remove_dead_weights``)."""
    model = conv_model(bias=False)
    rng = np.random.default_rng(5)
    w2 = numpy_helper.from_array(rng.standard_normal((4, 5, 1)).astype(np.float32), "W2")
    model.graph.initializer.append(w2)
    model.graph.node.append(onnx.helper.make_node("Conv", ["y", "W2"], ["z"], name="pw2"))
    model.graph.output[0].CopyFrom(onnx.helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4, "T"]))
    model.ir_version = 4
    rewritten, report = convert(model, ALL)
    assert [e.status for e in report.entries] == [Status.CONVERTED, Status.CONVERTED]
    assert report.tensors_removed == 2
    assert set(all_initializers(rewritten.graph)) == {"W_matmul", "W2_matmul"}
    assert op_types(rewritten) == ["Transpose", "MatMul", "MatMul", "Transpose"]
    assert_equivalent(model, rewritten, conv_feeds(6, 1))
