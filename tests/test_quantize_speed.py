"""quantize with timing (the default), and the bench command: what is tried, what is kept, what is
reported. Which candidate wins depends on this CPU, so these tests check that the report, the
options that replay the run and the written model agree with each other, never a time; the
choice itself is tested with a fake timer in test_speed_choose.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import onnx
import pytest
from click.testing import CliRunner

from helpers import all_nodes
from onnx_conv2matmul.cli.app import main
from onnx_conv2matmul.errors import OptionConflict
from onnx_conv2matmul.quantize.options import resolve
from onnx_conv2matmul.speed.choose import DEFAULT_BLOCK_SIZES, DEFAULT_LEVELS

DATA = Path(__file__).parent / "data"
ENCODER = DATA / "conformer_small.onnx"
DECODER = DATA / "tdt_decoder_small.onnx"
SCHEMA = json.loads((Path(__file__).parent.parent / "schema" / "report.schema.json").read_text())
FAST = ("--bench-rounds", "3", "--bench-lengths", "40,120", "--verify-lengths", "64,97")


def _run(*args: object) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(
        main, [str(a) for a in args] + ["--report-json-stdout"], catch_exceptions=False
    )
    data = json.loads(result.stdout)
    jsonschema.validate(data, SCHEMA)
    return result.exit_code, data, result.stderr


def _nbits(path: Path) -> set[tuple[int, int]]:
    """(block size, accuracy level) of every MatMulNBits node."""
    model = onnx.load(path, load_external_data=False)
    found = set()
    for node in all_nodes(model.graph):
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            found.add((attrs["block_size"], attrs.get("accuracy_level", 0)))
    return found


def test_quantize_keeps_the_winner_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    code, data, stderr = _run("quantize", ENCODER, out, "--bench", "full", *FAST)
    assert code == 0, stderr
    choice = data["kernel_choice"]
    names = [c["name"] for c in choice["candidates"]]
    assert names == [
        f"block {b}, accuracy level {lvl}" for b in DEFAULT_BLOCK_SIZES for lvl in DEFAULT_LEVELS
    ]
    winner = next(c for c in choice["candidates"] if c["name"] == choice["winner"])
    assert winner["meets_target"] and winner["latencies"] is not None
    # the written model, the replayable options and the quantizer's record agree with the winner
    assert _nbits(out) == {(winner["block_size"], winner["accuracy_level"])}
    settings = data["options"]["quantize"]
    assert (settings["block_size"], settings["accuracy_level"]) == (
        winner["block_size"],
        winner["accuracy_level"],
    )
    assert {q["block_size"] for q in data["quantized"]} == {winner["block_size"]}
    assert data["files"]["output_bytes"] == out.stat().st_size
    # the latency section is the original and the winner, at the lengths asked
    latency = data["latency"]
    assert latency["lengths"]["used"] == [40, 120] and latency["options"]["rounds"] == 3
    assert [lat["ratio"] for lat in latency["result"]] == [lat["ratio"] for lat in winner["latencies"]]
    assert all(lat["ratio"] is None for lat in latency["original"])
    # a warning for each length measurably slower: the ratio's whole 95% interval above 1
    slower = [lat for lat in latency["result"] if (lat["ratio_interval"] or [lat["ratio"]])[0] > 1]
    assert len([w for w in data["warnings"] if "slower than the original" in w]) == len(slower)
    assert data["options"]["speed"]["block_sizes"] == list(DEFAULT_BLOCK_SIZES)
    assert "Kernel settings tried" in stderr and "Chosen:" in stderr and "Latency" in stderr
    assert sorted(os.listdir(tmp_path)) == ["q.onnx"], "candidates and staging removed"
    # the options replay the run: pinned, nothing is chosen again
    config = tmp_path / "settings.json"
    config.write_text(json.dumps(settings))
    code, again, stderr = _run("quantize", ENCODER, tmp_path / "again.onnx", "--config", config, *FAST)
    assert code == 0, stderr
    assert again["kernel_choice"] is None and again["latency"] is not None
    assert _nbits(tmp_path / "again.onnx") == _nbits(out)


def test_default_chooses_from_kernel_costs_and_quantizes_once(
    tmp_path: Path, kernel_cost_cache: Path, quiet_machine: None
) -> None:
    """--bench shapes (the default): the block size and level come from the kernels' costs at the
    model's weight shapes, the written model has them, the result is timed once against the
    original, and a second run reads every cost from this CPU's cache file."""
    out = tmp_path / "q.onnx"
    code, data, stderr = _run("quantize", ENCODER, out, *FAST)
    assert code == 0, stderr
    costs = data["kernel_costs"]
    assert costs is not None and costs["lengths"] == [40, 120]
    # Every block size is costed but those whose weights take more bytes than block 64's (a block
    # pads K), which the reason names.
    blocks = sorted({c["block_size"] for c in costs["candidates"]})
    assert blocks[0] == 64 and set(blocks) <= set(DEFAULT_BLOCK_SIZES)
    assert [(c["block_size"], c["accuracy_level"]) for c in costs["candidates"]] == [
        (b, lvl) for b in blocks for lvl in DEFAULT_LEVELS
    ]
    for left in set(DEFAULT_BLOCK_SIZES) - set(blocks):
        assert f"block {left} (" in costs["reason"] and "more bytes" in costs["reason"]
    winner = costs["candidates"][costs["winner"]]
    level = winner["accuracy_level"]
    if data["kernel_choice"] is not None:  # measured slower than the original: the other level tried
        assert any("other accuracy levels were checked and timed" in w for w in data["warnings"])
        level = data["kernel_choice"]["accuracy_level"]
    assert _nbits(out) == {(winner["block_size"], level)}
    settings = data["options"]["quantize"]
    assert (settings["block_size"], settings["accuracy_level"]) == (winner["block_size"], level)
    assert data["options"]["speed"]["mode"] == "shapes" and data["latency"] is not None
    assert costs["measured"] > 0 and costs["layers"] > costs["shapes"] > 0
    assert costs["cache"] is not None and Path(costs["cache"]).is_relative_to(kernel_cost_cache)
    assert Path(costs["cache"]).is_file()
    assert sorted(os.listdir(tmp_path)) == ["q.onnx"]
    assert "Kernel choice from per-shape costs" in stderr and "time by phase" in stderr
    assert {"rewrite", "kernel choice", "quantize", "check", "timing"} <= set(data["seconds_by_phase"])
    code, again, stderr = _run("quantize", ENCODER, tmp_path / "again.onnx", *FAST)
    assert code == 0, stderr
    assert again["kernel_costs"]["measured"] == 0 and again["kernel_costs"]["from_cache"] > 0
    code, fresh, stderr = _run("quantize", ENCODER, tmp_path / "fresh.onnx", "--no-bench-cache", *FAST)
    assert code == 0, stderr
    # Measured again where the warm run measured nothing (not as many as the first run: the cache
    # folder is the test session's, so earlier tests may have timed some of these shapes).
    assert fresh["kernel_costs"]["measured"] > 0 and fresh["options"]["speed"]["cache"] is False


def test_bench_mode_needs_the_bench(tmp_path: Path) -> None:
    for flag in (("--bench", "full"), ("--no-bench-cache",)):
        result = CliRunner().invoke(
            main, ["quantize", str(ENCODER), str(tmp_path / "q.onnx"), "--no-bench", *flag]
        )
        assert result.exit_code == 2 and "does not combine with --no-bench" in result.stderr
    assert not os.listdir(tmp_path)


def test_a_target_no_candidate_meets_fails_as_without_timing(tmp_path: Path) -> None:
    """Settings given (--bits 4): below the criterion nothing is written (with the default
    settings the search would run instead)."""
    code, data, _ = _run(
        "quantize",
        ENCODER,
        tmp_path / "q.onnx",
        "--bits",
        "4",
        "--min-cosine",
        "0.99999",
        "--bench",
        "full",
        *FAST,
    )
    assert code == 1 and data["output"] is None
    choice = data["kernel_choice"]
    assert not any(c["meets_target"] for c in choice["candidates"])
    assert any("no candidate meets" in w for w in data["warnings"])
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    ("flags", "candidates"),
    [
        (("--accuracy-level", "4"), [f"block {b}, accuracy level 4" for b in DEFAULT_BLOCK_SIZES]),
        (("--block-size", "32"), ["accuracy level 0", "accuracy level 4"]),
        (("--block-size", "32", "--accuracy-level", "4"), None),
    ],
)
def test_given_settings_are_pinned(
    tmp_path: Path, flags: tuple[str, ...], candidates: list[str] | None
) -> None:
    out = tmp_path / "q.onnx"
    code, data, stderr = _run("quantize", ENCODER, out, *flags, "--bench", "full", *FAST)
    assert code == 0, stderr
    choice = data["kernel_choice"]
    assert (None if choice is None else [c["name"] for c in choice["candidates"]]) == candidates
    assert data["latency"] is not None
    if "--block-size" in flags:
        assert {block for block, _ in _nbits(out)} == {32}
    if "--accuracy-level" in flags:
        assert {level for _, level in _nbits(out)} == {4}


def test_auto_chooses_the_level_only(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    code, data, stderr = _run(
        "quantize",
        ENCODER,
        out,
        "--auto",
        "--min-cosine",
        "0.99",
        "--max-evaluations",
        "2",
        "--bench",
        "full",
        *FAST,
    )
    assert code == 0, stderr
    assert [c["name"] for c in data["kernel_choice"]["candidates"]] == [
        "accuracy level 0",
        "accuracy level 4",
    ]
    assert {level for _, level in _nbits(out)} == {data["kernel_choice"]["accuracy_level"]}
    assert data["options"]["quantize"]["accuracy_level"] == data["kernel_choice"]["accuracy_level"]


def test_int8_dynamic_is_timed_only(tmp_path: Path) -> None:
    code, data, stderr = _run("quantize", DECODER, tmp_path / "d.onnx", "--int8-dynamic", *FAST)
    assert code == 0, stderr
    assert data["kernel_choice"] is None and len(data["latency"]["result"]) == 2


def test_no_bench(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    code, data, stderr = _run("quantize", ENCODER, out, "--no-bench", "--verify-lengths", "64")
    assert code == 0, stderr
    assert data["latency"] is None and data["kernel_choice"] is None and data["options"]["speed"] is None
    assert _nbits(out) == {(64, 0)}
    assert "Latency" not in stderr
    code, data, stderr = _run("quantize", ENCODER, tmp_path / "x.onnx", "--no-bench", "--bench-lengths", "8")
    assert code == 2 and data["error"] == "--bench-lengths does not combine with --no-bench"


def test_resolve_pins_what_was_given(tmp_path: Path) -> None:
    speed = resolve({}).speed
    assert speed is not None and speed.levels == DEFAULT_LEVELS and speed.block_sizes == DEFAULT_BLOCK_SIZES
    assert resolve({"accuracy_level": 2}).speed.levels == (2,)  # type: ignore[union-attr]
    assert resolve({"block_size": 128}).speed.block_sizes == (128,)  # type: ignore[union-attr]
    assert resolve({"algorithm": "k_quant"}).speed.block_sizes == (64,)  # type: ignore[union-attr]
    assert not resolve({}, int8_dynamic=True).speed.chooses  # type: ignore[union-attr]
    auto = resolve({}, auto=True, min_cosine=0.9).speed
    assert auto is not None and auto.block_sizes == (64,) and auto.levels == DEFAULT_LEVELS
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"config_version": 1, "accuracy_level": 4}))
    assert resolve({}, config=str(config)).speed.levels == (4,)  # type: ignore[union-attr]
    assert resolve({}, bench=False).speed is None
    assert resolve({}, bench_lengths=(5, 9), bench_rounds=4).speed.timing.lengths == (5, 9)  # type: ignore[union-attr]
    with pytest.raises(OptionConflict, match="bench_rounds does not combine with no_bench"):
        resolve({}, bench=False, bench_rounds=4)


def test_bench_command(tmp_path: Path) -> None:
    quantized = tmp_path / "q.onnx"
    code, _, stderr = _run("quantize", ENCODER, quantized, "--no-bench", "--verify-lengths", "64")
    assert code == 0, stderr
    code, data, stderr = _run("bench", ENCODER, quantized, "--bench-lengths", "40,120", "--bench-rounds", "3")
    assert code == 0, stderr
    assert data["command"] == "bench" and data["inputs"] == [str(ENCODER), str(quantized)]
    assert [m["quantization"]["kind"] for m in data["models"]] == ["float", "int4"]
    assert data["lengths"]["used"] == [40, 120] and data["baseline"] == 0
    slower = [lat for lat in data["models"][1]["latencies"] if lat["ratio"] > 1]
    assert len(data["warnings"]) == (1 if slower else 0)
    assert "Latency on" in stderr
    code, data, _ = _run(
        "bench", ENCODER, quantized, "--baseline", "2", "--bench-lengths", "40", "--bench-rounds", "3"
    )
    assert code == 0 and data["baseline"] == 1 and data["models"][0]["latencies"][0]["ratio"] is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--baseline", "3"), "3 is above the number of models (1)"),
        (("--verify-lengths", "64"), "bench times batch 1 at --bench-lengths"),
        (("--bench-rounds", "2"), "--bench-rounds"),
        (("--verify-dim", "nope=3"), "unknown dim 'nope'"),
    ],
)
def test_bench_refuses(args: tuple[str, ...], message: str) -> None:
    code, data, _ = _run("bench", ENCODER, *args)
    assert code == 2 and message in data["error"]


def test_bench_of_a_missing_model(tmp_path: Path) -> None:
    code, data, _ = _run("bench", tmp_path / "missing.onnx")
    assert code == 2 and data["inputs"] == [str(tmp_path / "missing.onnx")]


def test_only_a_measurably_slower_result_is_warned_about() -> None:
    """The warning needs the ratio's whole 95% interval above 1; noise around 1 is only shown."""
    from onnx_conv2matmul.quantize.kernel import measurably_slower
    from onnx_conv2matmul.speed.timing import Latency

    def lat(ratio: float | None, low: float | None) -> Latency:
        return Latency(length=100, samples_ms=(1.0, 1.0, 1.0), ratio=ratio, ratio_low=low)

    assert measurably_slower(lat(1.2, 1.05))
    assert not measurably_slower(lat(1.01, 0.97))
    assert not measurably_slower(lat(0.6, 0.5))
    assert not measurably_slower(lat(None, None))
    assert measurably_slower(lat(1.1, None))


def test_auto_is_offered_every_setting_and_the_fallback_search_what_is_not_slower(tmp_path: Path) -> None:
    """--auto asks for the smallest model: its search gets no speed filter (a small CNN whose
    layers all ran faster in float came out at 0.95x fp32 instead of 0.73x) and no kernel setting
    chosen for speed. The search that runs
    because the default settings fell below the floor keeps the filter. Only which search got a
    filter is asserted, never what the timings were."""
    code, data, stderr = _run(
        "quantize",
        ENCODER,
        tmp_path / "a.onnx",
        "--auto",
        "--min-cosine",
        "0.99",
        "--max-evaluations",
        "2",
        *FAST,
    )
    assert code == 0, stderr
    # Nor are its block size and accuracy level chosen for speed (level 4 quantizes the
    # activations too: PP-OCRv4's detector came out at 1.00x with it, 0.435x without).
    assert data["kernel_costs"] is None
    code, data, stderr = _run("quantize", ENCODER, tmp_path / "b.onnx", "--min-cosine", "0.9999", *FAST)
    assert code == 0, stderr
    assert data["accuracy"].get("fallback") is not None  # the defaults fell below: the search ran
    assert data["kernel_costs"]["search"] is not None


@pytest.mark.parametrize("bench", ["shapes", "full"])
def test_the_levels_of_a_searched_result_are_timed_at_one_short_length_unless_full(
    tmp_path: Path, bench: str
) -> None:
    """``--auto``'s result has its accuracy levels checked and timed; by default (``--bench
    shapes``) at the shortest of the default lengths, 5 rounds at most, as the default latency line
    is (on the Parakeet-shaped encoder its two levels at 200 and 1000 frames took 172 s of a 585 s
    run, and a default candidate measured slower retried its levels there for 204 s); ``--bench
    full`` keeps the full table."""
    code, data, stderr = _run(
        "quantize", ENCODER, tmp_path / "q.onnx", "--auto", "--max-evaluations", "2", "--bench", bench,
        "--verify-lengths", "64,97",
    )  # fmt: skip
    assert code == 0, stderr
    assert [c["name"] for c in data["kernel_choice"]["candidates"]] == [
        "accuracy level 0",
        "accuracy level 4",
    ]
    latency = data["latency"]
    if bench == "shapes":
        assert latency["lengths"]["used"] == [200] and latency["options"]["rounds"] == 5
        assert latency["lengths"]["rule"].startswith("the shortest of the timing's default lengths")
    else:
        assert latency["lengths"]["used"] == [200, 1000] and latency["options"]["rounds"] == 10
