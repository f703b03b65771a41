"""Latency of the channels-last forms of a grouped pointwise conv against the conv itself.

A pointwise conv with ``group`` g > 1 (ShuffleNet, DeepFilterNet's grouped linear layers)
holds g weights ``[C/g, M/g]``. The rewrite can emit them as g MatMuls, each with its own
2-D weight, on the g channel slices of the input. This script builds, for each shape,
the original conv and the candidate forms, all between the two Transposes the rewrite puts
around a conv (channels-last inside)::

    split     Transpose -> Split(last axis, g) -> g x MatMul -> Concat -> Add(bias) -> Transpose
    slice     Transpose -> g x Slice(last axis) -> g x MatMul -> Concat -> Add(bias) -> Transpose
    blockdiag Transpose -> MatMul(block-diagonal [C, M]) -> Add(bias) -> Transpose
    core      Split(last axis, g) -> g x MatMul -> Concat -> Add(bias), on channels-last input

``blockdiag`` is a reference, not a candidate: its one weight is g times the conv's (zeros
off the diagonal blocks), which the rewrite never emits. ``core`` is ``split`` without its
Transposes, fed the same data channels-last: what a conversion costs where its Transposes
cancel against the model's (a Conformer's conv module). Each model runs in onnxruntime
(CPU, sessions that do not spin, see ``_timing``) in interleaved rounds with the conv; the
table gives each form's median latency over the conv's, with a 95% bootstrap interval.
Every form is checked equal to the conv before it is timed.

Usage::

    python benchmarks/bench_grouped.py [--runs N] [--threads T] [--channels C] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from _timing import ratio_interval, ratio_of_medians, run_order, timed_session

GROUPS = (2, 4, 8)
# (label, spatial dims of one input): Conv1D over sequences, Conv2D over feature maps.
SHAPES = (
    ("1-D T=100", (100,)),
    ("1-D T=1000", (1000,)),
    ("2-D 14x14", (14, 14)),
    ("2-D 56x56", (56, 56)),
)
FORMS = ("split", "slice", "blockdiag", "core")
OPSET = 17


def _model(form: str, channels: int, group: int, spatial: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    cg, mg = channels // group, channels // group
    w = (rng.standard_normal((channels, cg, *[1] * spatial)) / np.sqrt(cg)).astype(np.float32)
    b = rng.standard_normal(channels).astype(np.float32)
    rank = spatial + 2
    last = rank - 1
    inits = [numpy_helper.from_array(b, "b")]
    nodes: list[onnx.NodeProto] = []
    if form == "conv":
        inits.append(numpy_helper.from_array(w, "w"))
        nodes.append(helper.make_node("Conv", ["x", "w", "b"], ["y"], group=group))
    else:
        if form == "core":
            nodes.append(helper.make_node("Identity", ["x"], ["xt"]))
        else:
            nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, *range(2, rank), 1]))
        blocks = [w[i * mg : (i + 1) * mg].reshape(mg, cg).T.copy() for i in range(group)]
        if form == "blockdiag":
            full = np.zeros((channels, channels), np.float32)
            for i, block in enumerate(blocks):
                full[i * cg : (i + 1) * cg, i * mg : (i + 1) * mg] = block
            inits.append(numpy_helper.from_array(full, "w"))
            nodes.append(helper.make_node("MatMul", ["xt", "w"], ["cat"]))
        else:
            parts = [f"part{i}" for i in range(group)]
            if form in ("split", "core"):
                nodes.append(helper.make_node("Split", ["xt"], parts, axis=last))
            else:
                for i, part in enumerate(parts):
                    bounds = [(f"s{i}", i * cg), (f"e{i}", (i + 1) * cg)]
                    inits.extend(numpy_helper.from_array(np.array([v], np.int64), n) for n, v in bounds)
                    nodes.append(helper.make_node("Slice", ["xt", f"s{i}", f"e{i}", "axis"], [part]))
                inits.append(numpy_helper.from_array(np.array([last], np.int64), "axis"))
            for i, (part, block) in enumerate(zip(parts, blocks, strict=True)):
                inits.append(numpy_helper.from_array(block, f"w{i}"))
                nodes.append(helper.make_node("MatMul", [part, f"w{i}"], [f"mm{i}"]))
            nodes.append(helper.make_node("Concat", [f"mm{i}" for i in range(group)], ["cat"], axis=last))
        if form == "core":
            nodes.append(helper.make_node("Add", ["cat", "b"], ["y"]))
        else:
            nodes.append(helper.make_node("Add", ["cat", "b"], ["biased"]))
            nodes.append(
                helper.make_node("Transpose", ["biased"], ["y"], perm=[0, rank - 1, *range(1, rank - 1)])
            )
    dims: list[str | int] = ["N", channels, *[f"d{i}" for i in range(spatial)]]
    if form == "core":
        dims = [dims[0], *dims[2:], dims[1]]
    graph = helper.make_graph(
        nodes,
        form,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def _latency(
    sessions: list[ort.InferenceSession], feeds: list[dict[str, np.ndarray]], runs: int, warmup: int = 2
) -> list[list[float]]:
    """As ``_timing.interleaved_latency``, with each session's own feeds."""
    for session, feed in zip(sessions, feeds, strict=True):
        for _ in range(warmup):
            session.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for index in range(runs):
        for which in run_order(index, len(sessions)):
            start = time.perf_counter()
            sessions[which].run(None, feeds[which])
            times[which].append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200, help="interleaved rounds per shape")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every session")
    parser.add_argument("--channels", type=int, default=256, help="C = M")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rows = []
    print(f"C = M = {args.channels}, batch 1, fp32, {args.threads} thread(s), {args.runs} rounds")
    print(f"{'shape':<12} {'g':>2} {'conv ms':>8}  " + "  ".join(f"{f + ' x conv':>20}" for f in FORMS))
    with tempfile.TemporaryDirectory() as tmp:
        for label, dims in SHAPES:
            for group in GROUPS:
                paths = []
                for form in ("conv", *FORMS):
                    path = Path(tmp) / f"{form}.onnx"
                    onnx.save(_model(form, args.channels, group, len(dims)), path)
                    paths.append(path)
                sessions = [timed_session(p, args.threads) for p in paths]
                x = np.random.default_rng(1).standard_normal((1, args.channels, *dims)).astype(np.float32)
                last = np.ascontiguousarray(np.moveaxis(x, 1, -1))
                feeds = [{"x": last if form == "core" else x} for form in ("conv", *FORMS)]
                (reference,) = sessions[0].run(None, feeds[0])
                for form, session, feed in zip(FORMS, sessions[1:], feeds[1:], strict=True):
                    (y,) = session.run(None, feed)
                    y = np.moveaxis(y, -1, 1) if form == "core" else y
                    np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-4)
                times = _latency(sessions, feeds, args.runs)
                cells, row = [], {"shape": label, "group": group, "conv_ms": statistics.median(times[0])}
                for form, sample in zip(FORMS, times[1:], strict=True):
                    ratio = ratio_of_medians(times[0], sample)
                    low, high = ratio_interval(times[0], sample)
                    cells.append(f"{ratio:6.2f} [{low:.2f}, {high:.2f}]")
                    row[form] = {"ratio": ratio, "low": low, "high": high}
                rows.append(row)
                print(
                    f"{label:<12} {group:>2} {row['conv_ms']:8.3f}  " + "  ".join(f"{c:>20}" for c in cells)
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
