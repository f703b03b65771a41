"""The inputs of a check: real ones read from files (:mod:`~onnx_conv2matmul.verify.given`), or
synthesised from each input's type and shape, each dim taking the value its role gives it
(:mod:`~onnx_conv2matmul.verify.roles`).

**Synthesis.** Floats are standard normal (seeded by the seed and the run's length), or uniform
in the range the model's first op says they take (:mod:`~onnx_conv2matmul.verify.ranges`);
state inputs zeros, integers random in [0, 4), bools random; an integer rank-1 input whose name
says length gets, in every batch row, the value of the sequence dim it measures (the dim of
the input its name starts with, e.g. ``target_length`` -> ``targets``; else the main one).
"""

# pragma: no mutate start
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# Imported from here by speed/ and quantize/ (their homes: given and roles).
from onnx_conv2matmul.verify.given import check_names as check_names
from onnx_conv2matmul.verify.options import VerifyOptions
from onnx_conv2matmul.verify.roles import STATE_NAME
from onnx_conv2matmul.verify.roles import InputSpec as InputSpec
from onnx_conv2matmul.verify.roles import Roles as Roles
from onnx_conv2matmul.verify.roles import dim_roles as dim_roles
from onnx_conv2matmul.verify.stream import feed_rows


def synthesise_inputs(
    specs: Sequence[InputSpec],
    length: int,
    options: VerifyOptions,
    values: Mapping[str, int] | None = None,
    roles: Roles | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Inputs for one run, and how each was made.

    ``values`` gives every dim's value (see :meth:`Roles.values`); without it every
    sequence dim takes ``length``. ``length`` seeds the random inputs. With real inputs
    (``options.feeds``), ``length`` is the feed's number, from 1.
    """
    if options.feeds is not None:
        feed = options.feeds[length - 1]
        return {spec.name: feed[spec.name] for spec in specs}, {
            spec.name: "from the input files" for spec in specs
        }
    roles = roles or dim_roles(specs, options)
    values = values if values is not None else roles.values(length, options)
    rng = np.random.default_rng([options.seed, length])
    feeds: dict[str, np.ndarray] = {}
    how: dict[str, str] = {}
    for spec in specs:
        dims = roles.shape(spec.name, values)
        if spec.name in options.inputs:
            feeds[spec.name] = np.full(dims, options.inputs[spec.name], dtype=spec.dtype)
            how[spec.name] = f"fixed {options.inputs[spec.name]}"
        elif spec.name in roles.length_of:
            measured = roles.length_of[spec.name]
            fill = values[measured] if measured is not None else _largest_static(roles, roles.signal)
            feeds[spec.name] = np.full(dims, fill, dtype=spec.dtype)
            how[spec.name] = f"length of {measured} per batch row" if measured else "length per batch row"
        elif np.issubdtype(spec.dtype, np.floating):
            if spec.name != options.signal_input and STATE_NAME.search(spec.name):
                feeds[spec.name] = np.zeros(dims, dtype=spec.dtype)
                how[spec.name] = "zeros (state)"
            elif spec.value_range is not None:
                low, high, why = spec.value_range
                feeds[spec.name] = rng.uniform(low, high, size=dims).astype(spec.dtype)
                how[spec.name] = f"uniform in [{low:g}, {high:g}] ({why})"
            else:
                feeds[spec.name] = rng.standard_normal(dims).astype(spec.dtype)
                how[spec.name] = "standard normal"
        elif spec.dtype is np.bool_:
            feeds[spec.name] = rng.integers(0, 2, size=dims).astype(np.bool_)
            how[spec.name] = "random bool"
        else:
            feeds[spec.name] = rng.integers(0, 4, size=dims).astype(spec.dtype)
            how[spec.name] = "random integers in [0, 4)"
    return feeds, how


def feed_bytes(feed: Mapping[str, np.ndarray]) -> int:
    """The bytes of a feed's inputs."""
    return sum(int(np.asarray(v).nbytes) for v in feed.values())


def feed_samples(feed: Mapping[str, np.ndarray]) -> int:
    """How many samples one run's inputs hold: the first dim of its float inputs of rank 2 or
    more when they all agree on it (a batch; integer ids when no float input has rank 2, see
    :func:`onnx_conv2matmul.verify.stream.feed_rows`), else 1."""
    return feed_rows(feed)


def smallest_covering(feeds: Sequence[Mapping[str, np.ndarray]], samples: int) -> list[int]:
    """The indices of the feeds of fewest input bytes, smallest first, until they hold at least
    ``samples`` samples (every feed when they hold fewer), in their own order."""
    order = sorted(range(len(feeds)), key=lambda i: (feed_bytes(feeds[i]), i))
    chosen: list[int] = []
    held = 0
    for index in order:
        if held >= samples:
            break
        chosen.append(index)
        held += feed_samples(feeds[index])
    return sorted(chosen)


def _largest_static(roles: Roles, signal: str | None) -> int:
    """What a length input gets when no dim takes the lengths: the signal's largest axis."""
    row = roles.axes.get(signal or "", ())
    return max((a for a in row if isinstance(a, int)), default=1)


def inputs_signature(specs: Sequence[InputSpec]) -> str:
    return ", ".join(f"{s.name}: {np.dtype(s.dtype).name}{s.shape}" for s in specs)


def same_signature(a: Sequence[InputSpec], b: Sequence[InputSpec]) -> bool:
    """Same names and types; same rank and the same value wherever both dims are static."""
    by_name = {s.name: s for s in b}
    if len(a) != len(b) or set(by_name) != {s.name for s in a}:
        return False
    for spec in a:
        other = by_name[spec.name]
        if np.dtype(spec.dtype) != np.dtype(other.dtype) or len(spec.shape) != len(other.shape):
            return False
        for x, y in zip(spec.shape, other.shape, strict=True):
            if isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0 and x != y:
                return False
    return True


# pragma: no mutate end
