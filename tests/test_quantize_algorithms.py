"""Each weight-only algorithm, node by node, gives what onnxruntime's MatMulNBitsQuantizer gives.

For every algorithm the MatMulNBits nodes of our output (attributes, packed weights, scales,
zero points) are compared byte for byte with ``MatMulNBitsQuantizer`` run by hand on the
same rewritten model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    GPTQWeightOnlyQuantConfig,
    HQQWeightOnlyQuantConfig,
    KQuantWeightOnlyQuantConfig,
    MatMulNBitsQuantizer,
)

from helpers import all_initializers, all_nodes, matmul_model, session
from onnx_conv2matmul import ConvertOptions, convert
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits
from onnx_conv2matmul.quantize.options import NodeSetting, QuantizeOptions
from onnx_conv2matmul.quantize.weight_only import torch_available

ENCODER = Path(__file__).parent / "data" / "conformer_small.onnx"


def _rewritten() -> onnx.ModelProto:
    model, _ = convert(onnx.load(ENCODER), ConvertOptions(allow_added_transposes=True, extended=True))
    return model


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [
        {
            "audio_signal": rng.standard_normal((b, 32, t)).astype(np.float32),
            "length": np.full(b, t, dtype=np.int64),
        }
        for b, t in ((1, 40), (2, 64))
    ]


class _Reader:
    """A calibration data reader over fixed feeds (copied by the quantizer, so restartable)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self.index = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.index == len(self.feeds):
            return None
        self.index += 1
        return self.feeds[self.index - 1]

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item


def _nbits(
    model: onnx.ModelProto,
) -> list[tuple[str, dict[str, Any], list[tuple[str, tuple[int, ...], bytes]]]]:
    """Every MatMulNBits: its input A, attributes and its constant inputs as raw bytes, sorted."""
    inits = all_initializers(model.graph)
    found = []
    for node in all_nodes(model.graph):
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        tensors = []
        for name in node.input[1:]:
            array = onnx.numpy_helper.to_array(inits[name])
            tensors.append((str(array.dtype), array.shape, array.tobytes()))
        found.append((node.input[0], attrs, tensors))
    return sorted(found, key=lambda item: item[0])


def _ours(model: onnx.ModelProto, options: QuantizeOptions, **kwargs: Any) -> onnx.ModelProto:
    ir_model = ir.serde.deserialize_model(model)
    result = quantize_matmul_nbits(ir_model, options, **kwargs)
    assert result.quantized == len(result.settings) > 0
    return ir.serde.serialize_model(ir_model)


def _reference(model: onnx.ModelProto, **kwargs: Any) -> onnx.ModelProto:
    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), **kwargs)
    quantizer.process()
    return quantizer.model.model


def _assert_same(ours: onnx.ModelProto, reference: onnx.ModelProto, count: int, *, run: bool = True) -> None:
    mine, theirs = _nbits(ours), _nbits(reference)
    assert len(mine) == len(theirs) == count
    for a, b in zip(mine, theirs, strict=True):
        assert a == b
    if not run:
        return
    feeds = _feeds()[1]
    for x, y in zip(session(reference).run(None, feeds), session(ours).run(None, feeds), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(("bits", "symmetric", "block"), [(4, True, 32), (8, False, 16)])
def test_default_matches(bits: int, symmetric: bool, block: int) -> None:
    model = _rewritten()
    config = DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=symmetric, bits=bits, accuracy_level=0
    )
    reference = _reference(model, algo_config=config)
    ours = _ours(model, QuantizeOptions(bits=bits, block_size=block, symmetric=symmetric))
    _assert_same(ours, reference, 25)


@pytest.mark.parametrize("symmetric", [False, True])
def test_default_matches_on_float16(symmetric: bool) -> None:
    """float16 weights go through the same path as float32 ones (scales in float16)."""
    model = matmul_model(onnx.TensorProto.FLOAT16)
    reference = _reference(model, bits=4, block_size=16, is_symmetric=symmetric, accuracy_level=2)
    ours = _ours(model, QuantizeOptions(block_size=16, symmetric=symmetric, accuracy_level=2))
    assert _nbits(ours) == _nbits(reference) and len(_nbits(ours)) == 1
    assert [n.name for n in ours.graph.node] == [n.name for n in reference.graph.node]
    assert [t.name for t in ours.graph.initializer] == [t.name for t in reference.graph.initializer]


@pytest.mark.parametrize("bits", [4, 8])
def test_k_quant_matches(bits: int) -> None:
    """At 4 bits onnxruntime's k-quant fails on an odd number of blocks along K (the two 16x16
    weights at block 16): those stay in float, and onnxruntime's run has them excluded."""
    model = _rewritten()
    names = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    odd = ["node_conv2d_2/MatMul", "node_conv2d_4/MatMul"] if bits == 4 else []
    # onnxruntime's whole-model k-quant takes its bits from the per-node configuration only.
    config = KQuantWeightOnlyQuantConfig(customized_weight_config={n: {"bits": bits} for n in names})
    reference = _reference(
        model, block_size=16, is_symmetric=False, accuracy_level=0, algo_config=config, nodes_to_exclude=odd
    )
    ir_model = ir.serde.deserialize_model(model)
    result = quantize_matmul_nbits(ir_model, QuantizeOptions(bits=bits, block_size=16, algorithm="k_quant"))
    assert [name for name, _ in result.not_quantized] == odd
    _assert_same(ir.serde.serialize_model(ir_model), reference, 25 - len(odd))


@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_matches(symmetric: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime's whole-model GPTQ imports torch to read feeds given as dicts (a model of several
    inputs): its conversion helper is the identity on numpy arrays, and is replaced by it here."""
    from onnxruntime.quantization.neural_compressor import util

    monkeypatch.setattr(util, "to_numpy", lambda data: data)
    model = _rewritten()
    odd = [] if symmetric else ["node_conv2d_2/MatMul", "node_conv2d_4/MatMul"]  # as for k-quant
    config = GPTQWeightOnlyQuantConfig(calibration_data_reader=_Reader(_feeds()))
    # Its GPTQ ignores nodes_to_exclude; at 8 bits it leaves a node a MatMul (with a fake-quantized
    # weight, so the two models' outputs are not compared then).
    config.customized_weight_config = {name: {"bits": 8} for name in odd}
    reference = _reference(model, block_size=16, is_symmetric=symmetric, accuracy_level=0, algo_config=config)
    ir_model = ir.serde.deserialize_model(model)
    options = QuantizeOptions(block_size=16, symmetric=symmetric, algorithm="gptq")
    result = quantize_matmul_nbits(ir_model, options, feeds=_feeds())
    assert [name for name, _ in result.not_quantized] == odd
    _assert_same(ir.serde.serialize_model(ir_model), reference, 25 - len(odd), run=not odd)


@pytest.mark.skipif(not torch_available(), reason="hqq needs torch")
def test_hqq_matches() -> None:
    model = _rewritten()
    reference = _reference(model, algo_config=HQQWeightOnlyQuantConfig(block_size=32, bits=4))
    ours = _ours(model, QuantizeOptions(block_size=32, algorithm="hqq"))
    _assert_same(ours, reference, 25)


def test_mixed_settings_give_each_node_its_own() -> None:
    """Per-node settings: each MatMulNBits equals onnxruntime's for that node's setting alone."""
    model = _rewritten()
    names = sorted(n.name for n in model.graph.node if n.op_type == "MatMul")
    special = {
        names[0]: NodeSetting(8, 16, False),
        names[1]: NodeSetting(4, 128, True),
        names[2]: NodeSetting(None),
    }
    ours = _nbits(_ours(model, QuantizeOptions(block_size=32, nodes=special)))
    assert len(ours) == 24
    for name, setting in special.items():
        if setting.bits is None:
            continue
        alone = _reference(
            model,
            bits=setting.bits,
            block_size=setting.block_size,
            is_symmetric=setting.symmetric,
            nodes_to_exclude=[n for n in names if n != name],
        )
        [expected] = _nbits(alone)
        assert expected in ours


def test_algorithm_refusals() -> None:
    with pytest.raises(ValueError, match="always stores zero points"):
        QuantizeOptions(algorithm="k_quant", symmetric=True)
    with pytest.raises(ValueError, match="always stores zero points"):
        QuantizeOptions(algorithm="hqq", nodes={"a": NodeSetting(4, 64, True)})
    with pytest.raises(ValueError, match="4 bits only"):
        QuantizeOptions(algorithm="gptq", bits_for=(("*", 8),))
    with pytest.raises(ValueError, match="4 bits only"):
        QuantizeOptions(algorithm="hqq", bits=8)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        QuantizeOptions(algorithm="awq")
    model = ir.serde.deserialize_model(_rewritten())
    with pytest.raises(InputError, match="needs calibration inputs"):
        quantize_matmul_nbits(model, QuantizeOptions(algorithm="gptq"))


def test_gptq_on_a_model_without_a_matmul_to_quantize_quantizes_nothing() -> None:
    """No MatMul with a constant weight (a lone conv the rewrite leaves, as it would add
    Transposes): nothing to calibrate, and no onnxruntime run that asks for no output."""
    from helpers import conv_model

    model = ir.serde.deserialize_model(conv_model(spatial=1, in_channels=32, out_channels=32))
    feeds = [{"x": np.ones((1, 32, 8), np.float32)}]
    result = quantize_matmul_nbits(model, QuantizeOptions(algorithm="gptq", block_size=16), feeds=feeds)
    assert result.quantized == 0 and not result.not_quantized


def test_hqq_without_torch_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx_conv2matmul.quantize import weight_only as _weight_only

    monkeypatch.setattr(_weight_only, "torch_available", lambda: False)
    model = ir.serde.deserialize_model(_rewritten())
    with pytest.raises(InputError, match=r"needs torch.*onnx-conv2matmul\[hqq\]"):
        quantize_matmul_nbits(model, QuantizeOptions(algorithm="hqq"))
