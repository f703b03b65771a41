"""Tests written to kill mutants of the quantize options that survived (docs/mutation.md):
``quantize/settings.py``, ``quantize/search_options.py`` and ``resolve()`` in ``quantize/options.py``.

Each message is checked whole: it is the one line a user reads for a bad flag or settings file, and
the command line prints it as it is. No model is built or run: these are the options' own checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from onnx_conv2matmul.errors import InputError, OptionConflict
from onnx_conv2matmul.quantize.metric import DEFAULT_MAX_DROP
from onnx_conv2matmul.quantize.options import (
    CRITERIA,
    FLOAT,
    LADDER,
    AutoOptions,
    NodeSetting,
    QuantizeOptions,
    Resolved,
    Setting,
    config_fields,
    load_config,
    resolve,
    search_below_by_default,
)
from onnx_conv2matmul.quantize.search_options import OTHER_INT8
from onnx_conv2matmul.speed.choose import DEFAULT_BLOCK_SIZES, DEFAULT_LEVELS
from onnx_conv2matmul.speed.timing import DEFAULT_ROUNDS

SIZES = "16, 32, 64, 128 or 256"
KNOWN = (
    "bits, block_size, symmetric, accuracy_level, algorithm, bits_for, exclude, include, nodes, other_weights"
)
# A callable any process can import: resolve() only loads it, never calls it.
VALIDATE = "json:dumps"


def _refused(make: Any, message: str, error: type[Exception] = ValueError) -> None:
    with pytest.raises(error) as info:
        make()
    assert str(info.value) == message


# ---- settings.py: NodeSetting and QuantizeOptions ------------------------------------------------


def test_a_node_setting_defaults_and_dict() -> None:
    assert NodeSetting(8).to_dict() == {"bits": 8, "block_size": 64, "symmetric": False}
    assert NodeSetting(None, 16, True).to_dict() == {"bits": None, "block_size": 16, "symmetric": True}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, "bits must be 4 or 8 (or none for float), got 3"),
        ({"bits": True}, "bits must be 4 or 8 (or none for float), got True"),
        (
            {"bits": 4, "block_size": 48},
            f"block size must be a power of 2 that MatMulNBits supports ({SIZES}), got 48",
        ),
        (
            {"bits": 4, "block_size": True},
            f"block size must be a power of 2 that MatMulNBits supports ({SIZES}), got True",
        ),
        ({"bits": 4, "symmetric": 1}, "symmetric must be true or false, got 1"),
    ],
)
def test_a_node_setting_refuses(kwargs: dict[str, Any], message: str) -> None:
    _refused(lambda: NodeSetting(**kwargs), message)


def test_every_block_size_and_both_bits_are_taken() -> None:
    for size in (16, 32, 64, 128, 256):
        assert NodeSetting(8, size).block_size == size
        assert QuantizeOptions(bits=8, block_size=size).block_size == size


def test_the_defaults() -> None:
    options = QuantizeOptions()
    assert options.to_config() == {
        "config_version": 1,
        "bits": 4,
        "block_size": 64,
        "symmetric": False,
        "accuracy_level": 0,
        "algorithm": "default",
        "bits_for": [],
        "exclude": [],
        "include": [],
        "nodes": {},
        "other_weights": "keep",
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 2}, "bits must be 4 or 8, got 2"),
        ({"bits": True}, "bits must be 4 or 8, got True"),
        (
            {"block_size": 512},
            f"block size must be a power of 2 that MatMulNBits supports ({SIZES}), got 512",
        ),
        (
            {"block_size": True},
            f"block size must be a power of 2 that MatMulNBits supports ({SIZES}), got True",
        ),
        ({"accuracy_level": 5}, "accuracy level must be 0-4, got 5"),
        ({"accuracy_level": -1}, "accuracy level must be 0-4, got -1"),
        ({"bits_for": (("", 8),)}, "bits for a pattern must be 4 or 8, got =8"),
        ({"bits_for": (("a", 8), ("b", 2))}, "bits for a pattern must be 4 or 8, got b=2"),
        ({"bits_for": (("a", True),)}, "bits for a pattern must be 4 or 8, got a=True"),
        ({"nodes": {"n": 4}}, "the setting of node 'n' is not a NodeSetting"),
        ({"algorithm": "rtn"}, "algorithm must be one of default, k_quant, gptq, hqq, got 'rtn'"),
        ({"other_weights": "int4"}, "other weights must be keep or int8, got 'int4'"),
    ],
)
def test_options_refuse(kwargs: dict[str, Any], message: str) -> None:
    _refused(lambda: QuantizeOptions(**kwargs), message)


def test_the_edges_of_the_ranges_are_taken() -> None:
    for level in (0, 4):
        assert QuantizeOptions(accuracy_level=level).accuracy_level == level
    assert QuantizeOptions(bits=8, bits_for=(("a", 4), ("b", 8))).bits_for == (("a", 4), ("b", 8))
    for weights in ("keep", "int8"):
        assert QuantizeOptions(other_weights=weights).other_weights == weights
    for algorithm in ("default", "k_quant", "gptq", "hqq"):
        assert QuantizeOptions(algorithm=algorithm).algorithm == algorithm


@pytest.mark.parametrize("algorithm", ["k_quant", "hqq"])
def test_zero_point_algorithms_refuse_symmetric_settings(algorithm: str) -> None:
    stores = f"the {algorithm} algorithm always stores zero points"
    _refused(
        lambda: QuantizeOptions(algorithm=algorithm, symmetric=True), f"{stores}: the default is symmetric"
    )
    nodes = {"f": NodeSetting(None, symmetric=True), "a": NodeSetting(4), "b": NodeSetting(4, symmetric=True)}
    _refused(lambda: QuantizeOptions(algorithm=algorithm, nodes=nodes), f"{stores}: node 'b' is symmetric")
    # A node kept in float is not quantized: its symmetric flag means nothing.
    floated = QuantizeOptions(algorithm=algorithm, nodes={"f": NodeSetting(None, symmetric=True)})
    assert floated.nodes["f"].symmetric


@pytest.mark.parametrize("algorithm", ["gptq", "hqq"])
def test_four_bit_algorithms_refuse_eight_bits(algorithm: str) -> None:
    only = f"the {algorithm} algorithm gives 4 bits only"
    _refused(lambda: QuantizeOptions(algorithm=algorithm, bits=8), f"{only}: the default asks for 8")
    patterns = (("a*", 4), ("b*", 8))
    _refused(
        lambda: QuantizeOptions(algorithm=algorithm, bits_for=patterns), f"{only}: pattern 'b*' asks for 8"
    )
    nodes = {"f": NodeSetting(None), "a": NodeSetting(4), "b": NodeSetting(8)}
    _refused(lambda: QuantizeOptions(algorithm=algorithm, nodes=nodes), f"{only}: node 'b' asks for 8")
    assert QuantizeOptions(algorithm=algorithm, nodes={"f": NodeSetting(None)}).nodes["f"].bits is None


def test_other_algorithms_take_eight_bits_and_symmetric() -> None:
    assert QuantizeOptions(algorithm="k_quant", bits=8).bits == 8
    assert QuantizeOptions(algorithm="gptq", symmetric=True).symmetric
    assert QuantizeOptions(bits=8, symmetric=True, nodes={"a": NodeSetting(8, symmetric=True)}).symmetric


def test_a_node_outside_the_selection_keeps_the_block_and_symmetry() -> None:
    options = QuantizeOptions(bits=8, block_size=32, symmetric=True, exclude=("x*",), include=("a*", "x*"))
    assert options.setting_for("x1") == NodeSetting(None, 32, True)
    assert options.setting_for("b") == NodeSetting(None, 32, True)
    assert options.setting_for("a") == NodeSetting(8, 32, True)
    assert not options.selects("x1") and not options.selects("b") and options.selects("a1")
    assert QuantizeOptions().selects("anything")
    # Patterns are case sensitive, on every platform.
    assert QuantizeOptions(exclude=("A*",)).selects("a") and not QuantizeOptions(include=("A*",)).selects("a")
    assert QuantizeOptions(bits_for=(("A*", 8),)).setting_for("a").bits == 4


def test_the_settings_object_round_trips() -> None:
    options = QuantizeOptions(
        bits=8,
        block_size=128,
        symmetric=True,
        accuracy_level=4,
        exclude=("e",),
        include=("i", "e"),
        bits_for=(("p", 4),),
        nodes={"n": NodeSetting(None, 32)},
        other_weights="int8",
    )
    config = options.to_config()
    assert config == options.to_dict()
    assert config["bits_for"] == [{"pattern": "p", "bits": 4}]
    assert config["nodes"] == {"n": {"bits": None, "block_size": 32, "symmetric": False}}
    assert (config["exclude"], config["include"], config["other_weights"]) == (["e"], ["i", "e"], "int8")
    assert QuantizeOptions.from_config(json.loads(json.dumps(config))) == options


# ---- settings.py: the settings file ---------------------------------------------------------------


def _fields(**data: Any) -> dict[str, Any]:
    return config_fields({"config_version": 1, **data})


def test_only_the_keys_given_are_fields() -> None:
    assert _fields() == {}
    assert _fields(bits=8, exclude=["a"], include=[]) == {"bits": 8, "exclude": ("a",), "include": ()}
    assert _fields(bits_for=[{"pattern": "p", "bits": 8}, {"bits": 4, "pattern": "q"}]) == {
        "bits_for": (("p", 8), ("q", 4))
    }
    assert _fields(nodes={"n": {"bits": None}, "m": {"bits": 8, "block_size": 16, "symmetric": True}}) == {
        "nodes": {"n": NodeSetting(None), "m": NodeSetting(8, 16, True)}
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "the settings must be a JSON object"),
        ({}, "config_version must be 1, got None"),
        ({"config_version": 2}, "config_version must be 1, got 2"),
        ({"config_version": True}, "config_version must be 1, got True"),
        ({"config_version": 1, "zz": 1, "aa": 2}, f"unknown settings key 'aa' (known: {KNOWN})"),
        ({"config_version": 1, "bits": "4"}, "settings key 'bits' must be a JSON integer, got '4'"),
        ({"config_version": 1, "bits": True}, "settings key 'bits' must be a JSON integer, got True"),
        ({"config_version": 1, "symmetric": 1}, "settings key 'symmetric' must be a JSON boolean, got 1"),
        ({"config_version": 1, "algorithm": 1}, "settings key 'algorithm' must be a JSON string, got 1"),
        ({"config_version": 1, "exclude": "a"}, "settings key 'exclude' must be a JSON array, got 'a'"),
        ({"config_version": 1, "nodes": []}, "settings key 'nodes' must be a JSON object, got []"),
        ({"config_version": 1, "exclude": ["a", 1]}, "settings key 'exclude' must be a list of strings"),
        ({"config_version": 1, "include": [None]}, "settings key 'include' must be a list of strings"),
    ],
)
def test_a_bad_settings_object(data: Any, message: str) -> None:
    _refused(lambda: config_fields(data), message)


@pytest.mark.parametrize(
    "item",
    [
        ["p", 8],
        {"pattern": "p"},
        {"pattern": "p", "bits": 8, "block_size": 32},
        {"pattern": 1, "bits": 8},
        {"pattern": "p", "bits": "8"},
    ],
)
def test_a_bad_bits_for_entry(item: Any) -> None:
    message = f'each bits_for entry must be {{"pattern": "...", "bits": 4 or 8}}, got {item!r}'
    _refused(lambda: _fields(bits_for=[{"pattern": "ok", "bits": 4}, item]), message)


@pytest.mark.parametrize("value", [8, {"block_size": 32}, {"bits": 8, "group": 1}])
def test_a_bad_node_entry(value: Any) -> None:
    message = (
        "the setting of node 'n' must be an object with bits (4, 8 or null)"
        " and optionally block_size and symmetric"
    )
    _refused(lambda: _fields(nodes={"n": value}), message)


def test_a_node_entry_out_of_range_names_the_node() -> None:
    _refused(
        lambda: _fields(nodes={"n": {"bits": 2}}), "node 'n': bits must be 4 or 8 (or none for float), got 2"
    )


def test_load_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    missing = str(tmp_path / "none.json")
    _refused(
        lambda: load_config(missing),
        f"cannot read the settings file {missing}: No such file or directory",
        InputError,
    )
    _refused(
        lambda: load_config(str(tmp_path)),
        f"cannot read the settings file {tmp_path}: Is a directory",
        InputError,
    )
    path.write_bytes(b'{"config_version": 1, "exclude": ["\xff"]}')
    with pytest.raises(InputError, match=f"^the settings file {path} is not valid JSON: "):
        load_config(str(path))
    path.write_text("{")
    with pytest.raises(InputError, match=f"^the settings file {path} is not valid JSON: "):
        load_config(str(path))
    path.write_text("[" * 100_000 + "]" * 100_000)
    _refused(
        lambda: load_config(str(path)),
        f"the settings file {path} is nested too deeply to be a settings file",
        InputError,
    )
    # Each field is of its type, but the options refuse them together: refused before any work.
    path.write_text(json.dumps({"config_version": 1, "bits": 8, "algorithm": "gptq"}))
    _refused(
        lambda: load_config(str(path)),
        f"bad settings file {path}: the gptq algorithm gives 4 bits only: the default asks for 8",
        InputError,
    )
    path.write_text(json.dumps({"config_version": 1, "exclude": ["é"]}), encoding="utf-8")
    assert load_config(str(path)) == {"exclude": ("é",)}


# ---- search_options.py ------------------------------------------------------------------------------


def test_settings_the_search_chooses_from() -> None:
    assert (FLOAT.label, FLOAT.to_dict()) == ("float", {"bits": None})
    assert FLOAT.node_setting() == NodeSetting(None)
    eight = Setting(8, 32, True)
    assert eight.label == "int8 block 32 symmetric"
    assert eight.to_dict() == {"bits": 8, "block_size": 32, "symmetric": True}
    assert eight.node_setting() == NodeSetting(8, 32, True)
    assert Setting(4).label == "int4 block 64 asymmetric"
    assert (OTHER_INT8.bits, OTHER_INT8.block_size, OTHER_INT8.symmetric) == (8, 0, True)
    assert [s.label for s in LADDER[:3]] == [
        "int4 block 128 symmetric",
        "int4 block 128 asymmetric",
        "int4 block 64 symmetric",
    ]
    assert len(LADDER) == 12 and LADDER[-1] == Setting(8, 32, False)
    assert CRITERIA == (
        "predicted",
        "measured",
        "weight_error",
        "hawq",
        "mean_variance",
        "max_variance",
        "mean_magnitude",
    )


def test_auto_options() -> None:
    auto = AutoOptions()
    assert (auto.min_cosine, auto.max_evaluations, auto.ladder, auto.other_weights) == (None, 8, LADDER, None)
    assert (auto.accuracy_level, auto.exclude, auto.include, auto.metric) == (0, (), (), None)
    assert (auto.measure, auto.criterion, auto.speed_aware) == (None, None, False)
    assert AutoOptions(max_evaluations=2, criterion="hawq").criterion == "hawq"
    _refused(lambda: AutoOptions(criterion="best"), f"unknown criterion 'best'; one of {', '.join(CRITERIA)}")
    _refused(lambda: AutoOptions(max_evaluations=1), "the search needs at least 2 evaluations, got 1")
    _refused(
        lambda: AutoOptions(ladder=(Setting(4), FLOAT)),
        "the ladder holds quantized settings only (float is always a choice)",
    )
    picky = AutoOptions(exclude=("x*",), include=("a*", "x*"))
    assert picky.selects("a1") and not picky.selects("x1") and not picky.selects("b")


# ---- options.py: resolve() --------------------------------------------------------------------------


def _conflict(kwargs: dict[str, Any], template: str, *options: str) -> None:
    kwargs = dict(kwargs)
    given = kwargs.pop("given", None)
    with pytest.raises(OptionConflict) as info:
        resolve(given, **kwargs)
    assert (info.value.template, info.value.options) == (template, options)


def test_resolved_defaults() -> None:
    got = Resolved(QuantizeOptions())
    assert (got.int8_dynamic, got.auto, got.speed, got.metric, got.search_below) == (
        False,
        None,
        None,
        None,
        False,
    )


def test_search_below_only_for_the_defaults() -> None:
    assert search_below_by_default(settings_given=False, auto=False, int8_dynamic=False)
    for given, auto, int8 in ((True, False, False), (False, True, False), (False, False, True)):
        assert not search_below_by_default(settings_given=given, auto=auto, int8_dynamic=int8)
    assert resolve().search_below and resolve({}).search_below
    assert not resolve({"bits": 4}).search_below


def test_a_value_out_of_range_is_an_input_error() -> None:
    _refused(lambda: resolve({"bits": 3}), "bits must be 4 or 8, got 3", InputError)
    _refused(
        lambda: resolve(auto=True, max_evaluations=1),
        "the search needs at least 2 evaluations, got 1",
        InputError,
    )
    _refused(lambda: resolve(bench_rounds=2), "bench rounds must be at least 3, got 2", InputError)


@pytest.mark.parametrize(
    ("given", "option"),
    [
        ({"bits": 4}, "bits"),
        ({"block_size": 64}, "block_size"),
        ({"symmetric": False}, "symmetric"),
        ({"accuracy_level": 0}, "accuracy_level"),
        ({"symmetric": False, "bits": 4}, "bits"),
        ({"bits_for": (("a", 4),)}, "bits_for"),
        ({"algorithm": "k_quant"}, "algorithm"),
        ({"other_weights": "int8"}, "other_weights_int8"),
        ({"nodes": {"a": NodeSetting(4)}}, "nodes"),
        ({"nodes": {"a": NodeSetting(4)}, "algorithm": "k_quant"}, "algorithm"),
        ({"nodes": {"a": NodeSetting(4)}, "other_weights": "int8"}, "other_weights_int8"),
    ],
)
def test_int8_dynamic_refuses_every_matmulnbits_setting(given: dict[str, Any], option: str) -> None:
    _conflict(
        {"given": given, "int8_dynamic": True},
        "{0}: a MatMulNBits setting, which {1} would not apply",
        option,
        "int8_dynamic",
    )


def test_int8_dynamic_takes_the_rest() -> None:
    got = resolve({"exclude": ("a",), "other_weights": "keep"}, int8_dynamic=True)
    assert got.int8_dynamic and got.quantize.exclude == ("a",) and not got.search_below
    assert got.speed is not None and got.speed.levels == (0,) and got.speed.block_sizes == (64,)


def test_what_is_timed_and_tried() -> None:
    speed = resolve().speed
    assert speed is not None
    assert (speed.levels, speed.block_sizes, speed.mode, speed.cache) == (
        DEFAULT_LEVELS,
        DEFAULT_BLOCK_SIZES,
        "shapes",
        True,
    )
    assert (speed.timing.lengths, speed.timing.rounds) == (None, DEFAULT_ROUNDS)
    speed = resolve(bench_lengths=(16, 32), bench_rounds=5, bench_mode="full", bench_cache=False).speed
    assert speed is not None
    assert (speed.timing.lengths, speed.timing.rounds, speed.mode, speed.cache) == (
        (16, 32),
        5,
        "full",
        False,
    )
    for given in (
        {"block_size": 128},
        {"nodes": {"a": NodeSetting(4, 32)}},
        {"algorithm": "k_quant", "block_size": 32},
    ):
        pinned = resolve(given).speed
        assert pinned is not None and pinned.block_sizes == (given.get("block_size", 64),)
        assert pinned.levels == DEFAULT_LEVELS
    pinned = resolve({"algorithm": "k_quant"}).speed
    assert pinned is not None and pinned.block_sizes == (64,)
    pinned = resolve({"accuracy_level": 4}).speed
    assert pinned is not None and (pinned.levels, pinned.block_sizes) == ((4,), DEFAULT_BLOCK_SIZES)
    pinned = resolve(auto=True).speed
    assert pinned is not None and (pinned.levels, pinned.block_sizes) == (DEFAULT_LEVELS, (64,))


def test_a_settings_file_pins_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"config_version": 1, "block_size": 32, "accuracy_level": 1}))
    speed = resolve(config=str(path)).speed
    assert speed is not None and (speed.levels, speed.block_sizes) == ((1,), (32,))
    assert not resolve(config=str(path)).search_below
    path.write_text(json.dumps({"config_version": 1}))
    assert not resolve(config=str(path)).search_below


@pytest.mark.parametrize(
    ("kwargs", "template", "options"),
    [
        (
            {"bench": False, "bench_lengths": (8,)},
            "{0} does not combine with {1}",
            ("bench_lengths", "no_bench"),
        ),
        ({"bench": False, "bench_rounds": 5}, "{0} does not combine with {1}", ("bench_rounds", "no_bench")),
        ({"bench": False, "bench_mode": "full"}, "{0} does not combine with {1}", ("bench_mode", "no_bench")),
        (
            {"bench": False, "bench_cache": False},
            "{0} does not combine with {1}",
            ("no_bench_cache", "no_bench"),
        ),
        ({"save_config": True}, "{0} needs {1}", ("save_config", "auto")),
        ({"save_config": True, "max_evaluations": 3}, "{0} needs {1}", ("save_config", "auto")),
        ({"max_evaluations": 3}, "{0} needs {1}", ("max_evaluations", "auto")),
        (
            {"auto": True, "int8_dynamic": True},
            "{0} chooses MatMulNBits settings: it does not combine with {1}",
            ("auto", "int8_dynamic"),
        ),
        (
            {"auto": True, "config": "SETTINGS", "given": {"bits_for": (("a", 8),), "algorithm": "k_quant"}},
            "{0} chooses every node's setting (round-to-nearest): it does not combine with {1}",
            ("auto", "config"),
        ),
        (
            {"auto": True, "given": {"bits_for": (("a", 8),), "algorithm": "k_quant"}},
            "{0} chooses every node's setting (round-to-nearest): it does not combine with {1}",
            ("auto", "bits_for"),
        ),
        (
            {"auto": True, "given": {"algorithm": "k_quant"}},
            "{0} chooses every node's setting (round-to-nearest): it does not combine with {1}",
            ("auto", "algorithm"),
        ),
        ({"max_drop": 0.1}, "{0} needs {1}", ("max_drop", "validate")),
        (
            {"validate": VALIDATE, "int8_dynamic": True},
            "{0} needs MatMulNBits quantization: it does not combine with {1}",
            ("validate", "int8_dynamic"),
        ),
    ],
)
def test_conflicts(tmp_path: Path, kwargs: dict[str, Any], template: str, options: tuple[str, ...]) -> None:
    kwargs = dict(kwargs)
    if kwargs.get("config") == "SETTINGS":
        path = tmp_path / "s.json"
        path.write_text(json.dumps({"config_version": 1}))
        kwargs["config"] = str(path)
    _conflict(kwargs, template, *options)


def test_the_search_takes_the_options() -> None:
    got = resolve(
        {"accuracy_level": 4, "exclude": ("e",), "include": ("i",), "other_weights": "int8"},
        auto=True,
        min_cosine=0.95,
        validate=VALIDATE,
    )
    auto = got.auto
    assert auto is not None and got.metric is not None and got.int8_dynamic is False and not got.search_below
    assert got.quantize == QuantizeOptions(
        accuracy_level=4, exclude=("e",), include=("i",), other_weights="int8"
    )
    assert (auto.min_cosine, auto.max_evaluations, auto.other_weights) == (0.95, 8, True)
    assert (auto.accuracy_level, auto.exclude, auto.include, auto.metric) == (4, ("e",), ("i",), got.metric)
    assert resolve({"other_weights": "keep"}, auto=True).auto.other_weights is False  # type: ignore[union-attr]
    assert resolve(auto=True, max_evaluations=2).auto.max_evaluations == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("max_drop", "drop", "relative"),
    [
        (None, DEFAULT_MAX_DROP, False),
        (0.25, 0.25, False),
        (0, 0, False),
        (" 0.5 ", 0.5, False),
        ("2.5%", 0.025, True),
        (" 10 %", 0.1, True),
    ],
)
def test_the_metric_and_its_drop(max_drop: Any, drop: float, relative: bool) -> None:
    metric = resolve(validate=VALIDATE, max_drop=max_drop).metric
    assert metric is not None
    assert metric.max_drop == pytest.approx(drop)
    assert (metric.relative, metric.name) == (relative, VALIDATE)
    assert metric.validate("a") == json.dumps("a")  # type: ignore[comparison-overlap]


def test_a_bad_drop_names_the_option() -> None:
    with pytest.raises(OptionConflict) as info:
        resolve(validate=VALIDATE, max_drop="{a}")
    assert info.value.options == ("max_drop",)
    assert str(info.value) == "max_drop: expected a number or a percentage, got '{a}'"
    with pytest.raises(OptionConflict) as info:
        resolve(validate=VALIDATE, max_drop=-1.0)
    assert info.value.options == ("max_drop",)
    assert str(info.value) == "max_drop: the largest drop must be a finite number >= 0, got -1.0"
    with pytest.raises(OptionConflict) as info:
        resolve(validate=VALIDATE, max_drop="-5%")
    assert str(info.value) == "max_drop: the largest drop must be a finite number >= 0, got -0.05"


class _Drop(float):
    """A number whose repr has braces: the message of a refused drop keeps it as it is."""

    def __repr__(self) -> str:
        return "{-1}"


def test_a_refused_drop_is_shown_as_it_is() -> None:
    with pytest.raises(OptionConflict) as info:
        resolve(validate=VALIDATE, max_drop=_Drop(-1.0))
    assert str(info.value) == "max_drop: the largest drop must be a finite number >= 0, got {-1}"
