"""Property tests: any valid pointwise conv, and any chain of them, rewrites exactly.

Exactness is checked in onnxruntime, against the original model and, for one conv,
against the definition computed in float64 (which also covers what onnxruntime's Conv
refuses to run: SAME auto_pad with a dilation). The graph is checked too: every conv
becomes one MatMul per group whose input B is a 2-D initializer, one per weight. Convs are
grouped or not, and a com.microsoft FusedConv has any activation, with or without Z.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import (
    NP_TYPES,
    all_initializers,
    all_nodes,
    assert_close,
    assert_equivalent,
    assert_matmul_weights_2d,
    conv_model,
    examples,
    fused_conv_model,
    op_types,
    run,
)
from onnx_conv2matmul import ConvertOptions, Status, convert
from onnx_conv2matmul.rewrite.layout import channels_last_perms

EVERYTHING = ConvertOptions(allow_added_transposes=True, extended=True, allow_non_unit_dilation=True)
DTYPES = st.sampled_from([TensorProto.FLOAT, TensorProto.FLOAT16])


@st.composite
def conv_attrs(draw: st.DrawFn, spatial: int, *, same_with_dilation: bool = True) -> dict[str, object]:
    """Strides, dilations, pads or auto_pad for a pointwise conv with ``spatial`` axes."""
    attrs: dict[str, object] = {}
    if draw(st.booleans()):
        attrs["strides"] = draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    dilated = draw(st.booleans())
    if dilated:
        attrs["dilations"] = draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    modes = ["NOTSET", "pads", "VALID", "SAME_UPPER", "SAME_LOWER"]
    if dilated and not same_with_dilation:
        modes = modes[:3]  # onnxruntime's Conv refuses dilation with SAME_*
    mode = draw(st.sampled_from(modes))
    if mode == "pads":
        attrs["pads"] = draw(st.lists(st.integers(0, 2), min_size=2 * spatial, max_size=2 * spatial))
    elif mode != "NOTSET":
        attrs["auto_pad"] = mode
    return attrs


@st.composite
def conv_configs(draw: st.DrawFn, *, same_with_dilation: bool = True) -> dict[str, object]:
    spatial = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    if group == 1:
        in_channels, out_channels = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    else:  # at least 2 input channels per group: 1 is a depthwise conv
        in_channels, out_channels = group * draw(st.integers(2, 3)), group * draw(st.integers(1, 3))
    return {
        "spatial": spatial,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "group": group,
        "bias": draw(st.booleans()),
        "attrs": draw(conv_attrs(spatial, same_with_dilation=same_with_dilation)),
        "dtype": draw(DTYPES),
        "opset": draw(st.sampled_from([10, 11, 13, 17, 21])),
        "weight_source": draw(st.sampled_from(["initializer", "constant"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    found = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return found


def _definition(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The conv of ``conv_model`` computed from the ONNX definition, in float64.

    With a kernel of 1 the output at ``o`` reads the (padded) input at ``o * stride``
    alone; every auto_pad pads nothing (SAME gives ceil(in / stride) outputs).
    """
    node = next(n for n in model.graph.node if n.op_type == "Conv")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    constants = _constants(model)
    w = constants[node.input[1]].astype(np.float64)
    group = int(attrs.get("group", 1))
    spatial = x.ndim - 2
    h = x.astype(np.float64)
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    h = np.pad(h, [(0, 0), (0, 0), *zip(pads[:spatial], pads[spatial:], strict=True)])
    strides = list(attrs.get("strides", [1] * spatial))
    h = h[(slice(None), slice(None), *(slice(None, None, s) for s in strides))]
    rows, cols = w.shape[0] // group, w.shape[1]
    y = np.concatenate(
        [
            np.einsum(
                "mc,nc...->nm...",
                w[i * rows : (i + 1) * rows].reshape(rows, cols),
                h[:, i * cols : (i + 1) * cols],
            )
            for i in range(group)
        ],
        axis=1,
    )
    if len(node.input) > 2:
        y += constants[node.input[2]].astype(np.float64).reshape(-1, *[1] * spatial)
    return y


_CONV_CASES = {
    "config": conv_configs(),
    "dims": st.lists(st.integers(1, 12), min_size=3, max_size=3),
    "batch": st.integers(1, 3),
}


# The default run draws a third of the full sweep; the sweep itself is marked slow (``-m slow``).
@settings(max_examples=examples(1000))
@given(**_CONV_CASES)
def test_any_pointwise_conv_rewrites_exactly(config: dict[str, object], dims: list[int], batch: int) -> None:
    model = conv_model(**config)  # type: ignore[arg-type]
    rewritten, report = convert(model, EVERYTHING)
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert "Conv" not in op_types(rewritten)
    assert_matmul_weights_2d(rewritten, config["group"])  # type: ignore[arg-type]
    np_type = NP_TYPES[config["dtype"]]  # type: ignore[index]
    spatial = config["spatial"]
    shape = (batch, config["in_channels"], *dims[:spatial])  # type: ignore[misc]
    x = np.random.default_rng(0).standard_normal(shape).astype(np_type)
    (actual,) = run(rewritten, {"x": x})
    assert_close([_definition(model, x).astype(np_type)], [actual], dtype=np_type)
    attrs: dict[str, object] = config["attrs"]  # type: ignore[assignment]
    refused = str(attrs.get("auto_pad", "")).startswith("SAME") and any(
        d > 1
        for d in attrs.get("dilations", [])  # type: ignore[attr-defined]
    )
    if refused:
        event("SAME auto_pad with dilation: against the definition only")
    else:
        assert_close(run(model, {"x": x}), [actual], dtype=np_type)
    event(f"{np_type.__name__}, {spatial} spatial, group {config['group']}")


@pytest.mark.slow
@settings(max_examples=examples(3000))
@given(**_CONV_CASES)
def test_any_pointwise_conv_rewrites_exactly_full_sweep(
    config: dict[str, object], dims: list[int], batch: int
) -> None:
    test_any_pointwise_conv_rewrites_exactly.hypothesis.inner_test(config, dims, batch)  # type: ignore[attr-defined]


# (activation, activation_params) of a FusedConv: every one the rewrite expresses.
FUSED_ACTIVATIONS = [
    (None, None),
    ("Relu", None),
    ("Tanh", None),
    ("Sigmoid", None),
    ("LeakyRelu", [0.15]),
    ("HardSigmoid", [0.25, 0.45]),
    ("Clip", [-0.6, 0.9]),
]


def _output_dims(dims: list[int], attrs: dict[str, object]) -> list[int]:
    """The spatial dims of a pointwise conv's output (every auto_pad pads nothing)."""
    strides: list[int] = attrs.get("strides", [1] * len(dims))  # type: ignore[assignment]
    pads: list[int] = attrs.get("pads", [0] * 2 * len(dims))  # type: ignore[assignment]
    return [
        (d + pads[i] + pads[i + len(dims)] - 1) // s + 1
        for i, (d, s) in enumerate(zip(dims, strides, strict=True))
    ]


@settings(max_examples=examples(400))
@given(
    config=conv_configs(same_with_dilation=False),
    activation=st.sampled_from(FUSED_ACTIVATIONS),
    z=st.booleans(),
    dims=st.lists(st.integers(1, 12), min_size=3, max_size=3),
    batch=st.integers(1, 3),
)
def test_any_pointwise_fused_conv_rewrites_exactly(
    config: dict[str, object],
    activation: tuple[str | None, list[float] | None],
    z: bool,
    dims: list[int],
    batch: int,
) -> None:
    """Against onnxruntime's own FusedConv: ``activation(conv + Z)``."""
    model = fused_conv_model(activation=activation[0], params=activation[1], z=z, **config)
    rewritten, report = convert(model, EVERYTHING)
    assert [(e.op_type, e.status) for e in report.entries] == [("FusedConv", Status.CONVERTED)]
    assert not {"Conv", "FusedConv"} & set(op_types(rewritten))
    assert_matmul_weights_2d(rewritten, config["group"])  # type: ignore[arg-type]
    np_type = NP_TYPES[config["dtype"]]  # type: ignore[index]
    spatial: int = config["spatial"]  # type: ignore[assignment]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((batch, config["in_channels"], *dims[:spatial])).astype(np_type)}  # type: ignore[misc]
    if z:
        out_dims = _output_dims(dims[:spatial], config["attrs"])  # type: ignore[arg-type]
        feeds["z"] = rng.standard_normal((batch, config["out_channels"], *out_dims)).astype(np_type)  # type: ignore[misc]
    assert_close(run(model, feeds), run(rewritten, feeds), dtype=np_type)
    event(f"{np_type.__name__}, {activation[0]}, z {z}, group {config['group']}")


class _Graph:
    """A chain of pointwise convs and the ops between them, in the main graph or in an If."""

    def __init__(self, dtype: int, rank: int, channels: int, seed: int) -> None:
        self.dtype = dtype
        self.np_type = NP_TYPES[dtype]
        self.rank = rank
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self.conv_weights: list[str] = []
        self.channels = [channels]
        self.current = "x"

    def _add(self, op: str, inputs: list[str], **attrs: object) -> str:
        name = f"{op.lower()}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        self.current = name
        return name

    def tensor(self, shape: tuple[int, ...], scale: float = 1.0) -> str:
        name = f"w{len(self.weights)}"
        array = (self.rng.standard_normal(shape) * scale).astype(self.np_type)
        self.weights.append(numpy_helper.from_array(array, name))
        return name

    def new_weight(self, out_channels: int) -> str:
        in_channels = self.channels[-1]
        return self.tensor((out_channels, in_channels, *[1] * (self.rank - 2)), 1 / np.sqrt(in_channels))

    def conv(self, weight: str, out_channels: int, bias: bool, attrs: dict[str, object]) -> None:
        self.conv_weights.append(weight)
        inputs = [self.current, weight] + ([self.tensor((out_channels,))] if bias else [])
        self._add("Conv", inputs, **attrs)
        self.channels.append(out_channels)

    def between(self, step: str, perm: list[int]) -> None:
        """An op between convs, on channels-first data and giving channels-first data."""
        if step == "residual":
            h = self.current
            self._add("Add", [h, self._add("Relu", [h])])
        elif step == "transposed":  # Transpose(perm) -> Relu -> Transpose back
            self._add("Transpose", [self.current], perm=perm)
            self._add("Relu", [self.current])
            self._add("Transpose", [self.current], perm=[perm.index(i) for i in range(self.rank)])
        else:
            self._add(step, [self.current])

    def model(self, where: str) -> onnx.ModelProto:
        nodes, inits = self.nodes, self.weights
        out = self.current
        unknown = [None] * self.rank
        outputs = [helper.make_tensor_value_info(out, self.dtype, unknown)]
        if where != "main":
            branch_inits = inits if where == "if-inner-weights" else []
            then_branch = helper.make_graph(nodes, "then", [], outputs, branch_inits)
            else_branch = helper.make_graph(
                [helper.make_node("Neg", ["x"], ["else_out"])],
                "else",
                [],
                [helper.make_tensor_value_info("else_out", self.dtype, unknown)],
            )
            nodes = [
                helper.make_node(
                    "If", ["cond"], ["y"], name="if0", then_branch=then_branch, else_branch=else_branch
                )
            ]
            inits = [] if where == "if-inner-weights" else inits
            outputs = [helper.make_tensor_value_info("y", self.dtype, unknown)]
        inputs = [
            helper.make_tensor_value_info("x", self.dtype, ["N", self.channels[0], *"HWD"[: self.rank - 2]])
        ]
        if where != "main":
            inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
        graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    def feeds(self, where: str) -> list[dict[str, np.ndarray]]:
        out = []
        for batch, size in ((1, 5), (2, 9)):
            shape = (batch, self.channels[0], *[size + i for i in range(self.rank - 2)])
            feed = {"x": self.rng.standard_normal(shape).astype(self.np_type)}
            if where == "main":
                out.append(feed)
            else:
                out.extend({**feed, "cond": np.array(cond)} for cond in (True, False))
        return out


@st.composite
def conv_graphs(draw: st.DrawFn) -> tuple[_Graph, str, int]:
    """2 or 3 convs (some sharing a weight), elementwise ops and Transposes between them."""
    rank = draw(st.integers(3, 5))
    count = draw(st.integers(2, 3))
    shared = draw(st.booleans())  # square convs, so that they can share weights
    channels = draw(st.lists(st.integers(1, 6), min_size=count + 1, max_size=count + 1))
    if shared:
        channels = [channels[0]] * (count + 1)
    graph = _Graph(draw(DTYPES), rank, channels[0], draw(st.integers(0, 2**16)))
    perms = st.one_of(st.just(channels_last_perms(rank)[0]), st.permutations(list(range(rank))).map(list))
    weights: list[str] = []
    for i in range(count):
        if i:
            for step in draw(
                st.lists(st.sampled_from(["Relu", "Tanh", "Sigmoid", "residual", "transposed"]), max_size=2)
            ):
                graph.between(step, draw(perms))
        if shared and weights and draw(st.booleans()):
            weight = draw(st.sampled_from(weights))
        else:
            weight = graph.new_weight(channels[i + 1])
        weights.append(weight)
        attrs = draw(conv_attrs(rank - 2, same_with_dilation=False))
        graph.conv(weight, channels[i + 1], draw(st.booleans()), attrs)
    if draw(st.booleans()):  # the graph output is channels-last
        graph._add("Transpose", [graph.current], perm=channels_last_perms(rank)[0])
    return graph, draw(st.sampled_from(["main", "if-outer-weights", "if-inner-weights"])), len(set(weights))


@settings(max_examples=examples(700))
@given(case=conv_graphs())
def test_chains_of_convs_rewrite_exactly(case: tuple[_Graph, str, int]) -> None:
    graph, where, distinct_weights = case
    model = graph.model(where)
    rewritten, report = convert(model, EVERYTHING)
    convs = len(report.entries)
    assert convs >= 2 and all(e.status is Status.CONVERTED for e in report.entries)
    assert "Conv" not in op_types(rewritten)
    assert_matmul_weights_2d(rewritten, convs)
    inits = all_initializers(rewritten.graph)
    b_inputs = {n.input[1] for n in all_nodes(rewritten.graph) if n.op_type == "MatMul"}
    assert len(b_inputs) == distinct_weights, "one transposed weight per conv weight"
    assert all(inits[name].data_type == graph.dtype for name in b_inputs)
    assert not set(graph.conv_weights) & set(inits), "the conv weights are removed"
    assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
    onnx.checker.check_model(rewritten)
    assert_equivalent(model, rewritten, graph.feeds(where), dtype=graph.np_type)
    shared = " shared" if distinct_weights < convs else ""
    event(f"{graph.np_type.__name__}, {convs} convs{shared}, {where}")


@pytest.mark.slow
@settings(max_examples=examples(2000))
@given(case=conv_graphs())
def test_chains_of_convs_rewrite_exactly_full_sweep(case: tuple[_Graph, str, int]) -> None:
    test_chains_of_convs_rewrite_exactly.hypothesis.inner_test(case)  # type: ignore[attr-defined]
