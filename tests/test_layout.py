"""The Transpose cost of a conversion: predicted, enforced by default, equal to what the cleanup leaves."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from hypothesis import event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_equivalent, examples
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert
from onnx_conv2matmul._layout import added_transposes
from onnx_conv2matmul.analysis import analyze

C = 8
DEFAULT = ConvertOptions(extended=True)
ALLOW = ConvertOptions(extended=True, allow_added_transposes=True)


class _Chain:
    """Builds a model one op at a time on a [N, C, T] (channels-first) or [N, T, C] tensor."""

    def __init__(self, seed: int, channels_last_input: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.current = "x"
        self.channels_last = channels_last_input
        self.input_shape: list[int | str] = ["N", "T", C] if channels_last_input else ["N", C, "T"]

    def _name(self, op: str) -> str:
        return f"{op.lower()}{len(self.nodes)}"

    def add(self, op: str, inputs: list[str], **attrs: object) -> str:
        name = self._name(op)
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        self.current = name
        return name

    def weight(self, shape: tuple[int, ...]) -> str:
        name = f"w{len(self.inits)}"
        self.inits.append(
            numpy_helper.from_array((self.rng.standard_normal(shape) / 3).astype(np.float32), name)
        )
        return name

    def transpose(self) -> str:
        self.channels_last = not self.channels_last
        return self.add("Transpose", [self.current], perm=[0, 2, 1])

    def pointwise(self) -> str:
        assert not self.channels_last
        return self.add("Conv", [self.current, self.weight((C, C, 1)), self.weight((C,))])

    def depthwise(self) -> str:
        assert not self.channels_last
        return self.add("Conv", [self.current, self.weight((C, 1, 3))], group=C, pads=[1, 1])

    def unary(self, op: str) -> str:
        return self.add(op, [self.current])

    def residual(self) -> str:
        """``h + Relu(h)``: ``h`` gets two readers."""
        h = self.current
        return self.add("Add", [h, self.add("Relu", [h])])

    def model(self) -> onnx.ModelProto:
        out_shape: list[int | str] = ["N", "T", C] if self.channels_last else ["N", C, "T"]
        graph = helper.make_graph(
            self.nodes,
            "chain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, self.input_shape)],
            [helper.make_tensor_value_info(self.current, TensorProto.FLOAT, out_shape)],
            self.inits,
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    def feeds(self) -> list[dict[str, np.ndarray]]:
        out = []
        for t in (1, 5, 17):
            shape = (2, t, C) if self.input_shape[1] == "T" else (2, C, t)
            out.append({"x": self.rng.standard_normal(shape).astype(np.float32)})
        return out


def _predicted(model: onnx.ModelProto, options: ConvertOptions) -> int:
    plans, _ = analyze(ir.serde.deserialize_model(model), options)
    converted = {id(p.node) for p in plans}
    return sum(added_transposes(p.node, p.spatial_rank + 2, converted) for p in plans)


def _statuses(report: object) -> list[tuple[Status, SkipReason | None]]:
    return [(e.status, e.reason) for e in report.entries]  # type: ignore[attr-defined]


def test_conformer_conv_module_breaks_even() -> None:
    """Transpose, pw, gate, dw, SiLU, pw, Transpose, Relu: both pws convert, no Transpose is added."""
    chain = _Chain(1, channels_last_input=True)
    chain.transpose()
    chain.pointwise()
    gate = chain.current
    chain.add("Mul", [gate, chain.unary("Sigmoid")])
    chain.depthwise()
    h = chain.current
    chain.add("Mul", [h, chain.unary("Sigmoid")])
    chain.pointwise()
    chain.transpose()
    chain.unary("Relu")  # a Transpose producing a graph output is kept, so its name stays
    model = chain.model()
    rewritten, report = convert(model, DEFAULT)
    assert len(report.converted) == 2
    assert report.transposes_before == report.transposes_after == 2
    assert_equivalent(model, rewritten, chain.feeds())


def test_between_depthwise_convs_it_is_left_alone() -> None:
    chain = _Chain(2)
    chain.depthwise()
    chain.pointwise()
    chain.unary("Relu")
    chain.depthwise()
    model = chain.model()
    rewritten, report = convert(model, DEFAULT)
    assert _statuses(report)[1] == (Status.SKIPPED, SkipReason.ADDS_TRANSPOSES)
    assert [n.op_type for n in rewritten.graph.node] == [n.op_type for n in model.graph.node]
    forced, report = convert(model, ALLOW)
    assert len(report.converted) == 1 and report.transposes_after == report.transposes_before + 2
    assert_equivalent(model, forced, chain.feeds())


def test_one_transpose_merged_is_still_one_added() -> None:
    """dw -> pw -> Relu -> Transpose: the Transpose out merges, the one in stays."""
    chain = _Chain(3)
    chain.depthwise()
    chain.pointwise()
    chain.unary("Relu")
    chain.transpose()
    model = chain.model()
    assert convert(model, DEFAULT)[1].skip_counts == {"adds_transposes": 1, "kernel_not_pointwise": 1}
    forced, report = convert(model, ALLOW)
    assert report.transposes_after == report.transposes_before + 1 == 2
    assert_equivalent(model, forced, chain.feeds())


def test_a_chain_of_pointwise_convs_removes_transposes() -> None:
    chain = _Chain(4, channels_last_input=True)
    chain.transpose()
    chain.pointwise()
    chain.pointwise()
    chain.unary("Relu")
    chain.pointwise()
    chain.transpose()
    chain.unary("Sigmoid")
    model = chain.model()
    rewritten, report = convert(model, DEFAULT)
    assert len(report.converted) == 3
    assert (report.transposes_before, report.transposes_after) == (2, 0)
    assert_equivalent(model, rewritten, chain.feeds())


_STEPS = st.sampled_from(["pointwise", "depthwise", "transpose", "relu", "sigmoid", "residual"])


@settings(max_examples=examples(60))
@given(
    steps=st.lists(_STEPS, min_size=1, max_size=9),
    channels_last_input=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_prediction_matches_the_cleanup_and_default_never_adds(
    steps: list[str], channels_last_input: bool, seed: int
) -> None:
    chain = _Chain(seed, channels_last_input)
    for step in steps:
        if step in ("pointwise", "depthwise") and chain.channels_last:
            chain.transpose()
        {
            "pointwise": chain.pointwise,
            "depthwise": chain.depthwise,
            "transpose": chain.transpose,
            "relu": lambda: chain.unary("Relu"),
            "sigmoid": lambda: chain.unary("Sigmoid"),
            "residual": chain.residual,
        }[step]()
    model = chain.model()
    feeds = chain.feeds()
    for options in (ALLOW, DEFAULT):
        rewritten, report = convert(model, options)
        assert report.transposes_before is not None and report.transposes_after is not None
        added = report.transposes_after - report.transposes_before
        assert added == _predicted(model, options)
        if options is DEFAULT:
            assert added <= 0
            event(f"default: {min(len(report.converted), 2)}+ converted, {len(report.skipped)} skipped")
        assert_equivalent(model, rewritten, feeds)
