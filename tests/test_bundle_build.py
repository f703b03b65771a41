"""bundle: splitting decoder_joint exactly, the layouts' files and metadata, building a folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import matmul_model, session
from onnx_conv2matmul.bundle import layouts
from onnx_conv2matmul.bundle.build import BundleOptions, build_bundle, model_facts, read_source
from onnx_conv2matmul.bundle.split import split_decoder_joint, verify_split
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.quantize.options import QuantizeOptions
from onnx_conv2matmul.verify.check import VerifyOptions

DATA = Path(__file__).parent / "data"
SOURCE = DATA / "parakeet_small"


def _split_to(src: Path, out: Path) -> tuple[Path, Path, list[str]]:
    parts = split_decoder_joint(_io.load_model(str(src)).model)
    out.mkdir(exist_ok=True)
    decoder, joiner = out / "decoder.onnx", out / "joiner.onnx"
    _output.save(parts.decoder, str(decoder), None)
    _output.save(parts.joiner, str(joiner), None)
    return decoder, joiner, parts.int32_inputs


def _ops(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


@pytest.mark.parametrize("name", ["parakeet_small/decoder_joint-model.onnx", "tdt_decoder_small.onnx"])
def test_split_is_exact_and_in_sherpas_interface(name: str, tmp_path: Path) -> None:
    src = DATA / name
    decoder, joiner, int32_inputs = _split_to(src, tmp_path)
    for path in (decoder, joiner):
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    check = verify_split(str(src), str(decoder), str(joiner), vocab_size=33)
    assert check.passed
    assert check.max_abs_diff == 0.0 and check.states_equal
    dec, join = session(onnx.load(str(decoder))), session(onnx.load(str(joiner)))
    assert [(a.name, a.type) for a in dec.get_inputs()[:2]] == [
        ("targets", "tensor(int32)"),
        ("target_length", "tensor(int32)"),
    ]
    assert dec.get_outputs()[0].name == "decoder_outputs"
    assert dec.get_outputs()[0].shape[1] == 32  # [B, H, U]
    assert [a.name for a in join.get_inputs()] == ["encoder_outputs", "decoder_outputs"]
    assert len(join.get_outputs()) == 1
    assert "LSTM" in _ops(decoder) and "LSTM" not in _ops(joiner)
    assert "MatMul" not in _ops(decoder) and "MatMul" in _ops(joiner)
    # The old small decoder took int64 indices: the split decoder casts int32 to them.
    assert int32_inputs == ([] if name.startswith("parakeet") else ["targets", "target_length"])


def _hand_joint(
    *, layout: int = 0, joint_reads_targets: bool = False, pred_reads_encoder: bool = False, op: str = "LSTM"
) -> onnx.ModelProto:
    """A decoder_joint in NeMo's interface, built node by node (E=4 encoder dims, H=3, V=5)."""
    rng = np.random.default_rng(0)
    gates = {"LSTM": 4, "GRU": 3}[op]

    def init(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [
        init("emb", 6, 3),
        init("W", 1, gates * 3, 3),
        init("R", 1, gates * 3, 3),
        init("w_enc", 4, 3),
        init("w_pred", 3, 3),
        init("w_out", 3, 5),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
    ]
    nodes = [helper.make_node("Gather", ["emb", "targets"], ["e"])]  # [B, U, 3]
    x = "e"
    if layout == 0:
        nodes.append(helper.make_node("Transpose", ["e"], ["x"], perm=[1, 0, 2]))  # [U, B, 3]
        x = "x"
    if pred_reads_encoder:
        nodes.append(helper.make_node("ReduceMean", ["encoder_outputs"], ["m"], keepdims=1))
        nodes.append(helper.make_node("Add", [x, "m"], ["xm"]))
        x = "xm"
    state_in = ["s1"] if op == "GRU" else ["s1", "s2"]
    state_out = ["h"] if op == "GRU" else ["h", "c"]
    nodes.append(helper.make_node(op, [x, "W", "R", "", "", *state_in], ["y", *state_out], hidden_size=3,
                                  layout=layout))  # fmt: skip
    # y: [U, 1, B, 3] (layout 0) or [B, U, 1, 3] (layout 1) -> [B, U, 3]
    if layout == 0:
        nodes += [
            helper.make_node("Squeeze", ["y", "axis1"], ["y3"]),
            helper.make_node("Transpose", ["y3"], ["g"], perm=[1, 0, 2]),
        ]
    else:
        nodes.append(helper.make_node("Squeeze", ["y", "axis2"], ["g"]))
    nodes += [
        helper.make_node("MatMul", ["g", "w_pred"], ["gp"]),
        helper.make_node("Unsqueeze", ["gp", "axis1"], ["gu"]),  # [B, 1, U, 3]
        helper.make_node("Transpose", ["encoder_outputs"], ["f"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["f", "w_enc"], ["fp"]),
        helper.make_node("Unsqueeze", ["fp", "axis2"], ["fu"]),  # [B, T, 1, 3]
        helper.make_node("Add", ["fu", "gu"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["r"]),
    ]
    if joint_reads_targets:
        nodes.append(helper.make_node("Shape", ["targets"], ["ts"]))
        nodes.append(helper.make_node("Cast", ["ts"], ["tsf"], to=TensorProto.FLOAT))
        nodes.append(helper.make_node("ReduceSum", ["tsf"], ["tss"], keepdims=1))
        nodes.append(helper.make_node("Add", ["r", "tss"], ["r2"]))
        nodes.append(helper.make_node("MatMul", ["r2", "w_out"], ["outputs"]))
    else:
        nodes.append(helper.make_node("MatMul", ["r", "w_out"], ["outputs"]))
    nodes.append(helper.make_node("Identity", ["target_length"], ["prednet_lengths"]))
    for i, s in enumerate(state_out):
        nodes.append(helper.make_node("Identity", [s], [f"output_states_{i + 1}"]))
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("encoder_outputs", f32, ["B", 4, "T"]),
        helper.make_tensor_value_info("targets", i64, ["B", "U"]),
        helper.make_tensor_value_info("target_length", i64, ["B"]),
        *(helper.make_tensor_value_info(s, f32, [1, "B", 3]) for s in state_in),
    ]
    outputs = [
        helper.make_tensor_value_info("outputs", f32, ["B", "T", "U", 5]),
        helper.make_tensor_value_info("prednet_lengths", i64, ["B"]),
        *(
            helper.make_tensor_value_info(f"output_states_{i + 1}", f32, [1, "B", 3])
            for i in range(len(state_out))
        ),
    ]
    graph = helper.make_graph(nodes, "decoder_joint", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_split_of_a_hand_built_joint(op: str, tmp_path: Path) -> None:
    src = tmp_path / "dj.onnx"
    onnx.save(_hand_joint(op=op), src)
    decoder, joiner, _ = _split_to(src, tmp_path / "out")
    check = verify_split(str(src), str(decoder), str(joiner), vocab_size=6)
    assert check.passed and check.max_abs_diff == 0.0, check


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"joint_reads_targets": True}, "reads 2 tensors of the prediction network"),
        ({"pred_reads_encoder": True}, "the prediction network reads the encoder output"),
        ({"layout": 1}, "batch-first"),
    ],
)
def test_split_refuses_what_it_cannot_cut_exactly(kwargs: dict[str, int], message: str) -> None:
    model = ir.serde.deserialize_model(_hand_joint(**kwargs))
    with pytest.raises(InputError, match=message):
        split_decoder_joint(model)


def test_split_refuses_a_model_without_the_interface() -> None:
    with pytest.raises(InputError, match="not a decoder_joint model"):
        split_decoder_joint(ir.serde.deserialize_model(matmul_model()))


def test_read_vocab(tmp_path: Path) -> None:
    path = tmp_path / "vocab.txt"
    path.write_text("<unk> 0\n\u2581a 1\n<blk> 2\n", encoding="utf-8")
    vocab = layouts.read_vocab(str(path))
    assert vocab.tokens == ["<unk>", "\u2581a", "<blk>"] and vocab.size_without_blank == 2
    assert vocab.text() == path.read_text(encoding="utf-8")
    for text, message in [
        ("<unk> 0\n<blk> 1\n\u2581a 2\n", "not the last id"),
        ("<unk> 0\n\u2581a 1\n", "no blank"),
        ("<unk> 0\n\u2581a 3\n<blk> 2\n", "expected"),
    ]:
        path.write_text(text, encoding="utf-8")
        with pytest.raises(InputError, match=message):
            layouts.read_vocab(str(path))


def test_file_names_and_tag() -> None:
    roles = dict(zip(("encoder", "decoder_joint"), layouts.ROLES[layouts.ONNX_ASR], strict=True))
    assert layouts.file_name(layouts.ONNX_ASR, roles["encoder"], "int4") == "encoder-model.int4.onnx"
    assert (
        layouts.file_name(layouts.ONNX_ASR, roles["decoder_joint"], "int4") == "decoder_joint-model.int4.onnx"
    )
    sherpa = [layouts.file_name(layouts.SHERPA_ONNX, r, "int4") for r in layouts.ROLES[layouts.SHERPA_ONNX]]
    assert sherpa == ["encoder.int4.onnx", "decoder.int8.onnx", "joiner.int8.onnx"]
    for bad in ("", "int*", "a.b", "x?"):
        with pytest.raises(InputError):
            layouts.check_tag(bad)


def test_facts_metadata_and_config_from_the_models(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(SOURCE, source)
    (source / "config.json").unlink()
    facts = model_facts(read_source(str(source)))  # subsampling from one run of the encoder
    assert facts == layouts.ModelFacts(
        features=128, subsampling=8, pred_layers=2, pred_hidden=32, joint_outputs=38, vocab_size=32
    )
    assert facts.durations == 5 and facts.is_tdt
    assert layouts.onnx_asr_config(None, facts) == {
        "model_type": "nemo-conformer-tdt",
        "features_size": 128,
        "subsampling_factor": 8,
    }
    meta = layouts.sherpa_metadata(facts)
    assert {k: meta[k] for k in ("vocab_size", "pred_rnn_layers", "pred_hidden", "feat_dim")} == {
        "vocab_size": "32",
        "pred_rnn_layers": "2",
        "pred_hidden": "32",
        "feat_dim": "128",
    }
    assert "tdt" in meta["url"] and meta["normalize_type"] == "per_feature"


def test_build_writes_config_manifest_and_replaces_its_own_bundle(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(SOURCE, source)
    (source / "config.json").unlink()
    out = tmp_path / "bundle"
    report = build_bundle(source, out)
    assert report.passed and report.output_dir == str(out)
    assert json.loads((out / "config.json").read_text())["features_size"] == 128
    manifest = json.loads((out / "manifest.json").read_text())
    assert [m["model"] for m in manifest["models"]] == [
        "decoder_joint-model.int4.onnx",
        "encoder-model.int4.onnx",
    ]
    assert all(m["quantization"]["accuracy"]["min_cosine"] > 0.99 for m in manifest["models"])
    assert {f.path for f in report.files} == set(os.listdir(out))
    assert report.bundle_bytes == sum(p.stat().st_size for p in out.iterdir())
    assert report.bundle_bytes < report.source_bytes
    assert manifest["written"]["tool"] == "onnx-conv2matmul" and manifest["written"]["run"]
    first_run = manifest["written"]["run"]
    again = build_bundle(source, out)  # its own bundle, unchanged: replaced whole
    assert again.passed
    assert json.loads((out / "manifest.json").read_text())["written"]["run"] != first_run
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging or lock left
    # A file the tool did not write makes the folder no longer provably its own: refused, kept.
    (out / "stale.txt").write_text("the user's notes")
    with pytest.raises(InputError, match=r"stale\.txt"):
        build_bundle(source, out)
    assert (out / "stale.txt").read_text() == "the user's notes"


def test_replacing_without_an_atomic_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bundle"
    assert build_bundle(SOURCE, out).passed
    before = json.loads((out / "manifest.json").read_text())["written"]["run"]
    monkeypatch.setattr("onnx_conv2matmul.files.publish._exchange", lambda a, b: False)
    assert build_bundle(SOURCE, out).passed
    assert json.loads((out / "manifest.json").read_text())["written"]["run"] != before
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_build_sherpa_metadata(tmp_path: Path) -> None:
    report = build_bundle(SOURCE, tmp_path / "b", BundleOptions(layout=layouts.SHERPA_ONNX))
    assert report.split is not None and report.split.passed
    proto = onnx.load(str(tmp_path / "b" / "encoder.int4.onnx"), load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert {k: meta[k] for k in report.metadata} == report.metadata
    tokens = (tmp_path / "b" / "tokens.txt").read_text(encoding="utf-8").splitlines()
    assert len(tokens) == int(meta["vocab_size"]) + 1 and tokens[-1] == f"<blk> {meta['vocab_size']}"


def test_build_refuses_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"vocab\.txt not found"):
        source = tmp_path / "src"
        source.mkdir()
        for name in ("encoder-model.onnx", "encoder-model.onnx.data", "decoder_joint-model.onnx"):
            shutil.copyfile(SOURCE / name, source / name)
        build_bundle(source, tmp_path / "out")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a bundle this tool wrote"):
        build_bundle(SOURCE, other)
    assert os.listdir(other) == ["notes.txt"]
    with pytest.raises(InputError, match="unknown bundle layout"):
        build_bundle(SOURCE, tmp_path / "x", BundleOptions(layout="whisper"))


def test_build_below_the_minimum_cosine_writes_nothing(tmp_path: Path) -> None:
    """Settings given (as the bundle command passes them): below the criterion the encoder is
    refused; with none, quantize_file's search below the criterion would run instead."""
    out = tmp_path / "bundle"
    options = BundleOptions(quantize=QuantizeOptions(), verify=VerifyOptions(min_cosine=0.99999999))
    report = build_bundle(SOURCE, out, options)
    assert not report.passed and report.output_dir is None
    assert report.failure is not None and "encoder" in report.failure
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
