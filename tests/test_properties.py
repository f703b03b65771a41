"""Property test: any valid pointwise conv configuration rewrites exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_close, conv_model, examples, op_types, run
from onnx_conv2matmul import ConvertOptions, Status, convert

EVERYTHING = ConvertOptions(allow_added_transposes=True, extended=True, allow_non_unit_dilation=True)


@st.composite
def conv_configs(draw: st.DrawFn) -> dict[str, object]:
    spatial = draw(st.integers(1, 3))
    attrs: dict[str, object] = {}
    if draw(st.booleans()):
        attrs["strides"] = draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    if draw(st.booleans()):
        attrs["dilations"] = draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    modes = ["NOTSET", "pads", "VALID", "SAME_UPPER", "SAME_LOWER"]
    if any(d != 1 for d in attrs.get("dilations", [])):  # type: ignore[attr-defined]
        modes = modes[:3]  # onnxruntime's Conv refuses dilation with SAME_*: nothing to compare
    mode = draw(st.sampled_from(modes))
    if mode == "pads":
        attrs["pads"] = draw(st.lists(st.integers(0, 2), min_size=2 * spatial, max_size=2 * spatial))
    elif mode != "NOTSET":
        attrs["auto_pad"] = mode
    return {
        "spatial": spatial,
        "in_channels": draw(st.integers(1, 9)),
        "out_channels": draw(st.integers(1, 9)),
        "bias": draw(st.booleans()),
        "attrs": attrs,
        "opset": draw(st.sampled_from([10, 11, 13, 17, 21])),
        "weight_source": draw(st.sampled_from(["initializer", "constant"])),
        "seed": draw(st.integers(0, 2**16)),
        "dims": draw(st.lists(st.integers(1, 12), min_size=spatial, max_size=spatial)),
        "batch": draw(st.integers(1, 3)),
    }


@settings(max_examples=examples(60))
@given(conv_configs())
def test_any_pointwise_conv_rewrites_exactly(config: dict[str, object]) -> None:
    dims = config.pop("dims")
    batch = config.pop("batch")
    model = conv_model(**config)  # type: ignore[arg-type]
    rewritten, report = convert(model, EVERYTHING)
    assert [e.status for e in report.entries] == [Status.CONVERTED]
    assert "Conv" not in op_types(rewritten)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, config["in_channels"], *dims)).astype(np.float32)  # type: ignore[misc]
    assert_close(run(model, {"x": x}), run(rewritten, {"x": x}))
