"""onnxruntime's MatMulNBitsQuantizer turns every converted MatMul into MatMulNBits."""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from helpers import all_nodes, conv_model, session
from onnx_conv2matmul import ConvertOptions, convert


def _quantize(model):  # type: ignore[no-untyped-def]
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False)
    quantizer.process()
    return quantizer.model.model


def test_converted_pointwise_convs_become_matmulnbits() -> None:
    for spatial, attrs, options in (
        (1, {}, ConvertOptions(allow_added_transposes=True)),
        (2, {}, ConvertOptions(allow_added_transposes=True)),
        (3, {}, ConvertOptions(allow_added_transposes=True)),
        (
            2,
            {"strides": [2, 2], "pads": [1, 1, 0, 0]},
            ConvertOptions(allow_added_transposes=True, extended=True),
        ),
    ):
        original = conv_model(spatial=spatial, in_channels=64, out_channels=48, attrs=attrs)
        # Without the rewrite the quantizer has nothing to take.
        untouched = [n.op_type for n in all_nodes(_quantize(original).graph)]
        assert "MatMulNBits" not in untouched
        rewritten, report = convert(original, options)
        quantized = _quantize(rewritten)
        ops = [n.op_type for n in all_nodes(quantized.graph)]
        assert ops.count("MatMulNBits") == len(report.converted) == 1
        assert "MatMul" not in ops
        # Quantized, so not exact, but close to the fp32 model.
        x = np.random.default_rng(0).standard_normal((2, 64, *[5] * spatial)).astype(np.float32)
        ref = session(original).run(None, {"x": x})[0]
        out = session(quantized).run(None, {"x": x})[0]
        cos = float(np.dot(ref.ravel(), out.ravel()) / np.linalg.norm(ref) / np.linalg.norm(out))
        assert cos > 0.99
