"""The Transpose cost of a conversion: predicted, enforced by default, equal to what the cleanup leaves."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_equivalent, examples, op_types
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert
from onnx_conv2matmul.rewrite.analysis import analyze
from onnx_conv2matmul.rewrite.layout import added_transposes, channels_last_perms, compose, is_identity

C = 8
DEFAULT = ConvertOptions(extended=True)
ALLOW = ConvertOptions(extended=True, allow_added_transposes=True)
# Sizes of N, C and the spatial axes in the feeds: all different, so that a wrong
# permutation changes the output's shape.
SIZES = ([2, C, 3, 4, 5], [1, C, 6, 1, 2])


def _inverse(perm: list[int]) -> list[int]:
    return [perm.index(i) for i in range(len(perm))]


class _Chain:
    """Builds a model one op at a time on a tensor of ``rank`` in any layout.

    ``layout`` says which axis of the channels-first tensor [N, C, d0, ...] each axis
    of the current tensor is. Convs need channels-first: a Transpose back to it is
    added before each conv when the layout is another.
    """

    def __init__(self, seed: int, channels_last_input: bool = False, rank: int = 3) -> None:
        self.rng = np.random.default_rng(seed)
        self.rank = rank
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.current = "x"
        self.layout = channels_last_perms(rank)[0] if channels_last_input else list(range(rank))
        self.input_layout = list(self.layout)
        self.outputs: list[tuple[str, list[int]]] = []

    def _shape(self, layout: list[int]) -> list[int | str]:
        canonical: list[int | str] = ["N", C, *[f"d{i}" for i in range(self.rank - 2)]]
        return [canonical[i] for i in layout]

    def add(self, op: str, inputs: list[str], **attrs: object) -> str:
        name = f"{op.lower()}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        self.current = name
        return name

    def weight(self, shape: tuple[int, ...]) -> str:
        name = f"w{len(self.inits)}"
        self.inits.append(
            numpy_helper.from_array((self.rng.standard_normal(shape) / 3).astype(np.float32), name)
        )
        return name

    @property
    def channels_last(self) -> bool:
        return not is_identity(self.layout)

    def transpose(self, perm: list[int] | None = None) -> str:
        """Transpose by ``perm``; by default to channels-last, or back to channels-first."""
        if perm is None:
            perm = _inverse(self.layout) if self.channels_last else channels_last_perms(self.rank)[0]
        self.layout = compose(self.layout, perm)
        return self.add("Transpose", [self.current], perm=list(perm))

    def channels_first(self) -> None:
        if self.channels_last:
            self.transpose()

    def pointwise(self) -> str:
        self.channels_first()
        kernel = (1,) * (self.rank - 2)
        return self.add("Conv", [self.current, self.weight((C, C, *kernel)), self.weight((C,))])

    def grouped(self) -> str:
        """A pointwise conv with 2 groups (extended mode converts it)."""
        self.channels_first()
        kernel = (1,) * (self.rank - 2)
        return self.add("Conv", [self.current, self.weight((C, C // 2, *kernel)), self.weight((C,))], group=2)

    def fused(self, activation: str | None, params: list[float] | None, z: bool) -> str:
        """A com.microsoft FusedConv; with ``z`` its input Z is its input X too."""
        self.channels_first()
        h = self.current
        kernel = (1,) * (self.rank - 2)
        attrs: dict[str, object] = {}
        if activation is not None:
            attrs["activation"] = activation
        if params is not None:
            attrs["activation_params"] = params
        inputs = [h, self.weight((C, C, *kernel)), self.weight((C,)), *([h] if z else [])]
        name = f"fusedconv{len(self.nodes)}"
        self.nodes.append(
            helper.make_node("FusedConv", inputs, [name], name=name, domain="com.microsoft", **attrs)
        )
        self.current = name
        return name

    def depthwise(self) -> str:
        self.channels_first()
        kernel = (3,) + (1,) * (self.rank - 3)
        pads = [1] + [0] * (self.rank - 3)
        return self.add("Conv", [self.current, self.weight((C, 1, *kernel))], group=C, pads=pads * 2)

    def unary(self, op: str) -> str:
        return self.add(op, [self.current])

    def residual(self) -> str:
        """``h + Relu(h)``: ``h`` gets two readers."""
        h = self.current
        return self.add("Add", [h, self.add("Relu", [h])])

    def fork(self) -> str:
        """Two pointwise convs read the same value; their outputs are added."""
        self.channels_first()
        h = self.current
        a = self.pointwise()
        self.current = h
        return self.add("Add", [a, self.pointwise()])

    def tap(self) -> None:
        """The current value becomes a graph output too (the chain goes on from it)."""
        if self.current != "x" and self.current not in dict(self.outputs):
            self.outputs.append((self.current, list(self.layout)))

    def model(self) -> onnx.ModelProto:
        outputs = [o for o in self.outputs if o[0] != self.current] + [(self.current, self.layout)]
        graph = helper.make_graph(
            self.nodes,
            "chain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, self._shape(self.input_layout))],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, self._shape(lay)) for n, lay in outputs],
            self.inits,
        )
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )

    def feeds(self) -> list[dict[str, np.ndarray]]:
        out = []
        for sizes in SIZES:
            shape = [sizes[i] for i in self.input_layout]
            out.append({"x": self.rng.standard_normal(shape).astype(np.float32)})
        return out


def _predicted(model: onnx.ModelProto, options: ConvertOptions) -> int:
    plans, _ = analyze(ir.serde.deserialize_model(model), options)
    converted = {id(p.node) for p in plans}
    return sum(added_transposes(p.node, p.spatial_rank + 2, converted) for p in plans)


def _statuses(report: object) -> list[tuple[Status, SkipReason | None]]:
    return [(e.status, e.reason) for e in report.entries]  # type: ignore[attr-defined]


def _check(
    chain: _Chain, converted: int, before: int, after: int, options: ConvertOptions = DEFAULT
) -> onnx.ModelProto:
    model = chain.model()
    rewritten, report = convert(model, options)
    assert len(report.converted) == converted
    assert (report.transposes_before, report.transposes_after) == (before, after)
    assert after - before == _predicted(model, options)
    assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
    assert_equivalent(model, rewritten, chain.feeds())
    return rewritten


def _node_names(model: onnx.ModelProto) -> set[str]:
    return {n.name for n in model.graph.node}


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
    chain.unary("Relu")
    _check(chain, converted=2, before=2, after=2)


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
    _check(chain, converted=1, before=0, after=2, options=ALLOW)


def test_the_transpose_out_cancels_at_a_graph_output() -> None:
    """dw -> pw -> Relu -> Transpose -> output: the Relu output takes the output over; the
    Transpose in stays. Even: converted by default."""
    chain = _Chain(3)
    chain.depthwise()
    chain.pointwise()
    chain.unary("Relu")
    chain.transpose()
    _check(chain, converted=1, before=1, after=1)


def test_one_transpose_merged_is_still_one_added() -> None:
    """dw -> pw -> Relu -> Transpose[0,2,1,3]: the Transpose out merges, the one in stays."""
    chain = _Chain(3, rank=4)
    chain.depthwise()
    chain.pointwise()
    chain.unary("Relu")
    chain.transpose([0, 2, 1, 3])
    assert convert(chain.model(), DEFAULT)[1].skip_counts == {"adds_transposes": 1, "kernel_not_pointwise": 1}
    _check(chain, converted=1, before=1, after=2, options=ALLOW)


def test_a_chain_of_pointwise_convs_removes_transposes() -> None:
    chain = _Chain(4, channels_last_input=True)
    chain.transpose()
    chain.pointwise()
    chain.pointwise()
    chain.unary("Relu")
    chain.pointwise()
    chain.transpose()
    chain.unary("Sigmoid")
    _check(chain, converted=3, before=2, after=0)


def test_a_conv_output_read_as_a_graph_output_and_through_two_transposes() -> None:
    """pw (graph output) -> T -> T -> pw: found by the property test on the pair-by-pair
    cleanup, which removed one more Transpose than it predicted."""
    chain = _Chain(5)
    chain.pointwise()
    chain.tap()
    chain.transpose()
    chain.transpose()
    chain.pointwise()
    _check(chain, converted=2, before=2, after=3, options=ALLOW)


def test_two_convs_read_through_a_shared_transpose_that_goes() -> None:
    """Transpose to channels-first read by two pws: both read its input, and it goes.
    Their Transposes out stay (an Add reads them): 2 more, 1 less."""
    chain = _Chain(6, channels_last_input=True, rank=4)
    chain.fork()
    chain.transpose()
    rewritten = _check(chain, converted=2, before=2, after=3, options=ALLOW)
    assert "transpose0" not in _node_names(rewritten)
    _check(chain, converted=0, before=2, after=2)  # by default: each would add one


def test_a_transpose_read_through_whose_input_is_taken_over() -> None:
    """pw -> T (graph output) -> T -> two pws. Our Transpose out and the first T cancel at
    the graph output, whose value the pws then read through the second T, which goes."""
    chain = _Chain(7)
    chain.pointwise()
    chain.transpose()
    chain.tap()
    chain.fork()
    rewritten = _check(chain, converted=3, before=2, after=3, options=ALLOW)
    assert not {"transpose1", "transpose2"} & _node_names(rewritten)
    assert rewritten.graph.output[0].name == "transpose1"


def test_a_chain_of_model_transposes_composes_with_ours() -> None:
    """Rank 5: two Transposes and a Relu between them before a pw, which cancel with ours
    only together."""
    chain = _Chain(8, rank=5)
    chain.transpose([0, 2, 1, 3, 4])
    chain.unary("Relu")
    chain.transpose([0, 3, 4, 2, 1])  # together: [0, 2, 3, 4, 1], channels-last
    chain.pointwise()
    chain.transpose()
    _check(chain, converted=1, before=4, after=1)


def test_the_skip_detail_says_how_many_transposes_a_conversion_adds() -> None:
    """One Transpose or two: the report's detail counts them (mutation testing)."""
    two = _Chain(2)
    two.depthwise()
    two.pointwise()
    two.unary("Relu")
    two.depthwise()
    one = _Chain(3, rank=4)
    one.depthwise()
    one.pointwise()
    one.unary("Relu")
    one.transpose([0, 2, 1, 3])
    hint = ": a neighbour needs channels-first data (--allow-added-transposes converts it)"
    for chain, added in ((two, "2 Transpose nodes"), (one, "1 Transpose node")):
        model = chain.model()
        rewritten, report = convert(model, DEFAULT)
        entry = report.entries[1]
        assert (entry.status, entry.reason) == (Status.SKIPPED, SkipReason.ADDS_TRANSPOSES)
        assert entry.detail == f"its channels-last form would add {added}{hint}"
        assert entry.extra_ops == []
        assert op_types(rewritten) == op_types(model)
        assert_equivalent(model, rewritten, chain.feeds())


def test_a_conv_reading_a_constant_converts() -> None:
    """A producer with no inputs (a Constant) ends the walk up (mutation testing: ``as_link``)."""
    chain = _Chain(11)
    value = (chain.rng.standard_normal((2, C, 3)) / 3).astype(np.float32)
    chain.current = chain.add("Constant", [], value=numpy_helper.from_array(value, "k"))
    chain.pointwise()
    chain.nodes.insert(0, helper.make_node("Identity", ["x"], ["unused"], name="keep_x"))
    _check(chain, converted=1, before=0, after=2, options=ALLOW)


def test_a_transpose_without_perm_is_left_alone() -> None:
    """pw -> Relu -> Transpose (no perm: reverses the axes): not a chain link, so our
    Transpose out stays (mutation testing: ``perm``)."""
    chain = _Chain(12)
    chain.pointwise()
    chain.unary("Relu")
    chain.add("Transpose", [chain.current])
    chain.layout = chain.layout[::-1]
    rewritten = _check(chain, converted=1, before=1, after=3, options=ALLOW)
    assert "transpose2" in _node_names(rewritten)


def test_a_shared_transpose_read_through_by_a_conv_and_a_transpose_chain_goes() -> None:
    """Transpose to channels-first read by a pw and by T, T (undoing each other) -> pw.
    Both chains read through it, so it goes, counted once by the first pw: the second
    reader is a chain of the model's Transposes, not a conv (mutation testing)."""
    chain = _Chain(9, channels_last_input=True)
    chain.transpose()
    h = chain.current
    a = chain.pointwise()
    chain.current = h
    chain.transpose([0, 2, 1])
    chain.transpose([0, 2, 1])
    chain.add("Add", [a, chain.pointwise()])
    rewritten = _check(chain, converted=2, before=3, after=2)
    assert not {"transpose0", "transpose2", "transpose3"} & _node_names(rewritten)


def test_a_shared_transpose_read_first_by_a_transpose_chain_goes() -> None:
    """As above with the readers in the other order: the chain of Transposes reads first,
    so the pw at its end counts the Transpose that goes (mutation testing: ``walk_down``)."""
    chain = _Chain(9, channels_last_input=True)
    chain.transpose()
    h = chain.current
    chain.transpose([0, 2, 1])
    chain.transpose([0, 2, 1])
    b = chain.pointwise()
    chain.current = h
    chain.add("Add", [chain.pointwise(), b])
    _check(chain, converted=2, before=3, after=2, options=ALLOW)


def test_two_transposes_undoing_each_other_between_two_convs_go() -> None:
    """pw -> T -> T (its inverse) -> pw: every Transpose between the convs cancels
    (mutation testing: ``walk_up``)."""
    chain = _Chain(14, rank=4)
    chain.pointwise()
    chain.transpose([0, 2, 3, 1])
    chain.transpose([0, 3, 1, 2])
    chain.pointwise()
    _check(chain, converted=2, before=2, after=2, options=ALLOW)


def test_a_shared_transpose_also_read_by_a_conv_in_a_subgraph_stays() -> None:
    """Transpose to channels-first read by a pw and by a pw in each branch of an If: the
    branches' pws cannot read through it (another graph), so it stays and the first pw's
    conversion removes nothing more (mutation testing: ``_readers_leaving``)."""
    rng = np.random.default_rng(10)

    def weight(name: str) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal((C, C, 1)) / 3).astype(np.float32), name)

    def branch(name: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Conv", ["t", f"w_{name}"], [f"y_{name}"], name=f"pw_{name}")],
            name,
            [],
            [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, None)],
            [weight(f"w_{name}")],
        )

    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="to_first", perm=[0, 2, 1]),
            helper.make_node("Conv", ["t", "w"], ["a"], name="pw"),
            helper.make_node(
                "If", ["cond"], ["b"], name="if", then_branch=branch("then"), else_branch=branch("else")
            ),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "d0", C]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", C, "d0"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", C, "d0"]),
        ],
        [weight("w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, report = convert(model, ALLOW)
    assert len(report.converted) == 3
    # pw: its Transpose in goes (it reads x), its Transpose out stays; each branch adds 2.
    assert (report.transposes_before, report.transposes_after) == (1, 6)
    assert report.transposes_after - report.transposes_before == _predicted(model, ALLOW)
    assert "to_first" in _node_names(rewritten)
    feeds = [
        {"x": rng.standard_normal((2, 5, C)).astype(np.float32), "cond": np.array(flag)}
        for flag in (True, False)
    ]
    assert_equivalent(model, rewritten, feeds)


_STEPS = st.sampled_from(
    [
        "pointwise",
        "depthwise",
        "transpose",
        "relu",
        "sigmoid",
        "residual",
        "fork",
        "tap",
        "tap",
        "grouped",
        "fused",
    ]
)
# A FusedConv's activation: none, chain links (Relu, LeakyRelu, ...) and Clip, which ends a chain.
_FUSED = st.sampled_from(
    [
        (None, None),
        ("Relu", None),
        ("Tanh", None),
        ("LeakyRelu", [0.1]),
        ("HardSigmoid", [0.2, 0.5]),
        ("Clip", [-1.0, 1.0]),
    ]
)


@st.composite
def _chains(draw: st.DrawFn) -> _Chain:
    rank = draw(st.integers(3, 5), label="rank")
    to_last, to_first = channels_last_perms(rank)
    perms = st.one_of(st.sampled_from([to_last, to_first]), st.permutations(list(range(rank))).map(list))
    chain = _Chain(draw(st.integers(0, 2**16)), draw(st.booleans()), rank)
    for step in draw(st.lists(_STEPS, min_size=1, max_size=9)):
        if step == "transpose":
            chain.transpose(draw(perms))
        elif step in ("relu", "sigmoid"):
            chain.unary(step.capitalize())
        elif step == "fused":
            chain.fused(*draw(_FUSED), z=draw(st.booleans()))
        else:
            getattr(chain, step)()
    # The end is a graph output: often right after a Transpose.
    ending = draw(st.sampled_from(["as is", "transpose", "channels-last", "channels-first"]))
    if ending == "transpose":
        chain.transpose(draw(perms))
    elif ending == "channels-last" and not chain.channels_last:
        chain.transpose()
    elif ending == "channels-first":
        chain.channels_first()
    return chain


# The default run draws a third of the full sweep; the sweep itself is marked slow (``-m slow``).
@settings(max_examples=examples(1000))
@given(chain=_chains())
def test_prediction_matches_the_cleanup_and_default_never_adds(chain: _Chain) -> None:
    model = chain.model()
    feeds = chain.feeds()
    for options in (ALLOW, DEFAULT):
        rewritten, report = convert(model, options)
        added = report.transposes_after - report.transposes_before
        assert added == _predicted(model, options)
        assert [o.name for o in rewritten.graph.output] == [o.name for o in model.graph.output]
        if options is DEFAULT:
            assert added <= 0
            event(f"rank {chain.rank}, default: {min(len(report.converted), 2)}+ converted, added {added}")
        assert_equivalent(model, rewritten, feeds)


@pytest.mark.slow
@settings(max_examples=examples(3000))
@given(chain=_chains())
def test_prediction_matches_the_cleanup_and_default_never_adds_full_sweep(chain: _Chain) -> None:
    test_prediction_matches_the_cleanup_and_default_never_adds.hypothesis.inner_test(chain)  # type: ignore[attr-defined]
