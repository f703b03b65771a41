"""Quantize options, resolved and checked in one place.

:class:`QuantizeOptions` (MatMulNBits settings, per node), :class:`AutoOptions` (what ``--auto``
looks for) and :func:`resolve`, which turns what a user gave (settings by name, a settings file,
the mode) into checked options, refusing every combination that could not be applied as asked.
The command line maps its flags to :func:`resolve`'s arguments and decides nothing itself.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.errors import InputError, OptionConflict

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.speed.choose import SpeedOptions

# The block sizes onnxruntime's MatMulNBits quantizer (MlasQuantizeBlockwise) accepts.
BLOCK_SIZES = (16, 32, 64, 128, 256)


CONFIG_VERSION = 1
"""The version of the settings file format (:meth:`QuantizeOptions.to_config`)."""
OTHER_WEIGHTS = ("keep", "int8")
"""What happens to float weights MatMulNBits does not take: kept, or stored as int8."""


def _block_size_error(block_size: object) -> str:
    sizes = ", ".join(map(str, BLOCK_SIZES[:-1])) + f" or {BLOCK_SIZES[-1]}"
    return f"block size must be a power of 2 that MatMulNBits supports ({sizes}), got {block_size}"


@dataclasses.dataclass(frozen=True)
class NodeSetting:
    """How one MatMul is quantized.

    Attributes:
        bits: 4 or 8; None keeps the MatMul in float.
        block_size: One of :data:`BLOCK_SIZES`.
        symmetric: Symmetric quantization without zero points.
    """

    bits: int | None
    block_size: int = 64
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in (4, 8)):
            raise ValueError(f"bits must be 4 or 8 (or none for float), got {self.bits!r}")
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise ValueError(_block_size_error(self.block_size))
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be true or false, got {self.symmetric!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric}


@dataclasses.dataclass(frozen=True)
class QuantizeOptions:
    """MatMulNBits settings (onnxruntime's names in brackets).

    Each MatMul's setting (:meth:`setting_for`) is resolved in this order: the defaults
    (``bits``, ``block_size``, ``symmetric``); then ``bits_for``, whose last matching
    pattern sets the bits; ``exclude`` and ``include`` keep a node in float; last,
    ``nodes`` names a node's whole setting and overrides all of the above.

    Attributes:
        bits: 4 or 8 (``bits``).
        block_size: One of :data:`BLOCK_SIZES`, 16 to 256 (``block_size``).
        symmetric: Symmetric quantization without zero points (``is_symmetric``).
        accuracy_level: 0-4 (``accuracy_level``); 0 leaves the attribute out.
        exclude: Glob patterns of MatMul node names to leave in float.
        include: When given, only MatMul nodes matching one of these are quantized.
        bits_for: (glob pattern, 4 or 8) pairs: the bits of the nodes whose name matches;
            a later pattern wins over an earlier one.
        nodes: Exact MatMul node name to its setting; overrides everything else.
        algorithm: One of :data:`onnx_conv2matmul.quantize.weight_only.ALGORITHMS`: ``default``
            (onnxruntime's per-node round-to-nearest), ``k_quant``, ``gptq`` (needs
            calibration inputs) or ``hqq`` (needs torch). ``gptq`` and ``hqq`` give
            4 bits only; ``k_quant`` and ``hqq`` always store zero points, so they take no
            symmetric setting.
        other_weights: ``keep`` or ``int8``: what happens to the float weights that
            MatMulNBits does not take.
    """

    bits: int = 4
    block_size: int = 64
    symmetric: bool = False
    accuracy_level: int = 0
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    bits_for: tuple[tuple[str, int], ...] = ()
    nodes: Mapping[str, NodeSetting] = dataclasses.field(default_factory=dict)
    algorithm: str = "default"
    other_weights: str = "keep"

    def __post_init__(self) -> None:
        from onnx_conv2matmul.quantize.weight_only import ALGORITHMS

        if isinstance(self.bits, bool) or self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise ValueError(_block_size_error(self.block_size))
        if not 0 <= self.accuracy_level <= 4:
            raise ValueError(f"accuracy level must be 0-4, got {self.accuracy_level}")
        for pattern, bits in self.bits_for:
            if not pattern or isinstance(bits, bool) or bits not in (4, 8):
                raise ValueError(f"bits for a pattern must be 4 or 8, got {pattern}={bits}")
        for name, setting in self.nodes.items():
            if not isinstance(setting, NodeSetting):
                raise ValueError(f"the setting of node {name!r} is not a NodeSetting")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.other_weights not in OTHER_WEIGHTS:
            raise ValueError(f"other weights must be keep or int8, got {self.other_weights!r}")
        self._check_algorithm()

    def _check_algorithm(self) -> None:
        """Refuse settings the algorithm cannot give."""
        settings = [(f"node {name!r}", s) for name, s in self.nodes.items() if s.bits is not None]
        if self.algorithm in ("k_quant", "hqq"):
            symmetric = [where for where, s in [("the default", self._default()), *settings] if s.symmetric]
            if symmetric:
                raise ValueError(
                    f"the {self.algorithm} algorithm always stores zero points: {symmetric[0]} is symmetric"
                )
        if self.algorithm in ("gptq", "hqq"):
            # gptq: onnxruntime packs only 4 bits into MatMulNBits. hqq: its float zero points
            # at 8 bits are refused by onnxruntime's CPU kernel.
            bits: list[tuple[str, int | None]] = [("the default", self.bits)]
            bits += [(f"pattern {p!r}", b) for p, b in self.bits_for]
            bits += [(where, s.bits) for where, s in settings]
            eight = [where for where, b in bits if b != 4]
            if eight:
                raise ValueError(f"the {self.algorithm} algorithm gives 4 bits only: {eight[0]} asks for 8")

    def _default(self) -> NodeSetting:
        return NodeSetting(self.bits, self.block_size, self.symmetric)

    def selects(self, name: str) -> bool:
        """Whether ``exclude`` and ``include`` let the node be quantized (``nodes`` aside)."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return False
        return not self.include or any(fnmatch.fnmatchcase(name, p) for p in self.include)

    def setting_for(self, name: str) -> NodeSetting:
        """The resolved setting of the MatMul named ``name`` (see the class docstring)."""
        if name in self.nodes:
            return self.nodes[name]
        if not self.selects(name):
            return NodeSetting(None, self.block_size, self.symmetric)
        bits = self.bits
        for pattern, pattern_bits in self.bits_for:
            if fnmatch.fnmatchcase(name, pattern):
                bits = pattern_bits
        return NodeSetting(bits, self.block_size, self.symmetric)

    def to_config(self) -> dict[str, Any]:
        """The settings file's JSON object (format version :data:`CONFIG_VERSION`).

        ``from_config(to_config())`` gives these options back, so a run can be replayed.
        """
        return {
            "config_version": CONFIG_VERSION,
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "algorithm": self.algorithm,
            "bits_for": [{"pattern": p, "bits": b} for p, b in self.bits_for],
            "exclude": list(self.exclude),
            "include": list(self.include),
            "nodes": {name: setting.to_dict() for name, setting in self.nodes.items()},
            "other_weights": self.other_weights,
        }

    def to_dict(self) -> dict[str, Any]:
        """For reports: the settings file's object (:meth:`to_config`), so it can be replayed."""
        return self.to_config()

    @classmethod
    def from_config(cls, data: Any) -> QuantizeOptions:
        """Options from a settings file's JSON object; keys left out take their defaults.

        Raises:
            ValueError: one line saying what is wrong (an unknown key or version, a value
                of the wrong type or out of range).
        """
        return cls(**config_fields(data))


_CONFIG_TYPES: dict[str, type | tuple[type, ...]] = {
    "bits": int,
    "block_size": int,
    "symmetric": bool,
    "accuracy_level": int,
    "algorithm": str,
    "bits_for": list,
    "exclude": list,
    "include": list,
    "nodes": dict,
    "other_weights": str,
}


def config_fields(data: Any) -> dict[str, Any]:
    """The :class:`QuantizeOptions` fields a settings file's JSON object gives (only those it has).

    Raises:
        ValueError: one line saying what is wrong.
    """
    if not isinstance(data, dict):
        raise ValueError("the settings must be a JSON object")
    version = data.get("config_version")
    if version != CONFIG_VERSION or isinstance(version, bool):
        raise ValueError(f"config_version must be {CONFIG_VERSION}, got {version!r}")
    unknown = sorted(set(data) - set(_CONFIG_TYPES) - {"config_version"})
    if unknown:
        raise ValueError(f"unknown settings key {unknown[0]!r} (known: {', '.join(_CONFIG_TYPES)})")
    fields: dict[str, Any] = {}
    for key, kind in _CONFIG_TYPES.items():
        if key not in data:
            continue
        value = data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"settings key {key!r} must be a JSON {_json_kind(kind)}, got {value!r}")
        fields[key] = value
    for key in ("exclude", "include"):
        if key in fields:
            if not all(isinstance(p, str) for p in fields[key]):
                raise ValueError(f"settings key {key!r} must be a list of strings")
            fields[key] = tuple(fields[key])
    if "bits_for" in fields:
        pairs = []
        for item in fields["bits_for"]:
            if not (
                isinstance(item, dict)
                and set(item) == {"pattern", "bits"}
                and isinstance(item["pattern"], str)
                and isinstance(item["bits"], int)
            ):
                raise ValueError(
                    f'each bits_for entry must be {{"pattern": "...", "bits": 4 or 8}}, got {item!r}'
                )
            pairs.append((item["pattern"], item["bits"]))
        fields["bits_for"] = tuple(pairs)
    if "nodes" in fields:
        fields["nodes"] = {name: _node_setting(name, value) for name, value in fields["nodes"].items()}
    return fields


def _node_setting(name: str, value: Any) -> NodeSetting:
    keys = {"bits", "block_size", "symmetric"}
    if not isinstance(value, dict) or "bits" not in value or not set(value) <= keys:
        raise ValueError(
            f"the setting of node {name!r} must be an object with bits (4, 8 or null)"
            " and optionally block_size and symmetric"
        )
    try:
        return NodeSetting(**value)
    except ValueError as err:
        raise ValueError(f"node {name!r}: {err}") from None


def _json_kind(kind: type | tuple[type, ...]) -> str:
    return {int: "integer", bool: "boolean", str: "string", list: "array", dict: "object"}[kind]  # type: ignore[index]


def load_config(path: str) -> dict[str, Any]:
    """The :class:`QuantizeOptions` fields a settings file gives (see :func:`config_fields`).

    Raises:
        InputError: an unreadable file, bad JSON or a bad setting, in one line naming the file.
    """
    import json

    from onnx_conv2matmul.errors import InputError

    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except OSError as err:
        raise InputError(f"cannot read the settings file {path}: {err.strerror or err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"the settings file {path} is not valid JSON: {err}") from err
    except RecursionError as err:
        raise InputError(f"the settings file {path} is nested too deeply to be a settings file") from err
    try:
        fields = config_fields(data)
        QuantizeOptions(**fields)  # every check at once, before any work
    except ValueError as err:
        raise InputError(f"bad settings file {path}: {err}") from err
    return fields


DEFAULT_MAX_EVALUATIONS = 8


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one MatMul is stored: MatMulNBits with these settings, or float (``bits`` None)."""

    bits: int | None
    block_size: int = 64
    symmetric: bool = False

    @property
    def label(self) -> str:
        if self.bits is None:
            return "float"
        return f"int{self.bits} block {self.block_size} {'symmetric' if self.symmetric else 'asymmetric'}"

    def to_dict(self) -> dict[str, Any]:
        if self.bits is None:
            return {"bits": None}
        return {"bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric}

    def node_setting(self) -> NodeSetting:
        """The same as a per-node setting of :class:`QuantizeOptions`."""
        return NodeSetting(self.bits, self.block_size, self.symmetric)


FLOAT = Setting(None)
# The other weights' one option besides float, in the same allocation as the MatMuls.
_OTHER_INT8 = Setting(8, 0, True)

LADDER: tuple[Setting, ...] = tuple(
    Setting(bits, block, symmetric)
    for bits in (4, 8)
    for block in (128, 64, 32)
    for symmetric in (True, False)
)
"""The quantized settings the search chooses from (float is always a choice)."""


CRITERIA = (
    "predicted",
    "measured",
    "weight_error",
    "hawq",
    "mean_variance",
    "max_variance",
    "mean_magnitude",
)
"""How the search may rank the MatMuls (see :mod:`onnx_conv2matmul.quantize.criteria`)."""


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """What the search looks for: ``min_cosine``, ``metric`` or both (``quantize_file`` takes
    neither as its floor, :data:`onnx_conv2matmul.quantize.workflow.DEFAULT_MIN_COSINE`).

    Attributes:
        min_cosine: Every float output's cosine similarity to fp32, for every sample of
            every feed, must be at least this.
        metric: The user's score and the largest drop it may show.
        max_evaluations: Most full-model evaluations (at least 2).
        ladder: The quantized settings to choose from.
        other_weights: True or False to force int8 or float for the other weights;
            None lets the search decide.
        accuracy_level: MatMulNBits accuracy level of every quantized node.
        exclude: Glob patterns of MatMul names kept in float.
        include: When given, only MatMuls matching one of these are candidates.
        measure: Scale each node's predicted error by its output error measured with the
            node quantized alone (see :mod:`onnx_conv2matmul.quantize.measured`); None:
            when the inputs are the user's files.
        speed_aware: Offer each node only the settings that float does not beat on this CPU
            (the kernel costs, when measured): the search that runs because the default
            settings fell below the floor is; ``--auto``, asked for the smallest model, is not.
        criterion: How the nodes are ranked, one of
            :data:`CRITERIA` (``measured``, ``predicted`` or
            one of NNCF's rankers); None: as ``measure`` says. It wins over ``measure``.
    """

    min_cosine: float | None = None
    max_evaluations: int = DEFAULT_MAX_EVALUATIONS
    ladder: tuple[Setting, ...] = LADDER
    other_weights: bool | None = None
    accuracy_level: int = 0
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    metric: MetricTarget | None = None
    measure: bool | None = None
    criterion: str | None = None
    speed_aware: bool = False

    def __post_init__(self) -> None:
        if self.criterion is not None and self.criterion not in CRITERIA:
            raise ValueError(f"unknown criterion {self.criterion!r}; one of {', '.join(CRITERIA)}")
        if self.max_evaluations < 2:
            raise ValueError(f"the search needs at least 2 evaluations, got {self.max_evaluations}")
        if any(s.bits is None for s in self.ladder):
            raise ValueError("the ladder holds quantized settings only (float is always a choice)")

    def selects(self, name: str) -> bool:
        return QuantizeOptions(exclude=self.exclude, include=self.include).selects(name)


# MatMulNBits settings that int8 dynamic quantization has no use for.
_NBITS_ONLY = ("bits", "block_size", "symmetric", "accuracy_level")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Checked options of one quantize run.

    ``speed`` is None when nothing is timed; otherwise the kernel settings tried (one level and
    one block size when both are pinned: the result is then only timed against the original).
    ``metric`` is the user's validation function with its largest drop (a criterion beside the
    cosine, and the search's target); ``search_below``: whether a result below the criterion
    makes the search run (the settings are the defaults: nothing given, no settings file, no
    ``auto``, not int8 dynamic).
    """

    quantize: QuantizeOptions
    int8_dynamic: bool = False
    auto: AutoOptions | None = None
    speed: SpeedOptions | None = None
    metric: MetricTarget | None = None
    search_below: bool = False


def resolve(
    given: Mapping[str, Any] | None = None,
    *,
    config: str | None = None,
    int8_dynamic: bool = False,
    auto: bool = False,
    min_cosine: float | None = None,
    max_evaluations: int | None = None,
    save_config: bool = False,
    bench: bool = True,
    bench_lengths: tuple[int, ...] | None = None,
    bench_rounds: int | None = None,
    validate: str | None = None,
    max_drop: str | float | None = None,
    bench_mode: str | None = None,
    bench_cache: bool = True,
) -> Resolved:
    """Check and combine what a user asked for; the one place quantize options are decided.

    Args:
        given: :class:`QuantizeOptions` fields the user gave explicitly (those left out take the
            settings file's value, then the field's default). A repeatable field given replaces
            the file's whole list.
        config: A settings file (:meth:`QuantizeOptions.to_config`).
        int8_dynamic: onnxruntime's int8 dynamic quantization instead of MatMulNBits.
        auto: Search for the smallest settings meeting ``min_cosine``.
        min_cosine: The search's target (None: the workflow's floor, or the metric's drop).
        max_evaluations: The search's budget of full-model evaluations.
        save_config: Whether the chosen settings are to be written (``auto`` only).
        bench: Time the result against the original on this CPU and, unless pinned, choose the
            fastest kernel settings that meet the accuracy target: the accuracy level unless
            given (or in the settings file), the block size unless given, in the settings file,
            chosen by ``auto`` or by node, or the algorithm is not ``default``.
        bench_lengths: The lengths timed (default: chosen from the model's inputs).
        bench_rounds: The rounds of timed runs.
        bench_mode: ``shapes`` (default): the settings chosen from per-shape kernel costs, the
            model quantized once; ``full``: every candidate quantized and timed whole.
        bench_cache: Whether the kernel costs kept for this CPU are read.
        validate: The user's validation function, ``package.module:function`` or
            ``path/to/file.py:function`` (see :func:`onnx_conv2matmul.quantize.metric.load_function`).
        max_drop: With ``validate``, the largest drop of its score: a number (absolute), or a
            string ``"X"`` or ``"X%"`` (relative); default
            :data:`onnx_conv2matmul.quantize.metric.DEFAULT_MAX_DROP`.

    Raises:
        OptionConflict: options that need another or do not combine (named by field).
        ValidationError: the validation function cannot be loaded.
        InputError: a value out of range, or a bad settings file.
    """
    given = dict(given or {})
    fields = load_config(config) if config is not None else {}
    fields.update(given)
    try:
        options = QuantizeOptions(**fields)
    except ValueError as err:
        raise InputError(str(err)) from err
    if int8_dynamic:
        _refuse_with_int8_dynamic(options, given)
    metric = _metric(validate, max_drop, int8_dynamic)
    speed = _speed_options(options, fields, bench, bench_lengths, bench_rounds, int8_dynamic, auto)
    if speed is None and (bench_mode is not None or not bench_cache):
        raise OptionConflict(
            "{0} does not combine with {1}", "bench_mode" if bench_mode else "no_bench_cache", "no_bench"
        )
    if speed is not None:
        speed = dataclasses.replace(speed, mode=bench_mode or "shapes", cache=bench_cache)
    if not auto:
        if save_config:
            raise OptionConflict("{0} needs {1}", "save_config", "auto")
        if max_evaluations is not None:
            raise OptionConflict("{0} needs {1}", "max_evaluations", "auto")
        below = not int8_dynamic and not given and config is None
        return Resolved(options, int8_dynamic, speed=speed, metric=metric, search_below=below)
    if int8_dynamic:
        raise OptionConflict(
            "{0} chooses MatMulNBits settings: it does not combine with {1}", "auto", "int8_dynamic"
        )
    clashes = [
        name
        for name, clash in (
            ("config", config is not None),
            ("bits_for", bool(options.bits_for)),
            ("algorithm", options.algorithm != "default"),
        )
        if clash
    ]
    if clashes:
        raise OptionConflict(
            "{0} chooses every node's setting (round-to-nearest): it does not combine with {1}",
            "auto",
            clashes[0],
        )
    try:
        search = AutoOptions(
            min_cosine=min_cosine,
            max_evaluations=DEFAULT_MAX_EVALUATIONS if max_evaluations is None else max_evaluations,
            other_weights=None if "other_weights" not in given else given["other_weights"] == "int8",
            accuracy_level=options.accuracy_level,
            exclude=options.exclude,
            include=options.include,
            metric=metric,
        )
    except ValueError as err:
        raise InputError(str(err)) from err
    return Resolved(options, int8_dynamic=False, auto=search, speed=speed, metric=metric)


def _metric(validate: str | None, max_drop: str | float | None, int8_dynamic: bool) -> MetricTarget | None:
    """The validation function with its largest drop (a string ending in % is relative)."""
    from onnx_conv2matmul.quantize.metric import DEFAULT_MAX_DROP, MetricTarget, load_function

    if validate is None:
        if max_drop is not None:
            raise OptionConflict("{0} needs {1}", "max_drop", "validate")
        return None
    if int8_dynamic:
        raise OptionConflict(
            "{0} needs MatMulNBits quantization: it does not combine with {1}", "validate", "int8_dynamic"
        )
    drop, relative = DEFAULT_MAX_DROP, False
    if isinstance(max_drop, str):
        text = max_drop.strip()
        relative = text.endswith("%")
        try:
            drop = float(text.removesuffix("%")) / (100 if relative else 1)
        except ValueError:
            shown = repr(max_drop).replace("{", "{{").replace("}", "}}")
            raise OptionConflict("{0}: expected a number or a percentage, got " + shown, "max_drop") from None
    elif max_drop is not None:
        drop = max_drop
    function = load_function(validate)
    try:
        return MetricTarget(function, drop, relative, name=validate)
    except ValueError as err:
        raise OptionConflict("{0}: " + str(err).replace("{", "{{").replace("}", "}}"), "max_drop") from None


def _speed_options(
    options: QuantizeOptions,
    fields: Mapping[str, Any],
    bench: bool,
    lengths: tuple[int, ...] | None,
    rounds: int | None,
    int8_dynamic: bool,
    auto: bool,
) -> SpeedOptions | None:
    """What is timed and tried (see :func:`resolve`); int8 dynamic quantization has no kernel
    setting to choose: it is only timed."""
    from onnx_conv2matmul.speed.choose import DEFAULT_LEVELS, SpeedOptions
    from onnx_conv2matmul.speed.timing import DEFAULT_ROUNDS, TimingOptions

    if not bench:
        for name, value in (("bench_lengths", lengths), ("bench_rounds", rounds)):
            if value is not None:
                raise OptionConflict("{0} does not combine with {1}", name, "no_bench")
        return None
    block_pinned = (
        int8_dynamic
        or auto
        or "block_size" in fields
        or bool(options.nodes)
        or options.algorithm != "default"
    )
    level_pinned = int8_dynamic or "accuracy_level" in fields
    try:
        timing = TimingOptions(lengths=lengths, rounds=DEFAULT_ROUNDS if rounds is None else rounds)
        return SpeedOptions(
            timing=timing,
            levels=(options.accuracy_level,) if level_pinned else DEFAULT_LEVELS,
            block_sizes=(options.block_size,) if block_pinned else SpeedOptions().block_sizes,
        )
    except ValueError as err:
        raise InputError(str(err)) from err


def _refuse_with_int8_dynamic(options: QuantizeOptions, given: Mapping[str, Any]) -> None:
    """Refuse MatMulNBits settings that ``quantize_dynamic`` would silently not apply."""
    clashes = [name for name in _NBITS_ONLY if name in given]
    clashes += [
        name
        for name, clash in (
            ("bits_for", bool(options.bits_for)),
            ("algorithm", options.algorithm != "default"),
            ("other_weights_int8", options.other_weights == "int8"),
            ("nodes", bool(options.nodes)),
        )
        if clash
    ]
    if clashes:
        raise OptionConflict(
            "{0}: a MatMulNBits setting, which {1} would not apply", clashes[0], "int8_dynamic"
        )
