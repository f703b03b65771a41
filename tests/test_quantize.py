"""quantize and bundle: onnxruntime's quantizers end to end on the bundled models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner
from onnx import TensorProto, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from helpers import all_nodes, matmul_model, no_bench, session
from onnx_conv2matmul import ConvertOptions, convert
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits
from onnx_conv2matmul.quantize.options import QuantizeOptions

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"
DECODER = DATA / "tdt_decoder_small.onnx"


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _encoder_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "audio_signal": rng.standard_normal((2, 32, 120)).astype(np.float32),
        "length": np.array([120, 99], dtype=np.int64),
    }


@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, False)])
def test_one_weight_at_a_time_matches_matmulnbitsquantizer(bits: int, symmetric: bool) -> None:
    """Our per-node use of onnxruntime's quantizer gives the same model as its whole-model API."""
    rewritten, _ = convert(onnx.load(ENCODER), ConvertOptions(allow_added_transposes=True, extended=True))
    reference = MatMulNBitsQuantizer(
        onnx.ModelProto.FromString(rewritten.SerializeToString()),
        bits=bits,
        block_size=32,
        is_symmetric=symmetric,
        accuracy_level=0,
    )
    reference.process()
    expected = reference.model.model

    model = ir.serde.deserialize_model(rewritten)
    result = quantize_matmul_nbits(model, QuantizeOptions(bits=bits, block_size=32, symmetric=symmetric))
    ours = ir.serde.serialize_model(model)

    def nbits(m: onnx.ModelProto) -> list[tuple[str, dict[str, object]]]:
        return sorted(
            (n.name, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
            for n in all_nodes(m.graph)
            if n.op_type == "MatMulNBits"
        )

    assert nbits(ours) == nbits(expected)
    assert result.quantized == len(nbits(ours)) == 25
    packed = {t.name: onnx.numpy_helper.to_array(t) for t in expected.graph.initializer}
    for tensor in ours.graph.initializer:
        if tensor.name.endswith(f"_Q{bits}"):
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), packed[tensor.name])
    feeds = _encoder_feeds()
    for a, b in zip(session(expected).run(None, feeds), session(ours).run(None, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_quantize_command_on_the_encoder(tmp_path: Path) -> None:
    out = tmp_path / "encoder.int4.onnx"
    code, stdout, stderr = _invoke(
        "quantize",
        str(ENCODER),
        str(out),
        "--block-size",
        "32",
        "--allow-added-transposes",
        "--verify-batch",
        "2",
        "--report-json-stdout",
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    model = onnx.load(out)
    ops = [n.op_type for n in all_nodes(model.graph)]
    # Every Linear and pointwise conv became MatMulNBits; depthwise and 3x3 convs stay.
    # (The two pointwise convs of the front end sit between depthwise convs: converting them
    # adds Transposes, which --allow-added-transposes accepts.)
    assert ops.count("MatMulNBits") == data["quantized_nodes"] == 25
    assert ops.count("Conv") == 5
    assert data["rewrite"]["converted"] == 6
    assert data["weights_with_rewrite"]["share"] > data["weights_without_rewrite"]["share"]
    assert data["files"]["output_bytes"] < 0.5 * data["files"]["input_bytes"]
    cosines = [r["cosine"] for r in data["verification"]["results"] if r["cosine"] is not None]
    assert cosines and min(cosines) > 0.98
    assert "cosine" in stderr and "MatMulNBits" in stderr
    assert data["peak_rss_bytes"] > 0 and data["seconds"] > 0


def test_front_end_convs_are_left_alone_by_default() -> None:
    """The encoder's front-end pointwise convs sit between depthwise convs: both Transposes would stay."""
    _, report = convert(onnx.load(ENCODER), ConvertOptions(extended=True, allow_non_unit_dilation=True))
    assert report.skip_counts.get("adds_transposes") == 2
    assert len(report.converted) == 4
    assert report.transposes_after is not None and report.transposes_before is not None
    assert report.transposes_after <= report.transposes_before


def test_min_cosine_above_what_is_reached(tmp_path: Path) -> None:
    """With settings given, a model below --min-cosine is refused: exit 1, nothing written,
    and the message names the search. With the default settings the one pass decides a mix
    instead, and what it writes meets the minimum, with a warning."""
    out = tmp_path / "encoder.int4.onnx"
    code, _, stderr = _invoke("quantize", str(ENCODER), str(out), "--bits", "4", "--min-cosine", "0.99999")
    assert code == 1
    assert "Verification FAILED" in stderr and "nothing was written" in stderr
    assert "--auto searches for settings that meet it" in stderr and "--inputs" in stderr
    assert list(tmp_path.iterdir()) == []
    code, stdout, stderr = _invoke(
        "quantize", str(ENCODER), str(out), "--min-cosine", "0.99999", "--verify-lengths", "64",
        "--report-json-stdout",
    )  # fmt: skip
    assert code == 0 and out.exists()
    data = json.loads(stdout)
    assert data["accuracy"]["fallback"]["worst_cosine"] < 0.99999
    assert data["accuracy"]["min_cosine_source"] == "given"
    assert any("fell below the accuracy criterion" in w for w in data["warnings"])
    assert min(r["cosine"] for r in data["verification"]["results"] if r["cosine"] is not None) >= 0.99999
    assert data["auto"] is None and data["one_pass"]["candidates"][-1]["passed"]  # decided, not searched


def test_exclude_and_include_patterns(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    code, stdout, _ = _invoke(
        "quantize", str(ENCODER), str(out), "--exclude", "*conv1d*", "--report-json-stdout", "-q"
    )
    assert code == 0
    data = json.loads(stdout)
    assert len(data["excluded"]) == 4 and data["quantized_nodes"] == 19
    code, stdout, _ = _invoke(
        "quantize", str(ENCODER), str(out), "--include", "*conv*", "--report-json-stdout", "-q"
    )
    assert json.loads(stdout)["quantized_nodes"] == 4


def test_int8_dynamic_on_the_decoder(tmp_path: Path) -> None:
    out = tmp_path / "decoder.int8.onnx"
    code, stdout, stderr = _invoke(
        "quantize",
        str(DECODER),
        str(out),
        "--int8-dynamic",
        "--verify-lengths",
        "8,16",
        "--report-json-stdout",
    )
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["mode"] == "int8_dynamic" and data["quantized_nodes"] > 0
    assert out.stat().st_size < 0.7 * DECODER.stat().st_size
    model = onnx.load(out)
    ops = [n.op_type for n in all_nodes(model.graph)]
    assert "MatMulInteger" in ops or "DynamicQuantizeLSTM" in ops
    # 7-bit weights: the uint8 x int8 kernel of x86 CPUs without VNNI adds pairs of products in
    # 16 bits, which saturate with full-range weights (a cosine of 0.98 there, whatever this CPU).
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.INT8]
    assert weights and max(int(np.abs(w.astype(np.int16)).max()) for w in weights) <= 64


def test_quantize_keeps_external_data_layout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(
        onnx.load(ENCODER),
        src / "enc.onnx",
        save_as_external_data=True,
        location="enc.onnx.data",
        size_threshold=1024,
    )
    out = tmp_path / "out"
    out.mkdir()
    code, _, stderr = _invoke("quantize", str(src / "enc.onnx"), str(out / "enc.int4.onnx"), "-q")
    assert code == 0, stderr
    assert {p.name for p in out.iterdir()} == {"enc.int4.onnx", "enc.int4.onnx.data"}
    session(str(out / "enc.int4.onnx")).run(None, _encoder_feeds())


def test_quantize_bad_options_exit_2(tmp_path: Path) -> None:
    for args, message in (
        (["--block-size", "48"], "power of 2"),
        (["--bits", "3"], "'3' is not one of"),
        (["--accuracy-level", "7"], "0<=x<=4"),
    ):
        code, _, stderr = _invoke("quantize", str(ENCODER), str(tmp_path / "q.onnx"), *args)
        assert code == 2 and message in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_bundle_lists_models_with_their_data(tmp_path: Path) -> None:
    onnx.save(
        onnx.load(ENCODER),
        tmp_path / "encoder.onnx",
        save_as_external_data=True,
        location="encoder.onnx.data",
        size_threshold=1024,
    )
    onnx.save(onnx.load(DECODER), tmp_path / "decoder.onnx")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    code, stdout, stderr = _invoke("bundle", "--check", str(tmp_path), "--report-json-stdout")
    assert code == 0
    data = json.loads(stdout)
    sizes = {m["model"]: m["bytes"] for m in data["models"]}
    assert (
        sizes["encoder.onnx"]
        == (tmp_path / "encoder.onnx").stat().st_size + (tmp_path / "encoder.onnx.data").stat().st_size
    )
    assert sizes["decoder.onnx"] == (tmp_path / "decoder.onnx").stat().st_size
    assert data["total_bytes"] == sum(sizes.values())
    assert "total" in stderr
    code, _, stderr = _invoke("bundle", "--check", str(tmp_path / "nope"))
    assert code == 2
    (tmp_path / "encoder.onnx.data").unlink()
    code, _, stderr = _invoke("bundle", "--check", str(tmp_path))
    assert code == 2 and "external data file not found" in stderr


def test_int8_patterns_and_an_include_that_matches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "d.onnx"
    code, stdout, stderr = _invoke(
        "quantize", str(DECODER), str(out), "--int8-dynamic", "--verify-lengths", "8", "--report-json-stdout"
    )
    assert code == 0 and "pre-processing" not in stderr
    everything = json.loads(stdout)["quantized_nodes"]
    names = [n.name for n in all_nodes(onnx.load(DECODER).graph) if n.op_type == "MatMul"]
    code, stdout, _ = _invoke(
        "quantize",
        str(DECODER),
        str(out),
        "--int8-dynamic",
        "--verify-lengths",
        "8",
        "--exclude",
        names[0],
        "--report-json-stdout",
        "-q",
    )
    assert code == 0 and json.loads(stdout)["quantized_nodes"] == everything - 1
    code, stdout, stderr = _invoke(
        "quantize", str(ENCODER), str(out), "--include", "nomatch*", "--report-json-stdout"
    )
    data = json.loads(stdout)
    assert data["quantized_nodes"] == 0 and data["warnings"] and "warning" in stderr


def _staging(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_int8_failure_after_quantize_dynamic_leaves_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while the quantized model is read back removes its staging directory."""
    from onnx_conv2matmul import api
    from onnx_conv2matmul.quantize import int8_step

    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)

    def unreadable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cannot read it back")

    monkeypatch.setattr(int8_step.ir, "load", unreadable)
    with pytest.raises(RuntimeError, match="cannot read it back"):
        api.quantize_file(src, tmp_path / "q.onnx", int8_dynamic=True)
    assert _staging(tmp_path) == [] and not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("int8", [False, True], ids=["matmulnbits", "int8-dynamic"])
def test_interrupt_right_after_staging_leaves_no_staging(tmp_path: Path, int8: bool) -> None:
    """Ctrl-C between staging the output and measuring it: the staged output is removed."""
    from onnx_conv2matmul import api

    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)

    class InterruptedAfterStaging:
        """Ctrl-C as the first phase after staging starts (the output check)."""

        def phase(self, name: str) -> None:
            if name == "Checking the output":
                raise KeyboardInterrupt

        def advance(self, done: int, total: int) -> None:
            pass

        def close(self) -> None:
            pass

    with pytest.raises(KeyboardInterrupt):
        api.quantize_file(src, tmp_path / "q.onnx", int8_dynamic=int8, progress=InterruptedAfterStaging())
    assert _staging(tmp_path) == [] and not (tmp_path / "q.onnx").exists()
