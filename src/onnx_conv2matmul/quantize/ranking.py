"""How the search ranks the weights before it steps: each weight's errors as predicted
(:mod:`onnx_conv2matmul.quantize.sensitivity`), rescaled by one of NNCF's rankers, or by its loss
measured alone on the inputs (each weight quantized by itself, the model run on the smallest feeds
holding :data:`~onnx_conv2matmul.quantize.search_options.MEASURE_SAMPLES` samples). The losses
measured alone are kept for the runs of one quantize (a step back searches the same model on the
same feeds again)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
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
from onnx_conv2matmul.quantize.sensitivity import MatMulNode, smallest_setting


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

    def key(name: str, setting: Setting) -> tuple[Any, ...]:
        return (model_key, feeds_key, deterministic, options.accuracy_level, name, repr(setting))

    # Every node's at once, as one model (each behind a flag of its own) where that can be built.
    smallest = {node.name: setting for node in nodes if (setting := smallest_setting(node)) is not None}
    todo = {name: setting for name, setting in smallest.items() if key(name, setting) not in kept}
    if len(todo) > 1:
        switched = _losses_switched(
            fp32_path, todo, options, reference, every, workdir, deterministic, blocks
        )
        for name, loss in (switched or {}).items():
            kept[key(name, todo[name])] = loss

    def loss_alone(name: str, setting: Setting) -> float:
        if key(name, setting) in kept:
            return kept[key(name, setting)]
        alone = setting == OTHER_INT8
        config = AutoConfig({} if alone else {name: setting}, alone, options.accuracy_level)
        measured = _evaluate(fp32_path, config, reference, every, workdir, deterministic, measure_all, blocks)
        kept[key(name, setting)] = loss = 1.0 - (measured.cosine if measured.cosine is not None else -1.0)
        return loss

    losses = calibrate([*nodes, others] if others.options else nodes, loss_alone)
    limit = None if options.min_cosine is None else 1.0 - options.min_cosine
    if limit is not None and any(m.node == others.name and m.measured >= limit for m in losses):
        others.options = {}


def _losses_switched(
    fp32_path: str,
    settings: Mapping[str, Setting],
    options: AutoOptions,
    reference: Reference,
    feeds: Sequence[int],
    workdir: str,
    deterministic: bool,
    blocks: BlockCache,
) -> dict[str, float] | None:
    """Each node's loss alone at its setting, from one model in which every node is quantized
    behind a flag of its own (:func:`~onnx_conv2matmul.quantize.classes.switch_layers`): one
    build, one session and a run per node and feed, where building each apart cost a build, a
    save and a session per node (PP-OCRv4's recognizer, 11 nodes on 8 lines: 6.1 s). The same
    outputs as those builds: the flag's branch is the same MatMulNBits, the other nodes compute
    in float from the original weights. None when such a model cannot be built or run (a node
    in a subgraph, say): each is then built apart."""
    from onnx_conv2matmul.errors import OutOfMemory
    from onnx_conv2matmul.files import output as _output
    from onnx_conv2matmul.quantize.classes import Flagged, switch_layers
    from onnx_conv2matmul.quantize.search_result import apply
    from onnx_conv2matmul.quantize.search_runs import _remove_candidate, _run, _session

    names = list(settings)
    config = AutoConfig(dict(settings), False, options.accuracy_level)
    model = ir.load(fp32_path)
    if not switch_layers(model, [[name] for name in names], lambda m: apply(m, config, blocks)[0].quantized):
        return None
    path = os.path.join(workdir, "switched.onnx")
    try:
        _output.save(model, path, "switched.onnx.data")
        del model
        session = _session(path, deterministic)
        losses = {}
        for chosen, name in enumerate(names):
            flagged, worst = Flagged(session, len(names), chosen), 1.0
            for index in feeds:
                cosine, note = reference.worst_cosine(index, _run(flagged, reference.feeds.feeds[index]))
                worst = min(worst, cosine)
                if note:
                    break
            losses[name] = 1.0 - worst
        return losses
    except OutOfMemory:
        raise
    except Exception:  # built apart instead
        return None
    finally:
        _remove_candidate(path)


def feeds_digest(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    """A digest of the feeds' names, dtypes, shapes and values."""
    digest = hashlib.sha256()
    for feed in feeds:
        for name in sorted(feed):
            value = np.asarray(feed[name])
            digest.update(f"{name}|{value.dtype}|{value.shape}|".encode())
            digest.update(value.tobytes())
    return digest.hexdigest()
