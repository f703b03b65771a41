"""The inputs the speed step times on: the user's, or shapes the accuracy check proved.

- With real inputs (``--inputs``), the timing runs on them and nothing else: their shapes and
  values, at most :data:`MAX_TIMED_FEEDS` of them (the smallest and the largest by bytes, so the
  latency is seen at two sizes), each at batch 1 (a file of several samples: its first).
- With lengths given for the timing (``--bench-lengths``), synthesised inputs at those lengths,
  as the user asked.
- Otherwise runs of the original made by the accuracy check's machinery at batch 1: at the
  timing's default lengths (200 and 1000 for a sequence, 224 and 448 for an image) when the
  original runs at both, else the check's own plan (a shape it cannot take replaced as the check
  replaces it), its shortest and longest runs. A fixed height (a recognizer's 48) or a value the
  graph needs (silero's sample rate) is then what the check found, never a default length the
  model cannot take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.speed.timing import TimingOptions
from onnx_conv2matmul.verify.feeds import feed_bytes
from onnx_conv2matmul.verify.options import VerifyOptions, feed_source

MAX_TIMED_FEEDS = 2
"""Real inputs timed at most: the smallest and the largest."""


def shapes_text(feed: Mapping[str, np.ndarray]) -> str:
    """A feed's inputs with their shapes, as the timing's rule names them."""
    return ", ".join(f"{name}{list(np.shape(a))}" for name, a in feed.items())


def pick_feeds(feeds: Sequence[Mapping[str, np.ndarray]]) -> list[int]:
    """The indices of the feeds to time: the smallest and the largest by bytes (the first of
    equals), in that order; one when there is one size."""
    if not feeds:
        return []
    sizes = [feed_bytes(feed) for feed in feeds]
    small = min(range(len(feeds)), key=lambda i: (sizes[i], i))
    large = max(range(len(feeds)), key=lambda i: (sizes[i], -i))
    return [small] if sizes[small] == sizes[large] else [small, large]


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    shape: list[int | str | None]


def input_shapes(path: str) -> list[_Spec]:
    """The graph inputs of the model at ``path`` (not its initializers): names and dims."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    specs = []
    for value in graph.input:
        if value.name in weights:
            continue
        shape: list[int | str | None] = [
            d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim
        ]
        specs.append(_Spec(value.name, shape))
    return specs


def first_sample(feed: Mapping[str, np.ndarray], specs: Sequence[_Spec] | None) -> dict[str, np.ndarray]:
    """The first sample (batch row) of ``feed``, as the accuracy check cuts its samples; the feed
    as it is when it holds one, or when the model's inputs are not known (``specs`` None)."""
    from onnx_conv2matmul.verify.stream import cut_inputs, sample_rows

    if specs is None:
        return dict(feed)
    cut = cut_inputs(specs, feed)
    return sample_rows(feed, cut, 0, 1) if cut else dict(feed)


def given_inputs(
    timing: TimingOptions,
    feeds: Sequence[Mapping[str, np.ndarray]],
    specs: Sequence[_Spec] | None = None,
    *,
    short: bool = False,
) -> TimingOptions:
    """``timing`` on real inputs: each numbered as the accuracy check numbers it (from 1). With the
    model's ``specs``, a feed of several samples (a file of 50 lines) is timed on its first sample,
    at batch 1 as every latency is: timing the whole file as one batch measured another workload,
    and held its activations (gigabytes for a recognizer's 50 lines) in each of the models timed
    together. ``short``: the smallest alone."""
    chosen = pick_feeds(feeds)[:1] if short else pick_feeds(feeds)
    which = "the smallest" if short else "the smallest and the largest"
    timed = {i: first_sample(feeds[i], specs) for i in chosen}
    described = "; ".join(
        f"{i + 1}: {feed_source(feeds[i], i)} ({shapes_text(timed[i])}"
        + (", its first sample" if feed_bytes(timed[i]) < feed_bytes(feeds[i]) else "")
        + ")"
        for i in chosen
    )
    return dataclasses.replace(
        timing,
        feeds=tuple((i + 1, timed[i]) for i in chosen),
        feeds_rule=f"the given inputs (--inputs), {which}: {described}",
    )


def proven_inputs(
    src: str, timing: TimingOptions, verify: VerifyOptions, *, short: bool = False, session: Any = None
) -> TimingOptions:
    """``timing`` on runs of ``src`` at batch 1 that the accuracy check's machinery made: at the
    timing's default lengths (200 and 1000 for a sequence, 224 and 448 for an image) when the
    original runs at both, else at the check's own shortest and longest runs (the long run of a
    speech encoder left out when there are others). ``short``: the shortest of them alone (the
    default lengths are still all proved). ``session``: a checking session of ``src`` made already.

    Raises:
        ModelRunError, InputError, OutOfMemory: as the accuracy check, for the original.
    """
    from onnx_conv2matmul.errors import Conv2MatMulError
    from onnx_conv2matmul.speed.timing import default_lengths
    from onnx_conv2matmul.verify.check import Reference

    options = dataclasses.replace(verify, batch=1, feeds=None, report_only=True, min_cosine=None)
    probe = Reference(src, options, run=False, session=session)
    # Proved at every default length even when short: a model that runs at the short one and not
    # at the long one (silero VAD at 200 and 1000 samples) takes only some shapes, and is timed on
    # the check's own runs, as the latency line times it.
    lengths, _ = default_lengths(probe.specs, options)
    del probe
    reference: Reference | None = None
    try:
        reference = Reference(src, dataclasses.replace(options, lengths=tuple(lengths)), session=session)
        rule = "the timing's default lengths, run by the accuracy check's planner at batch 1"
        rule = f"the shortest of {rule}" if short else rule
        if sorted(run.length for run, _ in reference.done) != sorted(lengths):
            reference = None  # a length left out (the memory budget): not proven
    except Conv2MatMulError:
        reference = None
    if reference is None:
        reference = Reference(src, options, session=session)
        rule = f"the accuracy check's {'shortest run' if short else 'shortest and longest runs'}, batch 1"
    runs = [run for run, _ in reference.done]
    for index, (run, _) in enumerate(reference.done):
        reference.done[index] = (run, [])  # the outputs are not needed
    feeds = reference.feeds()
    usable = [i for i, run in enumerate(runs) if not run.long] or list(range(len(runs)))
    chosen = [usable[i] for i in pick_feeds([feeds[i] for i in usable])][: 1 if short else None]
    numbers = [runs[i].length for i in chosen]
    if len(set(numbers)) != len(numbers) or min(numbers, default=1) < 1:
        numbers = list(range(1, len(chosen) + 1))
    described = "; ".join(f"{n}: {shapes_text(feeds[i])}" for n, i in zip(numbers, chosen, strict=True))
    return dataclasses.replace(
        timing,
        feeds=tuple((n, feeds[i]) for n, i in zip(numbers, chosen, strict=True)),
        feeds_rule=f"{rule}: {described}",
    )


def timing_inputs(
    src: str, timing: TimingOptions, verify: VerifyOptions, *, short: bool = False, session: Any = None
) -> TimingOptions:
    """What the speed step times ``src`` and its candidates on (see the module's description);
    ``short``: the smallest of them alone (lengths given are timed as given); ``session``: a
    checking session of ``src`` made already, to prove them with."""
    if verify.feeds is not None:
        return given_inputs(timing, verify.feeds, input_shapes(src), short=short)
    if timing.lengths is not None:
        return timing
    return proven_inputs(src, timing, verify, short=short, session=session)
