"""The accuracy check of the search's result uses the search's own evaluation of the same model
(the same digest) instead of running it again; any other model is run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from onnx_conv2matmul.api import quantize_file
from onnx_conv2matmul.quantize.options import AutoOptions, Setting
from onnx_conv2matmul.quantize.search_result import AutoConfig, apply
from onnx_conv2matmul.quantize.search_runs import model_digest
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.verify.check import VerifyOptions, verify_models

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"
VERIFY = VerifyOptions(lengths=(64, 97))
REUSED = "not run again"


def test_the_searched_model_is_checked_from_its_evaluation_and_agrees_with_a_real_check(
    tmp_path: Path,
) -> None:
    out = tmp_path / "auto.onnx"
    report = quantize_file(ENCODER, out, verify=VERIFY, auto=AutoOptions(min_cosine=0.999))
    assert report.return_code == 0 and report.verification is not None and report.auto is not None
    assert any(REUSED in w for w in report.verification.warnings)
    again = verify_models(str(ENCODER), str(out), report.verification.options)  # run for real
    assert again.passed == report.verification.passed
    assert len(again.results) == len(report.verification.results)
    for real, kept in zip(again.results, report.verification.results, strict=True):
        assert (real.length, real.output) == (kept.length, kept.output)
        if real.cosine is not None:
            assert kept.cosine == pytest.approx(real.cosine, abs=1e-5)
    assert report.auto.checked is None  # used once


def _rewritten() -> ir.Model:
    model = ir.load(ENCODER)
    rewrite_model(model, ConvertOptions(extended=True, allow_non_unit_dilation=True))
    return model


def test_the_digest_is_the_computation_not_the_storage(tmp_path: Path) -> None:
    first, second = _rewritten(), _rewritten()
    names = [node.name for node in first.graph if node.op_type == "MatMul" and node.name][:2]
    config = AutoConfig(dict.fromkeys(names, Setting(4, 32, False)))
    apply(first, config)
    apply(second, config)
    assert model_digest(first) == model_digest(second)
    ir.save(first, tmp_path / "a.onnx", external_data="elsewhere.data")
    assert model_digest(ir.load(tmp_path / "a.onnx")) == model_digest(second)
    tensor = next(iter(second.graph.initializers.values()))
    array = tensor.const_value.numpy().copy()  # type: ignore[union-attr]
    array.flat[0] = np.nextafter(array.flat[0], np.inf) if array.dtype.kind == "f" else array.flat[0] + 1
    tensor.const_value = ir.Tensor(array)
    assert model_digest(second) != model_digest(first)
