"""MatMulNBits settings: how each MatMul is quantized (:class:`QuantizeOptions`, per node
:class:`NodeSetting`), and the settings file that replays them (:meth:`QuantizeOptions.to_config`,
:func:`load_config`). Each value checks its own range; what a user gives is combined and checked
as a whole by :func:`onnx_conv2matmul.quantize.options.resolve`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any

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

    def only(self, nodes: Mapping[str, NodeSetting], other_weights: str = "keep") -> QuantizeOptions:
        """These options with the MatMuls of ``nodes`` alone quantized, each at its setting, every
        other one in float (no pattern left to apply), and the other weights as ``other_weights``
        says: the options of a per-layer choice."""
        return dataclasses.replace(
            self, exclude=("*",), include=(), bits_for=(), nodes=dict(nodes), other_weights=other_weights
        )

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
