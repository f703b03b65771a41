"""quantize's options: real inputs, per-node settings, settings files, model metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from helpers import all_nodes, no_bench
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.quantize.options import CONFIG_VERSION, NodeSetting, QuantizeOptions, load_config
from onnx_conv2matmul.verify.check import VerifyOptions, load_inputs

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"


def _invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _json(*args: object) -> tuple[int, dict[str, Any], str]:
    code, stdout, stderr = _invoke(*args, "--report-json-stdout", "-q")
    return code, json.loads(stdout), stderr


def _save_feeds(directory: Path) -> list[Path]:
    rng = np.random.default_rng(3)
    paths = []
    for i, (b, t) in enumerate(((1, 50), (2, 72))):
        path = directory / f"utt{i}.npz"
        np.savez(
            path,
            audio_signal=rng.standard_normal((b, 32, t)).astype(np.float32),
            length=np.full(b, t, dtype=np.int64),
        )
        paths.append(path)
    return paths


def _nbits_bits(path: Path) -> dict[str, int]:
    """Each MatMulNBits node's name (without onnxruntime's suffix) and bits."""
    found = {}
    for node in all_nodes(onnx.load(path).graph):
        if node.op_type == "MatMulNBits":
            bits = next(a.i for a in node.attribute if a.name == "bits")
            found[node.name.rsplit("_Q", 1)[0]] = bits
    return found


# ---- per-node settings ---------------------------------------------------------------------------


def test_resolution_order() -> None:
    """Defaults, then bits_for (last match wins), exclude/include to float, then nodes over all."""
    options = QuantizeOptions(
        bits=4,
        block_size=32,
        symmetric=True,
        bits_for=(("ff*", 8), ("ff_out", 4)),
        exclude=("ff_skip", "pinned"),
        nodes={"pinned": NodeSetting(8, 128, False), "attn": NodeSetting(None)},
    )
    assert options.setting_for("attn_k") == NodeSetting(4, 32, True)
    assert options.setting_for("ff_in") == NodeSetting(8, 32, True)
    assert options.setting_for("ff_out") == NodeSetting(4, 32, True)
    assert options.setting_for("ff_skip").bits is None
    assert options.setting_for("pinned") == NodeSetting(8, 128, False)
    assert options.setting_for("attn").bits is None
    included = QuantizeOptions(include=("ff*",), nodes={"attn": NodeSetting(4)})
    assert included.setting_for("conv").bits is None
    assert included.setting_for("attn").bits == 4


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: NodeSetting(3), "bits must be 4 or 8"),
        (lambda: NodeSetting(4, 48), "power of 2"),
        (lambda: QuantizeOptions(bits_for=(("x", 2),)), "4 or 8"),
        (lambda: QuantizeOptions(other_weights="int4"), "keep or int8"),
        (lambda: QuantizeOptions(nodes={"a": 4}), "not a NodeSetting"),  # type: ignore[dict-item]
    ],
)
def test_bad_settings(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_bits_for_on_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    code, data, _ = _json("quantize", ENCODER, out, "--bits-for", "*conv1d*=8", "--bits-for", "*conv1d_5*=4")
    assert code == 0
    bits = _nbits_bits(out)
    eight = sorted(name for name, b in bits.items() if b == 8)
    assert eight == ["node_conv1d/MatMul", "node_conv1d_2/MatMul", "node_conv1d_3/MatMul"]
    reported = {item["node"]: item["bits"] for item in data["quantized"]}
    assert reported == bits and len(reported) == data["quantized_nodes"] == 23
    code, _, stderr = _invoke("quantize", ENCODER, out, "--bits-for", "*=3")
    assert code == 2 and "PATTERN=4 or PATTERN=8" in stderr


# ---- settings files ------------------------------------------------------------------------------


_settings = st.builds(
    NodeSetting,
    bits=st.sampled_from([4, 8, None]),
    block_size=st.sampled_from([16, 32, 64, 128, 256]),
    symmetric=st.booleans(),
)


@given(
    bits=st.sampled_from([4, 8]),
    block_size=st.sampled_from([16, 64, 256]),
    symmetric=st.booleans(),
    patterns=st.lists(st.tuples(st.text(min_size=1, max_size=5), st.sampled_from([4, 8])), max_size=3),
    nodes=st.dictionaries(st.text(max_size=8), _settings, max_size=3),
    exclude=st.lists(st.text(max_size=5), max_size=2),
)
def test_config_round_trip(
    bits: int,
    block_size: int,
    symmetric: bool,
    patterns: list[tuple[str, int]],
    nodes: dict[str, NodeSetting],
    exclude: list[str],
) -> None:
    options = QuantizeOptions(
        bits=bits,
        block_size=block_size,
        symmetric=symmetric,
        bits_for=tuple(patterns),
        nodes=nodes,
        exclude=tuple(exclude),
    )
    config = json.loads(json.dumps(options.to_config()))
    assert config["config_version"] == CONFIG_VERSION
    again = QuantizeOptions.from_config(config)
    assert again == options
    assert again.to_config() == options.to_config()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"bits": 4}', "config_version must be 1"),
        ('{"config_version": 2}', "config_version must be 1"),
        ('{"config_version": 1, "bitz": 4}', "unknown settings key 'bitz'"),
        ('{"config_version": 1, "bits": "4"}', "must be a JSON integer"),
        ('{"config_version": 1, "symmetric": 1}', "must be a JSON boolean"),
        ('{"config_version": 1, "block_size": 48}', "power of 2"),
        ('{"config_version": 1, "bits_for": [["*", 8]]}', "each bits_for entry"),
        ('{"config_version": 1, "nodes": {"a": {"bits": 2}}}', "node 'a': bits must be 4 or 8"),
        ('{"config_version": 1, "nodes": {"a": {"block_size": 32}}}', "node 'a' must be an object"),
        ('{"config_version": 1, "other_weights": "int4"}', "keep or int8"),
        ('{"config_version": 1, "algorithm": "k_quant", "symmetric": true}', "always stores zero points"),
    ],
)
def test_bad_settings_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "settings.json"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        load_config(str(path))
    code, _, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--config", path)
    assert code == 2 and message.split("'")[0] in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert not (tmp_path / "q.onnx").exists()


def test_a_settings_file_nested_too_deeply_is_refused(tmp_path: Path) -> None:
    """JSON nested 100,000 deep exceeds the parser's recursion: an input error, not a crash."""
    path = tmp_path / "settings.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError, match="nested too deeply"):
        load_config(str(path))
    code, _, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--config", path)
    assert code == 2 and "nested too deeply" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.onnx").exists()


def test_config_replays_a_run_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    """The report's options.quantize is a settings file; replaying it gives the same model."""
    first = tmp_path / "a.onnx"
    code, data, _ = _json("quantize", ENCODER, first, "--bits-for", "*conv1d*=8", "--block-size", "32")
    assert code == 0
    config = data["options"]["quantize"]
    config["nodes"] = {"node_MatMul_14": {"bits": None}, "node_MatMul_43": {"bits": 8, "symmetric": True}}
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(config))
    second = tmp_path / "b.onnx"
    code, replay, _ = _json("quantize", ENCODER, second, "--config", settings)
    assert code == 0
    assert replay["options"]["quantize"] == {
        **config,
        "nodes": {
            "node_MatMul_14": {"bits": None, "block_size": 64, "symmetric": False},
            "node_MatMul_43": {"bits": 8, "block_size": 64, "symmetric": True},
        },
    }
    assert replay["excluded"] == ["node_MatMul_14"]
    settings_by_node = {item["node"]: item for item in replay["quantized"]}
    assert settings_by_node["node_MatMul_43"]["symmetric"] is True
    assert settings_by_node["node_conv1d/MatMul"]["bits"] == 8
    assert settings_by_node["node_MatMul_46"]["block_size"] == 32
    # A run replayed as it is gives the same bytes.
    third = tmp_path / "c.onnx"
    settings.write_text(json.dumps(replay["options"]["quantize"]))
    assert _invoke("quantize", ENCODER, third, "--config", settings, "-q")[0] == 0
    assert third.read_bytes() == second.read_bytes()
    # Options given on the command line win; a repeatable one replaces the file's list.
    code, override, _ = _json(
        "quantize",
        ENCODER,
        tmp_path / "d.onnx",
        "--config",
        settings,
        "--block-size",
        "128",
        "--bits-for",
        "x=8",
    )
    assert code == 0
    assert override["options"]["quantize"]["block_size"] == 128
    assert override["options"]["quantize"]["bits_for"] == [{"pattern": "x", "bits": 8}]
    assert override["options"]["quantize"]["nodes"] == replay["options"]["quantize"]["nodes"]


def test_unknown_node_names_are_a_warning(tmp_path: Path) -> None:
    settings = tmp_path / "s.json"
    settings.write_text(json.dumps({"config_version": 1, "nodes": {"no_such_node": {"bits": 8}}}))
    code, data, _ = _json("quantize", ENCODER, tmp_path / "q.onnx", "--config", settings)
    assert code == 0
    assert any("no_such_node" in w for w in data["warnings"])


# ---- real inputs ---------------------------------------------------------------------------------


def test_quantize_with_real_inputs(tmp_path: Path) -> None:
    first, second = _save_feeds(tmp_path)
    code, data, _ = _json("quantize", ENCODER, tmp_path / "q.onnx", "--inputs", first, "--inputs", second)
    assert code == 0
    verification = data["verification"]
    assert verification["input_files"] == [
        {"file": str(first), "shapes": {"audio_signal": [1, 32, 50], "length": [1]}},
        {"file": str(second), "shapes": {"audio_signal": [2, 32, 72], "length": [2]}},
    ]
    assert verification["options"]["feeds"] == [str(first), str(second)]
    assert verification["lengths"]["used"] == [1, 2]
    shapes = [r["shape"] for r in verification["results"] if r["output"] == "outputs"]
    assert shapes == [[1, 64, 7], [2, 64, 9]]
    # A directory stands for its .npz files, in name order; the console says which were used.
    code, _, stderr = _invoke("quantize", ENCODER, tmp_path / "q2.onnx", "--inputs", tmp_path)
    assert code == 0 and "utt0.npz" in stderr and "utt1.npz" in stderr and "audio_signal 2x32x72" in stderr


def test_verify_with_real_inputs(tmp_path: Path) -> None:
    [first, _] = _save_feeds(tmp_path)
    code, stdout, stderr = _invoke("verify", ENCODER, ENCODER, "--inputs", first, "--report-json-stdout")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert [f["file"] for f in data["verification"]["input_files"]] == [str(first)]
    assert all(r["max_abs"] == 0 for r in data["verification"]["results"])


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"audio_signal": np.zeros((1, 32, 9), np.float32)}, "missing input 'length'"),
        (
            {
                "audio_signal": np.zeros((1, 32, 9), np.float32),
                "length": np.ones(1, np.int64),
                "x": np.ones(1),
            },
            "unknown input 'x'",
        ),
        ({"audio_signal": np.zeros((1, 32, 9), np.float64), "length": np.ones(1, np.int64)}, "is float64"),
        ({"audio_signal": np.zeros((32, 9), np.float32), "length": np.ones(1, np.int64)}, "rank 2"),
        ({"audio_signal": np.zeros((1, 31, 9), np.float32), "length": np.ones(1, np.int64)}, "31 on axis 1"),
    ],
    ids=["missing", "unknown", "dtype", "rank", "static-dim"],
)
def test_inputs_that_do_not_fit_the_model(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    path = _npz(tmp_path / "bad.npz", **arrays)
    gptq = ["quantize", ENCODER, tmp_path / "q.onnx", "--algorithm", "gptq"]  # checked before calibrating
    for command in (["quantize", ENCODER, tmp_path / "q.onnx"], gptq, ["verify", ENCODER, ENCODER]):
        code, _, stderr = _invoke(*command, "--inputs", path)
        assert code == 2 and message in stderr and "bad.npz" in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.onnx").exists()


def test_unreadable_inputs(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "one.npy", np.zeros(3))
    pickled = tmp_path / "obj.npz"
    np.savez(pickled, a=np.array([{"x": 1}], dtype=object))
    cases = [
        (tmp_path / "nope.npz", "inputs file not found"),
        (tmp_path / "empty", "no .npz files"),
        (tmp_path / "text.npz", "cannot read inputs file"),
        (tmp_path / "one.npy", "single .npy array"),
        (pickled, "cannot read inputs file"),
    ]
    for path, message in cases:
        with pytest.raises(InputError, match=message):
            load_inputs([path])
        code, _, stderr = _invoke("quantize", ENCODER, tmp_path / "q.onnx", "--inputs", path)
        assert code == 2 and message in stderr, stderr
    code, _, stderr = _invoke(
        "quantize",
        ENCODER,
        tmp_path / "q.onnx",
        "--inputs",
        _save_feeds(tmp_path)[0],
        "--verify-lengths",
        "8",
    )
    assert code == 2 and "real inputs cannot be combined with lengths" in stderr


def test_feeds_in_the_library() -> None:
    """Feeds made in memory are named by their number; the options compare without the arrays."""
    feed = {"x": np.zeros(2, np.float32)}
    options = VerifyOptions(feeds=(feed,))
    assert options.to_dict()["feeds"] == ["feed 1"]
    assert options == VerifyOptions(feeds=({"x": np.ones(2, np.float32)},))
    with pytest.raises(ValueError, match="at least one"):
        VerifyOptions(feeds=())


# ---- metadata ------------------------------------------------------------------------------------


@pytest.mark.parametrize("int8", [False, True], ids=["matmulnbits", "int8-dynamic"])
def test_quantize_keeps_metadata_doc_string_and_producer(tmp_path: Path, int8: bool) -> None:
    model = onnx.load(ENCODER)
    model.doc_string = "an encoder"
    model.producer_name, model.producer_version = "exporter", "1.2.3"
    onnx.helper.set_model_props(model, {"vocab_size": "1025", "subsampling_factor": "8"})
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    out = tmp_path / "q.onnx"
    code, _, stderr = _invoke("quantize", src, out, *(["--int8-dynamic"] if int8 else []), "-q")
    assert code == 0, stderr
    result = onnx.load(out)
    assert result.doc_string == "an encoder"
    assert (result.producer_name, result.producer_version) == ("exporter", "1.2.3")
    assert {p.key: p.value for p in result.metadata_props} == {
        "vocab_size": "1025",
        "subsampling_factor": "8",
    }


def test_algorithms_on_the_command_line(tmp_path: Path) -> None:
    """gptq takes --inputs as calibration data; k_quant names the nodes onnxruntime cannot take."""
    _save_feeds(tmp_path)
    # With the front end's two 16x16 pointwise convs rewritten too.
    gptq = [
        "--algorithm",
        "gptq",
        "--inputs",
        tmp_path,
        "--symmetric",
        "--block-size",
        "16",
        "--allow-added-transposes",
    ]
    code, data, _ = _json("quantize", ENCODER, tmp_path / "g.onnx", *gptq)
    assert code == 0
    assert data["options"]["quantize"]["algorithm"] == "gptq" and data["quantized_nodes"] == 25
    assert min(r["cosine"] for r in data["verification"]["results"] if r["cosine"] is not None) > 0.99
    k_quant = ["--algorithm", "k_quant", "--block-size", "16", "--allow-added-transposes"]
    code, data, _ = _json("quantize", ENCODER, tmp_path / "k.onnx", *k_quant)
    assert code == 0 and data["quantized_nodes"] == 23
    assert any("node_conv2d_2/MatMul" in w and "even number of blocks" in w for w in data["warnings"])
    code, _, stderr = _invoke("quantize", ENCODER, tmp_path / "x.onnx", "--algorithm", "gptq")
    assert code == 2 and "needs calibration inputs (--inputs FILE.npz gives them)" in stderr
    code, _, stderr = _invoke(
        "quantize", ENCODER, tmp_path / "x.onnx", "--algorithm", "k_quant", "--symmetric"
    )
    assert code == 2 and "always stores zero points" in stderr


# resolve(): the one place quantize options are decided (the command line only maps flags to it).


def test_resolve_takes_the_defaults_then_the_file_then_what_is_given(tmp_path: Path) -> None:
    from onnx_conv2matmul.quantize.options import resolve

    assert resolve().quantize == QuantizeOptions()
    config = tmp_path / "s.json"
    config.write_text(json.dumps(QuantizeOptions(bits=8, block_size=32, exclude=("a*",)).to_config()))
    got = resolve({"block_size": 128}, config=str(config)).quantize
    assert (got.bits, got.block_size, got.exclude) == (8, 128, ("a*",))
    assert resolve({"exclude": ("b*",)}, config=str(config)).quantize.exclude == ("b*",)


@pytest.mark.parametrize(
    ("given", "settings_file", "auto", "int8", "expected"),
    [
        (None, False, False, False, True),
        ({"bits": 8}, False, False, False, False),
        (None, True, False, False, False),
        (None, False, True, False, False),
        (None, False, False, True, False),
    ],
    ids=["defaults", "a-setting", "a-settings-file", "auto", "int8-dynamic"],
)
def test_search_below_defaults_alike_from_the_command_line_and_the_api(
    tmp_path: Path, given: dict[str, Any] | None, settings_file: bool, auto: bool, int8: bool, expected: bool
) -> None:
    """Whether a result below the criterion makes the search run, when not said: the command line's
    resolve and the plan of an API call (settings given as options, or None) decide it alike."""
    from helpers import matmul_model
    from onnx_conv2matmul.quantize import plan
    from onnx_conv2matmul.quantize.options import resolve

    config = None
    if settings_file:
        config = tmp_path / "s.json"
        config.write_text(json.dumps(QuantizeOptions().to_config()))
    resolved = resolve(given, config=None if config is None else str(config), auto=auto, int8_dynamic=int8)
    assert resolved.search_below is expected
    src = tmp_path / "m.onnx"
    onnx.save(matmul_model(), src)
    settings = resolved.quantize if given or settings_file else None
    request = plan.Request(quantize=settings, int8=int8, auto=resolved.auto)
    assert plan.resolve(src, tmp_path / "q.onnx", request).search_below is expected


def test_resolve_auto_without_min_cosine_leaves_the_target_to_the_floor() -> None:
    """--auto alone searches at the workflow's floor: resolve leaves min_cosine unset."""
    from onnx_conv2matmul.quantize.options import resolve

    resolved = resolve(None, auto=True)
    assert resolved.auto is not None and resolved.auto.min_cosine is None and resolved.auto.metric is None


@pytest.mark.parametrize(
    ("kwargs", "template", "options"),
    [
        ({"save_config": True}, "{0} needs {1}", ("save_config", "auto")),
        ({"max_evaluations": 3}, "{0} needs {1}", ("max_evaluations", "auto")),
        ({"auto": True, "min_cosine": 0.9, "int8_dynamic": True}, None, ("auto", "int8_dynamic")),
        ({"auto": True, "min_cosine": 0.9, "given": {"bits_for": (("*", 8),)}}, None, ("auto", "bits_for")),
        ({"auto": True, "min_cosine": 0.9, "given": {"algorithm": "k_quant"}}, None, ("auto", "algorithm")),
        ({"int8_dynamic": True, "given": {"block_size": 64}}, None, ("block_size", "int8_dynamic")),
        (
            {"int8_dynamic": True, "given": {"other_weights": "int8"}},
            None,
            ("other_weights_int8", "int8_dynamic"),
        ),
    ],
)
def test_resolve_names_the_conflicting_options_by_field(
    kwargs: dict[str, Any], template: str | None, options: tuple[str, ...]
) -> None:
    from onnx_conv2matmul.errors import OptionConflict
    from onnx_conv2matmul.quantize.options import resolve

    kwargs = dict(kwargs)  # the parameters are shared by every run of the test in this process
    given = kwargs.pop("given", None)
    with pytest.raises(OptionConflict) as info:
        resolve(given, **kwargs)
    assert info.value.options == options
    assert template is None or info.value.template == template
    assert "--" not in str(info.value)  # the library names fields, never flags


def test_resolve_builds_the_search_options() -> None:
    from onnx_conv2matmul.quantize.options import resolve

    got = resolve({"exclude": ("x",), "other_weights": "keep"}, auto=True, min_cosine=0.99, max_evaluations=3)
    assert got.auto is not None
    assert (got.auto.min_cosine, got.auto.max_evaluations, got.auto.exclude) == (0.99, 3, ("x",))
    assert got.auto.other_weights is False
    assert resolve(auto=True, min_cosine=0.99).auto.other_weights is None  # type: ignore[union-attr]
    assert resolve({"bits": 8}, int8_dynamic=False).auto is None
