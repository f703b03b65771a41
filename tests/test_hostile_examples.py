"""The examples of issue 32 through the command line, each a run that went wrong before the fix.

This module imports only what every version of the tool has (the command line), so it runs
against an older checkout too, to show that each example failed there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from helpers import conv_model, no_bench, stack_model
from model_cache import FETCHER, Packaged
from onnx_conv2matmul.cli.app import main


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, no_bench(args))
    return result.exit_code, result.output


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(stack_model(layers=2, channels=64), path)
    return path


def test_quantize_compares_the_finite_places_and_refuses_a_sample_of_nan(stack: Path, tmp_path: Path) -> None:
    """One NaN input element makes one time step of that sample NaN in both models: the rest is
    compared (issue 43); a sample NaN everywhere compares nothing there, and is refused (exit 2)."""
    x = _rng().standard_normal((2, 20, 64)).astype(np.float32)
    x[0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    out = tmp_path / "out.onnx"
    code, text = _invoke("quantize", stack, out, "--inputs", tmp_path / "nan.npz", "--min-cosine", "0.99")
    assert code == 0, text
    assert out.exists()
    x[1, :, :] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    out = tmp_path / "out2.onnx"
    code, text = _invoke("quantize", stack, out, "--inputs", tmp_path / "nan.npz", "--min-cosine", "0.99")
    assert code == 2, text
    assert "NaN or Inf at every element of sample 1 (of 2)" in text
    assert not out.exists()


def test_gptq_on_nan_inputs_fails(stack: Path, tmp_path: Path) -> None:
    x = _rng().standard_normal((2, 20, 64)).astype(np.float32)
    x[1, 3, 5] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    out = tmp_path / "out.onnx"
    code, text = _invoke("quantize", stack, out, "--inputs", tmp_path / "nan.npz", "--algorithm", "gptq")
    assert code == 2, text
    assert "NaN" in text
    assert not out.exists()


def _zeroed(model: onnx.ModelProto) -> onnx.ModelProto:
    zeroed = onnx.ModelProto()
    zeroed.CopyFrom(model)
    for init in zeroed.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(init)), init.name))
    return zeroed


def test_verify_empty_batch_fails(tmp_path: Path) -> None:
    """An empty batch: outputs of no element; a candidate that outputs zeros used to pass."""
    model = conv_model()
    onnx.save(model, tmp_path / "a.onnx")
    onnx.save(_zeroed(model), tmp_path / "b.onnx")
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 6, 7), np.float32))
    np.savez(tmp_path / "full.npz", x=_rng().standard_normal((2, 6, 7)).astype(np.float32))
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    code, text = _invoke("verify", a, b, "--inputs", tmp_path / "empty.npz")
    assert code == 1, text
    assert "empty" in text
    assert _invoke("verify", a, a, "--inputs", tmp_path / "full.npz")[0] == 0
    assert _invoke("verify", a, b, "--inputs", tmp_path / "full.npz")[0] == 1


def _score_model(path: Path, scale: float) -> None:
    """A VAD-like score: one probability per sample, ``sigmoid(mean(x) * scale + 0.3)``."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
        helper.make_node("Mul", ["m", "k"], ["s"]),
        helper.make_node("Add", ["s", "b"], ["t"]),
        helper.make_node("Sigmoid", ["t"], ["p"]),
    ]
    graph = helper.make_graph(
        nodes,
        "score",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.array([scale], np.float32), "k"),
            numpy_helper.from_array(np.array([0.3], np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_scalar_output_floor_can_fail(tmp_path: Path) -> None:
    """One probability per sample: any candidate of the same sign used to pass at cosine 1.000000."""
    _score_model(tmp_path / "a.onnx", 1.0)
    _score_model(tmp_path / "wrong.onnx", 40.0)
    _score_model(tmp_path / "close.onnx", 1.001)
    a = tmp_path / "a.onnx"
    args = ("--verify-batch", "1", "--min-cosine", "0.99")
    code, text = _invoke("verify", a, tmp_path / "wrong.onnx", *args)
    assert code == 1, text
    assert "relative error" in text
    assert _invoke("verify", a, tmp_path / "close.onnx", *args)[0] == 0
    assert _invoke("verify", a, a, *args)[0] == 0


CLS = Packaged(
    "rapidocr-onnxruntime==1.4.4",
    "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
)


@pytest.mark.network
@pytest.mark.parametrize("seed", [0, 2, 4, 19, 21, 27])
def test_ppocr_direction_classifier_exact_at_every_seed(tmp_path: Path, seed: int) -> None:
    """A correct rewrite of a 2-element softmax used to fail exactness at these seeds (mean limit)."""
    model = FETCHER.fetch(CLS)
    out = tmp_path / "cls.onnx"
    flags = ("--extended-conv1x1", "--allow-added-transposes", "--allow-non-unit-dilation")
    code, text = _invoke("convert", model, out, *flags, "--verify", "--verify-seed", seed, "-q")
    assert code == 0, text
