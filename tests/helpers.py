"""Builders for small test models and checks shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from hypothesis import settings
from onnx import TensorProto, helper, numpy_helper

from onnx_conv2matmul import ConvertOptions

NP_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
    TensorProto.DOUBLE: np.float64,
}


# Every rewrite the tool can make, Transposes added or not: the tests of the rewrite itself.
ALL = ConvertOptions(allow_added_transposes=True)


def conv_model(
    *,
    spatial: int = 1,
    in_channels: int = 6,
    out_channels: int = 5,
    kernel: Sequence[int] | None = None,
    bias: bool = True,
    attrs: dict[str, object] | None = None,
    dtype: int = TensorProto.FLOAT,
    weight_source: str = "initializer",
    opset: int = 17,
    seed: int = 0,
    name: str = "pw",
    group: int = 1,
) -> onnx.ModelProto:
    """One Conv on input ``x`` [N, C, d1..dn] with symbolic dims.

    ``weight_source``: ``initializer``, ``constant`` (a Constant node),
    ``input_initializer`` (an initializer also listed as graph input) or ``input``.
    With ``group`` above 1, the weight is ``[out_channels, in_channels / group, ...]``.
    """
    rng = np.random.default_rng(seed)
    kernel = list(kernel) if kernel is not None else [1] * spatial
    np_type = NP_TYPES[dtype]
    if group != 1:
        attrs = {"group": group, **(attrs or {})}
    w = rng.standard_normal((out_channels, in_channels // group, *kernel)).astype(np_type)
    b = rng.standard_normal(out_channels).astype(np_type)
    inputs = ["x", "W"] + (["B"] if bias else [])
    nodes = []
    inits = []
    graph_inputs = [
        helper.make_tensor_value_info("x", dtype, ["N", in_channels, *[f"d{i}" for i in range(spatial)]])
    ]
    if weight_source == "constant":
        nodes.append(helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(w, "W")))
    elif weight_source in ("initializer", "input_initializer"):
        inits.append(numpy_helper.from_array(w, "W"))
        if weight_source == "input_initializer":
            graph_inputs.append(helper.make_tensor_value_info("W", dtype, list(w.shape)))
    elif weight_source == "input":
        graph_inputs.append(helper.make_tensor_value_info("W", dtype, list(w.shape)))
    else:
        raise ValueError(weight_source)
    if bias:
        inits.append(numpy_helper.from_array(b, "B"))
    nodes.append(helper.make_node("Conv", inputs, ["y"], name=name, **(attrs or {})))
    graph = helper.make_graph(
        nodes,
        "g",
        graph_inputs,
        [helper.make_tensor_value_info("y", dtype, ["N", out_channels, *[f"o{i}" for i in range(spatial)]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 8)
    return model


def matmul_model(dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """One MatMul with a 64x32 weight: something both quantizers take."""
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np_type)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", dtype, ["N", 64])],
        [helper.make_tensor_value_info("y", dtype, ["N", 32])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def edit_distance(a: Sequence[object], b: Sequence[object]) -> int:
    """The Levenshtein distance by the textbook recurrence: the task tests' error rates, and the
    oracle the tool's own (vectorised) one is checked against."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return session(model).run(None, feeds)  # type: ignore[no-any-return]


def assert_close(expected: list[np.ndarray], actual: list[np.ndarray], *, dtype: type = np.float32) -> None:
    """Equal up to float rounding, scaled by the magnitude of the reference output."""
    tol = {np.float32: 3e-5, np.float16: 4e-3, np.float64: 1e-12}.get(dtype, 3e-5)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert e.shape == a.shape and e.dtype == a.dtype
        if not np.issubdtype(e.dtype, np.floating):
            np.testing.assert_array_equal(e, a)
            continue
        scale = max(1.0, float(np.abs(e.astype(np.float64)).max(initial=0.0)))
        diff = np.abs(e.astype(np.float64) - a.astype(np.float64)).max(initial=0.0) / scale
        assert diff <= tol, f"max scaled diff {diff} > {tol}"


def assert_equivalent(
    original: onnx.ModelProto | str,
    rewritten: onnx.ModelProto | str,
    feeds_list: list[dict[str, np.ndarray]],
    *,
    dtype: type = np.float32,
) -> None:
    ref, new = session(original), session(rewritten)
    for feeds in feeds_list:
        assert_close(ref.run(None, feeds), new.run(None, feeds), dtype=dtype)


def conv_feeds(
    channels: int,
    spatial: int,
    *,
    dtype: type = np.float32,
    batches: Sequence[int] = (1, 3),
    lengths: Sequence[int] = (1, 7, 16, 33),
    seed: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Random inputs at several batch sizes and sequence lengths (every spatial dim)."""
    rng = np.random.default_rng(seed)
    feeds = []
    for batch in batches:
        for length in lengths:
            dims = [length] + [max(1, length // 3 + i) for i in range(spatial - 1)]
            feeds.append({"x": rng.standard_normal((batch, channels, *dims)).astype(dtype)})
    return feeds


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes.extend(all_nodes(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    nodes.extend(all_nodes(sub))
    return nodes


def all_initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    found = {t.name: t for t in graph.initializer}
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                found.update(all_initializers(sub))
    return found


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in all_nodes(model.graph)]


def assert_matmul_weights_2d(model: onnx.ModelProto, expected_matmuls: int) -> None:
    """Every MatMul reads a 2-D initializer on input B (what MatMulNBits needs)."""
    inits = all_initializers(model.graph)
    matmuls = [n for n in all_nodes(model.graph) if n.op_type == "MatMul"]
    assert len(matmuls) == expected_matmuls
    for node in matmuls:
        assert node.input[1] in inits, f"{node.name}: B {node.input[1]} is not an initializer"
        assert len(inits[node.input[1]].dims) == 2


def examples(count: int) -> int:
    """``count`` hypothesis examples in the default profile, scaled by the loaded profile's
    ``max_examples`` (conftest.py: ``HYPOTHESIS_PROFILE=large`` runs 20 times as many)."""
    return max(1, count * settings().max_examples // 100)


_STACK_RNG = np.random.default_rng(11)


def stack_model(layers: int = 4, channels: int = 32) -> onnx.ModelProto:
    """Pointwise convs between Transposes, plus a Reshape whose shape is a small initializer."""
    nodes = [helper.make_node("Transpose", ["x"], ["h0"], perm=[0, 2, 1])]
    inits = []
    for i in range(layers):
        w = (_STACK_RNG.standard_normal((channels, channels, 1)) / np.sqrt(channels)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        inits.append(
            numpy_helper.from_array(_STACK_RNG.standard_normal(channels).astype(np.float32), f"b{i}")
        )
        nodes.append(helper.make_node("Conv", [f"h{i}", f"w{i}", f"b{i}"], [f"c{i}"], name=f"pw{i}"))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"h{i + 1}"]))
    inits.append(numpy_helper.from_array(np.array([0, -1], np.int64), "shape"))
    nodes.append(helper.make_node("Transpose", [f"h{layers}"], ["t"], perm=[0, 2, 1]))
    nodes.append(helper.make_node("Reshape", ["t", "shape"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", channels])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "Z"])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def stack_feeds(channels: int = 32) -> list[dict[str, np.ndarray]]:
    return [
        {"x": _STACK_RNG.standard_normal((b, t, channels)).astype(np.float32)} for b, t in ((1, 3), (2, 50))
    ]


def fused_conv_model(
    *,
    activation: str | None = None,
    params: Sequence[float] | None = None,
    z: bool = False,
    z_type: int | None = None,
    **conv: object,
) -> onnx.ModelProto:
    """``conv_model`` with its Conv made a com.microsoft FusedConv (as onnxruntime's optimizer
    writes it), with ``activation`` and ``activation_params``, and with the input Z ``z`` (of
    the output's shape, or of ``z_type`` and unknown shape) when asked."""
    model = conv_model(**conv)  # type: ignore[arg-type]
    node = model.graph.node[-1]
    node.op_type, node.domain = "FusedConv", "com.microsoft"
    if activation is not None:
        node.attribute.append(helper.make_attribute("activation", activation))
    if params is not None:
        node.attribute.append(helper.make_attribute("activation_params", list(params)))
    if z or z_type is not None:
        if len(node.input) == 2:
            node.input.append("")
        node.input.append("z")
        output = model.graph.output[0].type.tensor_type
        if z_type is None:
            model.graph.input.append(helper.make_tensor_value_info("z", output.elem_type, None))
            model.graph.input[-1].type.tensor_type.shape.CopyFrom(output.shape)
        else:
            model.graph.input.append(helper.make_tensor_value_info("z", z_type, None))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def with_z(
    feeds: list[dict[str, np.ndarray]], out_channels: int, seed: int = 2
) -> list[dict[str, np.ndarray]]:
    """``feeds`` with a random input ``z`` of the conv output's shape (no strides or pads)."""
    rng = np.random.default_rng(seed)
    out = []
    for feed in feeds:
        x = feed["x"]
        shape = (x.shape[0], out_channels, *x.shape[2:])
        out.append({**feed, "z": rng.standard_normal(shape).astype(x.dtype)})
    return out


# The shapes of Gemm's C the builder knows, as dims ("M" and "N" stand for those of the Gemm).
GEMM_C_SHAPES: dict[str, list[str | int]] = {
    "scalar": [],
    "1": [1],
    "N": ["N"],
    "1N": [1, "N"],
    "11": [1, 1],
    "M1": ["M", 1],
    "MN": ["M", "N"],
}


def gemm_model(
    *,
    k: int = 6,
    n: int = 5,
    trans_a: bool = False,
    trans_b: bool = True,
    alpha: float = 1.0,
    beta: float = 1.0,
    c: str | None = "N",
    c_source: str = "initializer",
    dtype: int = TensorProto.FLOAT,
    weight_source: str = "initializer",
    opset: int = 17,
    seed: int = 0,
    name: str = "fc",
) -> onnx.ModelProto:
    """One Gemm on input ``a`` ([M, K], or [K, M] with ``trans_a``; M symbolic).

    ``c``: a key of :data:`GEMM_C_SHAPES` or None (no C). A C whose shape holds M is a graph
    input (``c_source`` ``input``), so that M can change between runs. ``weight_source``:
    as for :func:`conv_model`.
    """
    rng = np.random.default_rng(seed)
    np_type = NP_TYPES[dtype]
    w = (rng.standard_normal((n, k) if trans_b else (k, n)) / np.sqrt(k)).astype(np_type)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    graph_inputs = [helper.make_tensor_value_info("a", dtype, [k, "M"] if trans_a else ["M", k])]
    if weight_source == "constant":
        nodes.append(helper.make_node("Constant", [], ["B"], value=numpy_helper.from_array(w, "B")))
    elif weight_source in ("initializer", "input_initializer"):
        inits.append(numpy_helper.from_array(w, "B"))
        if weight_source == "input_initializer":
            graph_inputs.append(helper.make_tensor_value_info("B", dtype, list(w.shape)))
    elif weight_source == "input":
        graph_inputs.append(helper.make_tensor_value_info("B", dtype, list(w.shape)))
    else:
        raise ValueError(weight_source)
    inputs = ["a", "B"]
    if c is not None:
        dims = [n if d == "N" else d for d in GEMM_C_SHAPES[c]]
        if "M" in dims or c_source == "input":
            graph_inputs.append(helper.make_tensor_value_info("C", dtype, dims))
        else:
            inits.append(numpy_helper.from_array(rng.standard_normal(dims).astype(np_type), "C"))
        inputs.append("C")
    attrs: dict[str, object] = {"transA": int(trans_a), "transB": int(trans_b), "alpha": alpha, "beta": beta}
    if opset < 7:
        attrs["broadcast"] = 1
    nodes.append(helper.make_node("Gemm", inputs, ["y"], name=name, **attrs))
    graph = helper.make_graph(
        nodes, "g", graph_inputs, [helper.make_tensor_value_info("y", dtype, ["M", n])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 8)
    return model


def random_feeds(
    model: onnx.ModelProto, *, m_values: Sequence[int] = (1, 3, 8, 33), seed: int = 1
) -> list[dict[str, np.ndarray]]:
    """Random inputs for every graph input (not initializers), once per value of the dim ``M``."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = []
    for m in m_values:
        feed = {}
        for value in model.graph.input:
            if value.name in inits:
                continue
            tensor_type = value.type.tensor_type
            shape = [m if d.dim_param == "M" else d.dim_value for d in tensor_type.shape.dim]
            np_type = NP_TYPES[tensor_type.elem_type]
            feed[value.name] = rng.standard_normal(shape).astype(np_type)
        feeds.append(feed)
    return feeds


def bfloat16_conv_model(opset: int) -> onnx.ModelProto:
    """One pointwise Conv1D in bfloat16 (onnxruntime runs no bfloat16 Conv on CPU)."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("W", TensorProto.BFLOAT16, [5, 6, 1], rng.standard_normal(30).tolist())
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], name="pw")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N", 6, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N", 5, "T"])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def conv_in_function_model(spatial: int, conv_name: str = "fn_conv") -> onnx.ModelProto:
    """A pointwise Conv inside the model-local function ``local::PwConv`` that the graph calls."""
    function = helper.make_function(
        "local",
        "PwConv",
        ["x", "w"],
        ["y"],
        [helper.make_node("Conv", ["x", "w"], ["y"], name=conv_name)],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = conv_model(spatial=spatial, bias=False)
    model.graph.node[0].op_type = "PwConv"
    model.graph.node[0].domain = "local"
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    return model


def unnamed_conv_output(model: onnx.ModelProto) -> ir.Model:
    """``model``'s single conv with its output left unnamed (only a model built in memory has one),
    read by an Identity ``keep`` whose output ``y`` is the graph's."""
    loaded = ir.serde.deserialize_model(model)
    (conv,) = loaded.graph
    conv.outputs[0].name = None
    loaded.graph.outputs.clear()
    identity = ir.node("Identity", [conv.outputs[0]], name="keep")
    identity.outputs[0].name = "y"
    loaded.graph.append(identity)
    loaded.graph.outputs.append(identity.outputs[0])
    return loaded


def no_bench(args: Sequence[object]) -> list[str]:
    """``args`` as strings, with ``--no-bench`` added to a ``quantize`` command that says nothing
    about timing: the latency measurement and the kernel choice are tested in test_speed_*.py and
    test_quantize_speed.py; elsewhere they would only add seconds to each run."""
    words = [str(a) for a in args]
    if words[:1] == ["quantize"] and not any(w.startswith("--bench") or w == "--no-bench" for w in words):
        words.append("--no-bench")
    return words
