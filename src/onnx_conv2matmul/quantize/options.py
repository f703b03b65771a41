"""Quantize options, resolved and checked in one place.

:func:`resolve` turns what a user gave (settings by name, a settings file, the mode) into checked
options, refusing every combination that could not be applied as asked. The command line maps its
flags to :func:`resolve`'s arguments and decides nothing itself. The option types live beside it
and are named here too: :class:`QuantizeOptions` and :class:`NodeSetting` (MatMulNBits settings,
:mod:`onnx_conv2matmul.quantize.settings`), :class:`AutoOptions` and :class:`Setting` (what
``--auto`` looks for, :mod:`onnx_conv2matmul.quantize.search_options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.errors import InputError, OptionConflict
from onnx_conv2matmul.quantize.search_options import CRITERIA as CRITERIA
from onnx_conv2matmul.quantize.search_options import DEFAULT_MAX_EVALUATIONS as DEFAULT_MAX_EVALUATIONS
from onnx_conv2matmul.quantize.search_options import FLOAT as FLOAT
from onnx_conv2matmul.quantize.search_options import LADDER as LADDER
from onnx_conv2matmul.quantize.search_options import AutoOptions as AutoOptions
from onnx_conv2matmul.quantize.search_options import Setting as Setting
from onnx_conv2matmul.quantize.settings import BLOCK_SIZES as BLOCK_SIZES
from onnx_conv2matmul.quantize.settings import CONFIG_VERSION as CONFIG_VERSION
from onnx_conv2matmul.quantize.settings import OTHER_WEIGHTS as OTHER_WEIGHTS
from onnx_conv2matmul.quantize.settings import NodeSetting as NodeSetting
from onnx_conv2matmul.quantize.settings import QuantizeOptions as QuantizeOptions
from onnx_conv2matmul.quantize.settings import config_fields as config_fields
from onnx_conv2matmul.quantize.settings import load_config as load_config

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.speed.choose import SpeedOptions


# MatMulNBits settings that int8 dynamic quantization has no use for.
_NBITS_ONLY = ("bits", "block_size", "symmetric", "accuracy_level")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Checked options of one quantize run.

    ``speed`` is None when nothing is timed; otherwise the kernel settings tried (one level and
    one block size when both are pinned: the result is then only timed against the original).
    ``metric`` is the user's validation function with its largest drop (a criterion beside the
    cosine, and the search's target); ``search_below``: whether a result below the criterion
    makes the search run (see :func:`search_below_by_default`).
    """

    quantize: QuantizeOptions
    int8_dynamic: bool = False
    auto: AutoOptions | None = None
    speed: SpeedOptions | None = None
    metric: MetricTarget | None = None
    search_below: bool = False


def search_below_by_default(*, settings_given: bool, auto: bool, int8_dynamic: bool) -> bool:
    """Whether a result below the accuracy criterion makes the search run when the caller does not
    say: only when the settings are the defaults (no setting given, no settings file), without
    ``auto`` and not int8 dynamic. The one rule both :func:`resolve` (the command line) and
    :func:`onnx_conv2matmul.quantize.plan.resolve` (a caller of the API) apply."""
    return not (settings_given or auto or int8_dynamic)


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
        below = search_below_by_default(
            settings_given=bool(given) or config is not None, auto=False, int8_dynamic=int8_dynamic
        )
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
