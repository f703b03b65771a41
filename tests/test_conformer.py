"""The bundled Conformer-shaped encoder (torch dynamo export): the headline use case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from helpers import all_nodes, assert_equivalent, assert_matmul_weights_2d, session
from onnx_conv2matmul import ConvertOptions, SkipReason, Status, convert, convert_file
from onnx_conv2matmul.verify.check import VerifyOptions

MODEL = Path(__file__).parent / "data" / "conformer_small.onnx"


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    feeds = []
    for batch in (1, 2):
        for frames in (64, 97, 160):
            lengths = np.array([frames - 13 * i for i in range(batch)], dtype=np.int64)
            feeds.append(
                {
                    "audio_signal": rng.standard_normal((batch, 32, frames)).astype(np.float32),
                    "length": lengths,
                }
            )
    return feeds


def _transpose_producer(model: onnx.ModelProto, node: onnx.NodeProto) -> str | None:
    producers = {o: n for n in model.graph.node for o in n.output}
    p = producers.get(node.input[0])
    return p.op_type if p is not None else None


def test_every_pointwise_conv_is_converted_and_exact() -> None:
    original = onnx.load(MODEL)
    rewritten, report = convert(original, ConvertOptions(allow_added_transposes=True, extended=True))
    onnx.checker.check_model(rewritten)
    converted = [e for e in report.entries if e.status is Status.CONVERTED]
    skipped = [e for e in report.entries if e.status is Status.SKIPPED]
    # 2 Conv2D 1x1 in the subsampling, pw1 + pw2 in each of 2 conformer layers.
    assert len(converted) == 6
    assert sorted(len(e.weight_shape or []) for e in converted) == [3, 3, 3, 3, 4, 4]
    # The 3x3 subsampling convs and the depthwise k=9 convs stay.
    assert {e.reason for e in skipped} == {SkipReason.KERNEL_NOT_POINTWISE}
    ops = [n.op_type for n in all_nodes(rewritten.graph)]
    assert ops.count("Conv") == len(skipped) == 5
    linear_matmuls = [n.op_type for n in all_nodes(original.graph)].count("MatMul")
    assert_matmul_weights_2d_subset(rewritten, {e.matmul for e in converted})
    assert ops.count("MatMul") == linear_matmuls + 6
    assert_equivalent(original, rewritten, _feeds())


def assert_matmul_weights_2d_subset(model: onnx.ModelProto, names: set[str | None]) -> None:
    sub = onnx.ModelProto()
    sub.CopyFrom(model)
    keep = [n for n in sub.graph.node if n.op_type != "MatMul" or n.name in names]
    del sub.graph.node[:]
    sub.graph.node.extend(keep)
    assert_matmul_weights_2d(sub, len(names))


def test_conformer_conv_module_transposes_cancel() -> None:
    original = onnx.load(MODEL)
    rewritten, report = convert(original, ConvertOptions(allow_added_transposes=True, extended=True))
    # The exporter's Transpose before pw1 and after pw2 of each conv module cancel with ours
    # (2 layers x 2 pairs x 2 nodes); the last front-end conv's Transpose moves below its ReLU
    # and merges into the exporter's Transpose[0,2,1,3] (1 node).
    assert report.transposes_cancelled == 9
    for node in rewritten.graph.node:
        if node.op_type == "Transpose":
            assert _transpose_producer(rewritten, node) != "Transpose"
    # Conv1D pointwise convs add no Transpose. The Conv2D 1x1 of the subsampling front end sit
    # between depthwise convs (which need channels-first) and add 3 (see docs/rewrite.md).
    assert report.transposes_after == report.transposes_before + 3


def test_convert_file_verifies_at_several_lengths_and_batches(tmp_path: Path) -> None:
    report = convert_file(
        MODEL,
        tmp_path / "out.onnx",
        ConvertOptions(allow_added_transposes=True, extended=True),
        verify=VerifyOptions(batch=2, lengths=(64, 97, 191)),
    )
    assert report.return_code == 0
    assert report.output_bytes is not None and report.input_bytes is not None
    assert report.output_bytes <= report.input_bytes


def test_quantizer_takes_every_linear_and_pointwise_conv() -> None:
    original = onnx.load(MODEL)
    rewritten, _report = convert(original, ConvertOptions(allow_added_transposes=True, extended=True))
    initializers = {t.name for t in rewritten.graph.initializer}
    constant_matmuls = sum(
        1 for n in all_nodes(rewritten.graph) if n.op_type == "MatMul" and n.input[1] in initializers
    )
    # Per layer 9 Linear (2 + 2 feed-forward, q/k/v/out/pos) + 2 pointwise convs; subsampling
    # Linear + its two Conv2D 1x1.
    assert constant_matmuls == 2 * 11 + 3
    quantizer = MatMulNBitsQuantizer(rewritten, bits=4, block_size=32, is_symmetric=False)
    quantizer.process()
    quantized = quantizer.model.model
    ops = [n.op_type for n in all_nodes(quantized.graph)]
    # Every MatMul with a constant weight became MatMulNBits; attention's activation x activation
    # MatMuls stay.
    assert ops.count("MatMulNBits") == constant_matmuls
    assert ops.count("Conv") == 5
    ref = session(original).run(None, _feeds()[0])[0]
    out = session(quantized).run(None, _feeds()[0])[0]
    cos = float(np.dot(ref.ravel(), out.ravel()) / np.linalg.norm(ref) / np.linalg.norm(out))
    assert cos > 0.98
