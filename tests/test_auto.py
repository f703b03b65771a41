"""quantize --auto: the smallest configuration that meets a minimum cosine similarity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from helpers import examples, no_bench, run
from onnx_conv2matmul.api import quantize_file
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.quantize import search as auto
from onnx_conv2matmul.quantize import workflow
from onnx_conv2matmul.quantize.options import LADDER, AutoOptions, QuantizeOptions, Setting
from onnx_conv2matmul.quantize.search import AutoConfig, block_dequantize, block_quantize
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.passes import rewrite_model
from onnx_conv2matmul.verify.check import VerifyOptions

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"
# Two short lengths keep each full-model evaluation cheap.
VERIFY = VerifyOptions(lengths=(64, 97))


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, no_bench(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("setting", [*LADDER, Setting(4, 16, False), Setting(8, 32, True)])
def test_block_dequantize_is_what_matmulnbits_computes(setting: Setting) -> None:
    """The sensitivity's dequantized weight equals MatMulNBits' own (A = identity), K padded."""
    k, n = 70, 24
    weight = np.random.default_rng(3).standard_normal((k, n)).astype(np.float32)
    packed, scales, zero_points = block_quantize(weight, setting)
    assert setting.bits is not None
    expected = block_dequantize(packed, scales, zero_points, setting.bits, k)
    inputs = ["a", "B", "S"] + ([] if zero_points is None else ["Z"])
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S")]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points.reshape(-1), "Z"))
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=setting.bits,
        block_size=setting.block_size,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [k, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    (got,) = run(model, {"a": np.eye(k, dtype=np.float32)})
    np.testing.assert_array_equal(got, expected)


def _auto(tmp_path: Path, name: str, min_cosine: float, **kwargs: object):  # type: ignore[no-untyped-def]
    return quantize_file(
        ENCODER,
        tmp_path / name,
        verify=VERIFY,
        auto=AutoOptions(min_cosine=min_cosine, **kwargs),  # type: ignore[arg-type]
    )


def test_search_meets_the_minimum_is_deterministic_and_replays(tmp_path: Path) -> None:
    """Twice the same choice; every synthesised input meets the minimum; the config replays
    to the same bytes; the result is smaller than int8 everywhere and mixes settings."""
    first = _auto(tmp_path, "a.onnx", 0.999)
    second = _auto(tmp_path, "b.onnx", 0.999)
    assert first.return_code == 0 and first.output_path is not None
    assert first.auto is not None and second.auto is not None
    assert first.auto.config == second.auto.config
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert first.verification is not None
    cosines = [r.cosine for r in first.verification.results if r.cosine is not None]
    assert len(cosines) == 2 and min(cosines) >= 0.999
    assert first.auto.reached_cosine >= 0.999
    assert 1 <= len(first.auto.evaluations) <= 8
    assert len({c.setting for c in first.auto.choices}) > 1

    # Replayed from its settings file (the report's options.quantize), the same bytes.
    config = first.auto.config.to_config()
    assert config == first.options["quantize"]
    replay = quantize_file(
        ENCODER,
        tmp_path / "c.onnx",
        verify=VERIFY,
        options=QuantizeOptions.from_config(json.loads(json.dumps(config))),
    )
    assert replay.return_code == 0 and replay.auto is None
    assert (tmp_path / "c.onnx").read_bytes() == (tmp_path / "a.onnx").read_bytes()

    int8 = quantize_file(ENCODER, tmp_path / "int8.onnx", verify=VERIFY, options=QuantizeOptions(bits=8))
    assert first.output_bytes < int8.output_bytes


def test_a_looser_minimum_gives_a_smaller_model(tmp_path: Path) -> None:
    loose = _auto(tmp_path, "loose.onnx", 0.99)
    tight = _auto(tmp_path, "tight.onnx", 0.9999)
    assert loose.auto is not None and tight.auto is not None
    assert loose.output_bytes < tight.output_bytes
    assert tight.auto.reached_cosine >= 0.9999


def test_unreachable_minimum_raises_after_trying_float(tmp_path: Path) -> None:
    """Above 1 no model qualifies: the search ends with the all-float evaluation and says so."""
    from onnx_conv2matmul.errors import TargetUnreachable, exit_code_for

    with pytest.raises(TargetUnreachable, match="not met even with every weight in float") as info:
        _auto(tmp_path, "q.onnx", 1.5, max_evaluations=3)
    assert exit_code_for(info.value) == 1
    assert not (tmp_path / "q.onnx").exists()


def test_cli_unreachable_exits_1_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate, float included, below the minimum: exit 1, one line, nothing written."""
    monkeypatch.setattr(auto.Reference, "worst_cosine", lambda *_args: (0.5, ""))
    monkeypatch.setattr(workflow, "_weighs_default", lambda plan: False)  # the search alone
    out = tmp_path / "q.onnx"
    code, stdout, stderr = _invoke(
        "quantize",
        str(ENCODER),
        str(out),
        "--auto",
        "--min-cosine",
        "0.99",
        "--verify-lengths",
        "64",
        "--max-evaluations",
        "2",
        "--report-json-stdout",
    )
    assert code == 1
    assert "not met even with every weight in float" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert json.loads(stdout)["return_code"] == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_auto_writes_config_and_report(tmp_path: Path) -> None:
    out, config, report = tmp_path / "q.onnx", tmp_path / "c.json", tmp_path / "r.json"
    code, _, stderr = _invoke(
        "quantize",
        str(ENCODER),
        str(out),
        "--auto",
        "--min-cosine",
        "0.995",
        "--verify-lengths",
        "64,97",
        "--save-config",
        str(config),
        "--report-json",
        str(report),
        "-q",
    )
    assert code == 0, stderr
    saved = json.loads(config.read_text())
    data = json.loads(report.read_text())
    assert saved == data["auto"]["config"]
    assert saved["config_version"] == 1 and saved["nodes"]
    assert data["auto"]["full_evaluations"] == len(data["auto"]["evaluations"]) <= 8
    assert data["verification"]["criterion"] == {"kind": "min_cosine", "min_cosine": 0.995, "labels": "auto"}
    assert len(data["auto"]["nodes"]) == len(saved["nodes"])
    assert data["options"]["quantize"] == saved

    # quantize --config replays it: the same bytes.
    replay = tmp_path / "replay.onnx"
    code, _, stderr = _invoke(
        "quantize", str(ENCODER), str(replay), "--config", str(config), "--verify-lengths", "64,97", "-q"
    )
    assert code == 0, stderr
    assert replay.read_bytes() == out.read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-drop", "0.1"], "--max-drop needs --validate"),
        (["--validate", "json:dumps", "--max-drop", "1 point"], "expected a number or a percentage"),
        (["--validate", "no_such_module_here:f"], "No module named 'no_such_module_here'"),
        (["--validate", "json:no_such_function"], "json has no no_such_function"),
        (["--validate", "json"], "package.module:function"),
        (["--validate", "json:dumps", "--int8-dynamic"], "does not combine with --int8-dynamic"),
        (["--save-config", "x.json"], "--save-config needs --auto"),
        (["--auto", "--min-cosine", "0.9", "--int8-dynamic"], "does not combine with --int8-dynamic"),
        (["--auto", "--min-cosine", "0.9", "--bits-for", "*=8"], "does not combine with --bits-for"),
        (["--auto", "--min-cosine", "0.9", "--algorithm", "k_quant"], "does not combine with --algorithm"),
    ],
)
def test_cli_auto_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    code, _, stderr = _invoke("quantize", str(ENCODER), str(tmp_path / "q.onnx"), *args)
    assert code == 2
    assert message in stderr


def test_cli_auto_refuses_one_file_for_the_settings_and_the_report(tmp_path: Path) -> None:
    """The report would overwrite the settings just written (or the other way round)."""
    both = tmp_path / "x.json"
    for other in (both, tmp_path / "." / "x.json"):
        code, _, stderr = _invoke(
            "quantize", str(ENCODER), str(tmp_path / "q.onnx"), "--auto", "--min-cosine", "0.9",
            "--save-config", str(both), "--report-json", str(other), "-q",
        )  # fmt: skip
        assert code == 2 and "--report-json and --save-config name the same file" in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_apply_leaves_unlisted_and_float_nodes_in_float() -> None:
    """apply() quantizes exactly the nodes its config gives bits; names with glob characters too."""
    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a"], name="mm[0]"),
        helper.make_node("MatMul", ["x", "W2"], ["b"], name="mm*"),
        helper.make_node("MatMul", ["x", "W3"], ["c"], name="mm?"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 32]) for n in "abc"],
        [numpy_helper.from_array(weight + i, f"W{i}") for i in (1, 2, 3)],
    )
    model = ir.serde.deserialize_model(helper.make_model(graph))
    config = AutoConfig({"mm[0]": Setting(4, 32, True), "mm*": Setting(None)})
    result, others = auto.apply(model, config)
    assert result.quantized == 1 and others is None
    kinds = {n.name: n.op_type for n in model.graph}
    assert kinds["mm*"] == "MatMul" and kinds["mm?"] == "MatMul"
    assert sum(op == "MatMulNBits" for op in kinds.values()) == 1


_LOSS = st.one_of(st.floats(0, 1e6), st.just(math.inf))


@settings(max_examples=examples(100))
@given(
    errors=st.lists(st.floats(0, 1), min_size=3, max_size=40),
    fail_loss=_LOSS,
    good_loss=st.one_of(st.none(), _LOSS),
    bisect=st.booleans(),
    data=st.data(),
)
def test_next_step_stays_inside_the_bracket(
    errors: list[float],
    fail_loss: float,
    good_loss: float | None,
    bisect: bool,
    data: st.DataObject,
) -> None:
    """Whatever the losses measured (infinite ones too), the next configuration lies strictly
    between the last failing and passing ones, so the search ends."""
    predicted = sorted(errors, reverse=True)  # errors fall as the index grows
    fail = data.draw(st.integers(0, len(predicted) - 3))
    good = data.draw(st.integers(fail + 2, len(predicted) - 1))
    step = auto._next_index(fail, good, fail_loss, good_loss, predicted.__getitem__, bisect=bisect)
    assert fail < step < good


def test_cli_auto_searches_on_given_inputs(tmp_path: Path) -> None:
    """With --inputs, the search and the check run on those files (one feed each), not on
    synthesised inputs."""
    rng = np.random.default_rng(5)
    files = []
    for frames in (70, 110):
        path = tmp_path / f"feed{frames}.npz"
        np.savez(
            path,
            audio_signal=rng.standard_normal((1, 32, frames)).astype(np.float32),
            length=np.array([frames], np.int64),
        )
        files.append(str(path))
    report = tmp_path / "r.json"
    code, _, stderr = _invoke(
        "quantize",
        str(ENCODER),
        str(tmp_path / "q.onnx"),
        "--auto",
        "--min-cosine",
        "0.995",
        *(arg for path in files for arg in ("--inputs", path)),
        "--report-json",
        str(report),
        "-q",
    )
    assert code == 0, stderr
    data = json.loads(report.read_text())
    assert data["auto"]["feeds"] == 2
    assert [f["file"] for f in data["verification"]["input_files"]] == files
    cosines = [r["cosine"] for r in data["verification"]["results"] if r["cosine"] is not None]
    assert len(cosines) == 2 and min(cosines) >= 0.995


def test_auto_is_never_bigger_than_the_default_run(tmp_path: Path) -> None:
    """--auto weighs its search's model against the default run's (issue 41, item 3), and its
    search builds nothing the default run's model already beats: with two evaluations at a
    minimum cosine of 0.999, both go to configurations predicted smaller than that model (before,
    the second was the all-float end), and what is written is at most its size."""
    args = ["--min-cosine", "0.999", "--no-bench"]
    auto_out, default_out = tmp_path / "auto.onnx", tmp_path / "default.onnx"
    searched = CliRunner().invoke(
        main,
        [
            "quantize",
            str(ENCODER),
            str(auto_out),
            "--auto",
            "--max-evaluations",
            "2",
            *args,
            "--report-json-stdout",
        ],
    )
    assert searched.exit_code == 0, searched.output
    default = CliRunner().invoke(main, ["quantize", str(ENCODER), str(default_out), *args])
    assert default.exit_code == 0, default.output
    assert auto_out.stat().st_size <= default_out.stat().st_size < 0.6 * ENCODER.stat().st_size
    report = json.loads(searched.stdout)
    assert report["auto"] is not None and 1 <= len(report["auto"]["evaluations"]) <= 2
    assert all(e["weight_bytes"] < default_out.stat().st_size for e in report["auto"]["evaluations"])
    assert all(e["tradeoff"] is not None for e in report["auto"]["evaluations"])  # never all-float
    assert report["verification"]["passed"] and not list(tmp_path.glob(".*"))  # no scratch left


def test_a_search_that_meets_nothing_leaves_the_default_runs_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate of the search below the minimum while the default run's one pass meets it:
    the default run's model is written, and the warning says the search found none."""
    monkeypatch.setattr(auto.Reference, "worst_cosine", lambda *_args: (0.5, ""))
    out, config = tmp_path / "q.onnx", tmp_path / "settings.json"
    code, stdout, _ = _invoke(
        "quantize", str(ENCODER), str(out), "--auto", "--verify-lengths", "64", "--max-evaluations", "2",
        "--save-config", str(config), "--report-json-stdout",
    )  # fmt: skip
    assert code == 0 and out.exists()
    report = json.loads(stdout)
    # --save-config writes the settings of the model written: the default run's.
    assert json.loads(config.read_text()) == report["options"]["quantize"] and report["auto"] is None
    monkeypatch.undo()
    replay = tmp_path / "replay.onnx"
    code, _, stderr = _invoke(
        "quantize", str(ENCODER), str(replay), "--config", str(config), "--no-bench", "-q"
    )
    assert code == 0, stderr
    assert replay.read_bytes() == out.read_bytes()
    assert any(
        "what the search found (no smaller model that meets it: 2 smaller configurations evaluated,"
        " none met it): it is kept" in w
        for w in report["warnings"]
    )
    assert report["verification"]["passed"] and report["one_pass"] is not None
    assert not list(tmp_path.glob(".*"))  # the search's scratch went with it


def test_a_ceiling_keeps_the_search_below_it(tmp_path: Path) -> None:
    """Given the size of a model that meets the target already, the search evaluates only
    configurations predicted smaller, never the all-float end: below the fp32 file's size it
    finds what it finds without one; a ceiling no configuration goes under builds nothing and
    says why."""
    from onnx_conv2matmul.files.paths import model_file_bytes
    from onnx_conv2matmul.quantize.search import NothingSmaller, search, synthesised_feeds

    model = ir.load(ENCODER)
    rewrite_model(model, ConvertOptions(extended=True, allow_non_unit_dilation=True))
    feeds = synthesised_feeds(str(ENCODER), VerifyOptions(lengths=(64,)))
    for folder in ("free", "under", "none"):
        (tmp_path / folder).mkdir()
    free = search(model, feeds, AutoOptions(min_cosine=0.999), str(tmp_path / "free"))
    ceiling = model_file_bytes(str(tmp_path / "free" / "fp32.onnx"))
    under = search(model, feeds, AutoOptions(min_cosine=0.999), str(tmp_path / "under"), ceiling=ceiling)
    assert under.config == free.config and under.reached_cosine >= 0.999
    assert under.evaluations and all(not math.isinf(e.tradeoff) for e in under.evaluations)
    with pytest.raises(NothingSmaller, match="every configuration takes more than 1 bytes"):
        search(model, feeds, AutoOptions(min_cosine=0.999), str(tmp_path / "none"), ceiling=1)
