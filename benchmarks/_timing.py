"""onnxruntime latency of several models in one process, timed so that they can be compared.

- Every session is made with ``session.intra_op.allow_spinning = 0``: an idle session's
  intra-op threads otherwise spin and take CPU from the one being timed (a model timed against
  a byte-identical copy of itself showed +14% to +26%; without spinning the copies agree within
  about 2%).
- The models run in rounds, one run of each per round, in an order that changes from round to
  round (every permutation in turn: AB BA for two models), so no model always runs first or
  right after the same other one, and a slow drift of the machine hits all of them alike.
- A ratio of medians comes with a 95% bootstrap interval that resamples whole rounds, keeping
  the runs of one round together.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

SPINNING_KEY = "session.intra_op.allow_spinning"


def timed_session(path: Path | str, threads: int) -> ort.InferenceSession:
    """A CPU session for timing next to others: ``threads`` intra-op threads that do not spin."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry(SPINNING_KEY, "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_order(round_index: int, models: int) -> tuple[int, ...]:
    """The order of the models in a round: every permutation in turn."""
    orders = list(itertools.permutations(range(models)))
    return orders[round_index % len(orders)]


def interleaved_latency(
    sessions: Sequence[ort.InferenceSession],
    feeds: dict[str, np.ndarray],
    runs: int,
    warmup: int = 2,
) -> list[list[float]]:
    """Milliseconds of ``runs`` runs of each session; sample ``i`` of every list is round ``i``."""
    for session in sessions:
        for _ in range(warmup):
            session.run(None, feeds)
    times: list[list[float]] = [[] for _ in sessions]
    for index in range(runs):
        for which in run_order(index, len(sessions)):
            start = time.perf_counter()
            sessions[which].run(None, feeds)
            times[which].append((time.perf_counter() - start) * 1000)
    return times


def ratio_of_medians(reference: Sequence[float], candidate: Sequence[float]) -> float:
    return statistics.median(candidate) / statistics.median(reference)


def ratio_interval(
    reference: Sequence[float], candidate: Sequence[float], draws: int = 2000
) -> tuple[float, float]:
    """95% bootstrap interval of median(candidate) / median(reference), resampling the rounds."""
    a, b = np.asarray(reference), np.asarray(candidate)
    if len(a) != len(b):
        raise ValueError("the samples must come in rounds: one of each per round")
    picks = np.random.default_rng(1).integers(0, len(a), size=(draws, len(a)))
    ratios = np.median(b[picks], axis=1) / np.median(a[picks], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)
