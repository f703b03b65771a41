"""How the search ranks the weights before it steps: each weight's errors as predicted
(:mod:`onnx_conv2matmul.quantize.sensitivity`), rescaled by one of NNCF's rankers, or by its loss
measured alone on the inputs (each weight quantized by itself, the model run on the smallest feeds
holding :data:`~onnx_conv2matmul.quantize.search_options.MEASURE_SAMPLES` samples). The losses
measured alone are kept for the runs of one quantize (a step back searches the same model on the
same feeds again)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul.quantize.blockwise import BlockCache
from onnx_conv2matmul.quantize.options import Setting
from onnx_conv2matmul.quantize.reference import FeedSet, Reference
from onnx_conv2matmul.quantize.search_options import MEASURE_NODES, MEASURE_SAMPLES, OTHER_INT8, AutoOptions
from onnx_conv2matmul.quantize.search_result import AutoConfig
from onnx_conv2matmul.quantize.search_runs import _evaluate, _Target
from onnx_conv2matmul.quantize.sensitivity import MatMulNode


def criterion(options: AutoOptions, feed_set: FeedSet, nodes: int) -> str:
    """How the nodes are ranked (:mod:`onnx_conv2matmul.quantize.sensitivity`): as the options say;
    by default measured on the user's files, or when the smallest model is asked for and there are
    at most :data:`MEASURE_NODES` nodes; predicted otherwise."""
    if options.criterion is not None:
        return options.criterion
    if options.measure is not None:
        return "measured" if options.measure else "predicted"
    real = bool(feed_set.how) and all(how == "from the input files" for how in feed_set.how.values())
    smallest = not options.speed_aware and nodes <= MEASURE_NODES
    return "measured" if real or smallest else "predicted"


def rank_by(criterion: str, model: ir.Model, nodes: Sequence[MatMulNode], reference: Reference) -> None:
    """Each node's errors rescaled by one of NNCF's rankers (:mod:`onnx_conv2matmul.quantize.sensitivity`)."""
    from onnx_conv2matmul.quantize.projection import quantizable_matmuls
    from onnx_conv2matmul.quantize.sensitivity import rank

    weights: dict[str, ir.Value] = {}
    for _, node, b in quantizable_matmuls(model):
        if node.name and node.name not in weights:
            weights[node.name] = b

    def weight(name: str) -> np.ndarray:
        return np.asarray(weights[name].const_value.numpy())  # type: ignore[union-attr]

    rank(criterion, nodes, weight, reference.statistics)


def measure_alone(
    fp32_path: str,
    nodes: Sequence[Any],
    others: MatMulNode,
    options: AutoOptions,
    reference: Reference,
    workdir: str,
    deterministic: bool,
    blocks: BlockCache,
    measured_before: tuple[Any, dict[Any, float]] | None = None,
) -> None:
    """Each node's errors scaled by its loss alone on the smallest feeds of :data:`MEASURE_SAMPLES`
    samples (a ranking: evaluations check every feed); the other weights' by all in int8 at once,
    not offered when that alone misses the target (PP-OCRv4 rec's convs in int8: cosine 0.973).
    ``measured_before``: the model's identity and the losses measured before (see
    :func:`onnx_conv2matmul.quantize.search.search`)."""
    from onnx_conv2matmul.quantize.sensitivity import calibrate
    from onnx_conv2matmul.verify.feeds import smallest_covering

    every = smallest_covering(reference.feeds.feeds, MEASURE_SAMPLES)
    measure_all = _Target(dataclasses.replace(options, min_cosine=-2.0, metric=None), None)
    model_key, kept = measured_before if measured_before is not None else (None, {})
    feeds_key = feeds_digest([reference.feeds.feeds[i] for i in every]) if measured_before is not None else ""

    def loss_alone(name: str, setting: Setting) -> float:
        key = (model_key, feeds_key, deterministic, options.accuracy_level, name, repr(setting))
        if key in kept:
            return kept[key]
        alone = setting == OTHER_INT8
        config = AutoConfig({} if alone else {name: setting}, alone, options.accuracy_level)
        measured = _evaluate(fp32_path, config, reference, every, workdir, deterministic, measure_all, blocks)
        kept[key] = loss = 1.0 - (measured.cosine if measured.cosine is not None else -1.0)
        return loss

    losses = calibrate([*nodes, others] if others.options else nodes, loss_alone)
    limit = None if options.min_cosine is None else 1.0 - options.min_cosine
    if limit is not None and any(m.node == others.name and m.measured >= limit for m in losses):
        others.options = {}


def feeds_digest(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    """A digest of the feeds' names, dtypes, shapes and values."""
    digest = hashlib.sha256()
    for feed in feeds:
        for name in sorted(feed):
            value = np.asarray(feed[name])
            digest.update(f"{name}|{value.dtype}|{value.shape}|".encode())
            digest.update(value.tobytes())
    return digest.hexdigest()
