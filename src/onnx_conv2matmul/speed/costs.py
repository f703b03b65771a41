"""What each MatMul kernel costs on this CPU, measured one weight shape at a time.

A model's MatMul layers come in a few weight shapes (``K x N``); at a given input length each
runs on a number of activation rows. :class:`KernelCosts` times one kernel at one shape and row
count in a small model of its own (one ``MatMul`` or ``MatMulNBits`` node with random weights:
the kernels' speed does not depend on the values), one session per shape, and
:func:`model_cost` adds the costs up over a model's layers. A whole model is never run, so
choosing among block sizes and accuracy levels takes seconds, not a run of every candidate.

Measurements are kept in a JSON file per CPU model, core count and onnxruntime version under
the user's cache folder (``$XDG_CACHE_HOME/onnx-conv2matmul`` or ``~/.cache/onnx-conv2matmul``,
see :func:`cache_path`), so a second run on the same machine measures nothing it measured before.

The clock and the session factory are parameters, as in :mod:`onnx_conv2matmul.speed.timing`:
tests time fake sessions with a fake clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_conv2matmul.speed.machine import CpuWait, is_busy
from onnx_conv2matmul.speed.timing import (
    REAL_CLOCK,
    Clock,
    SessionFactory,
    _default_clock,
    cpu_name,
    timed_session,
)

CACHE_VERSION = 2
"""The version of the cache file; a file of another is not read. 2: kernels of microseconds timed
for longer (:data:`MIN_TIMED_MS`) and refusals confirmed (:meth:`KernelCosts.confirm`); the
fastest of nine runs that version 1 kept left PP-OCRv4 rec's level untied, and its default
at 0.668x where an empty cache gives 0.381x."""
DEFAULT_RUNS = 9
"""Timed runs of each kernel at each row count. The fastest is kept: a run of a few milliseconds
on a shared machine is only ever slowed down by the others, so the least disturbed run is the
kernel's own cost (medians of runs measured on a loaded 2-core machine disagreed by 2x and more)."""
DEFAULT_WARMUP = 2
MIN_TIMED_MS = 5.0
"""Each kernel is timed for at least this long at each row count: where :data:`DEFAULT_RUNS` runs
take less (the last warm-up run says), it runs more, up to :data:`MAX_RUNS`, as long as the runs
added stay within :data:`EXTRA_MS` over the whole model. The fastest of nine runs of a kernel of
microseconds moved by 15% from one cold run to the next (a small BERT's 8-bit kernels at 1.13x
and 0.96x float's), and the small BERT came out 0.32x or 0.69x by it; without the bound, the
registry's CNNs, with hundreds of small kernels, took up to twice as long (PP-OCRv5 rec 18.4 s to
23.2 s)."""
EXTRA_MS = 100.0
"""The time the runs added by :data:`MIN_TIMED_MS` may take, over all the kernels one
:class:`KernelCosts` times (a small model's take less)."""
MAX_RUNS = 200
MAX_TIMED_VALUES = 2**20
"""A kernel is timed on at most this many values of activation or output (4 MiB of float32): at more
rows it is timed at fewer and its cost scaled up by the rows, as a kernel that large costs in
proportion to its rows. The sessions of one shape are open together, each with its own output: a
recognizer's CTC head (120 x 18,710 at 1,500 rows, 112 MB of output) held 1.2 GB in nine of them."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A MatMul's kernel: float (``bits`` None) or MatMulNBits with these settings."""

    bits: int | None
    block_size: int = 0
    accuracy_level: int = 0

    @property
    def key(self) -> str:
        if self.bits is None:
            return "float"
        return f"int{self.bits}-b{self.block_size}-l{self.accuracy_level}"

    @property
    def label(self) -> str:
        if self.bits is None:
            return "float"
        return f"{self.bits}-bit block {self.block_size} level {self.accuracy_level}"


FLOAT_KERNEL = Kernel(None)


@dataclasses.dataclass(frozen=True)
class Layer:
    """A MatMul of the model: its weight's shape and its activation rows at each length."""

    name: str
    k: int
    n: int
    rows: tuple[int, ...]


def cache_dir() -> str:
    """The tool's cache folder: ``$XDG_CACHE_HOME/onnx-conv2matmul``, else ``~/.cache/onnx-conv2matmul``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "onnx-conv2matmul")


def machine_key() -> str:
    """The CPU model, the core count and onnxruntime's version: what the costs depend on."""
    import onnxruntime as ort

    cpu = cpu_name()
    text = f"{cpu}|ort {ort.__version__}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in text).strip("_")[:150]


def cache_path() -> str:
    """The file this machine's kernel costs are kept in."""
    return os.path.join(cache_dir(), "kernel-costs", f"{machine_key()}.json")


class KernelCosts:
    """Milliseconds of one kernel at one weight shape and row count, measured once (per cache).

    Args:
        path: The cache file to read and write; None: nothing kept between runs.
        read_cache: False ignores what the file holds (measurements are still written to it).
        runs, warmup, threads: How each kernel is timed (threads 0: onnxruntime's default).
        min_ms: The least time each kernel is timed for (see :data:`MIN_TIMED_MS`; 0: ``runs``).
        extra_ms: The time the runs it adds may take in all (see :data:`EXTRA_MS`).
        clock, session_factory: As :func:`onnx_conv2matmul.speed.timing.time_models`.
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        read_cache: bool = True,
        runs: int = DEFAULT_RUNS,
        warmup: int = DEFAULT_WARMUP,
        threads: int = 0,
        clock: Clock | None = None,
        session_factory: SessionFactory | None = None,
        min_ms: float = MIN_TIMED_MS,
        extra_ms: float = EXTRA_MS,
    ) -> None:
        if runs < 1 or warmup < 0:
            raise ValueError("kernel timing needs at least one run and no negative warm-up")
        self.path = path
        self.runs, self.warmup, self.threads = runs, warmup, threads
        self.min_ms, self.extra_ms = min_ms, extra_ms
        self.clock = clock or _default_clock
        self.session_factory = session_factory or timed_session
        self.table: dict[str, float] = {}
        self.measured = 0
        """Kernel timings made by this object (the others came from the cache)."""
        self.waited: float | None = None
        """The share of this process's CPUs other processes used while it timed, over all the
        shapes it timed (see :class:`~onnx_conv2matmul.speed.machine.CpuWait`); None: nothing
        timed, or not known."""
        self._others = self._capacity = 0.0
        self._timed: set[str] = set()
        """The entries this object timed: not written to the cache when it timed them busy."""
        self._confirmed: set[str] = set()
        """The entries :meth:`confirm` timed a second time."""
        self.from_cache = 0
        self._saved = 0
        """``measured`` when the table was last written: a save with nothing new writes nothing."""
        if path is not None and read_cache:
            self.table.update(_read(path))

    @staticmethod
    def entry(k: int, n: int, kernel: Kernel, rows: int) -> str:
        return f"{kernel.key}:{k}x{n}:{rows}"

    def cost(self, k: int, n: int, kernel: Kernel, rows: int) -> float:
        """Milliseconds of ``kernel`` on an activation ``[rows, k]`` and a weight ``[k, n]``."""
        key = self.entry(k, n, kernel, rows)
        if key not in self.table:
            self.measure(k, n, kernel, [rows])
        else:
            self.from_cache += 1
        return self.table[key]

    def measure(self, k: int, n: int, kernel: Kernel, rows: Sequence[int]) -> None:
        """Time ``kernel`` at shape ``k x n`` at each row count not known yet."""
        self.measure_shape(k, n, [kernel], rows)

    def measure_shape(self, k: int, n: int, kernels: Sequence[Kernel], rows: Sequence[int]) -> None:
        """Time the ``kernels`` at shape ``k x n``, at each row count, where not known yet: one
        small session per kernel, the kernels' runs interleaved round by round (in an order that
        rotates), so that a change in the machine's load hits them all alike."""
        todo = [
            kernel
            for kernel in dict.fromkeys(kernels)
            if any(self.entry(k, n, kernel, r) not in self.table for r in rows)
        ]
        if not todo:
            return
        counts = sorted(set(rows))
        with tempfile.TemporaryDirectory(prefix="kernel-cost-") as workdir:
            sessions = []
            for kernel in todo:
                path = os.path.join(workdir, f"{kernel.key}-{k}x{n}.onnx")
                with open(path, "wb") as file:
                    file.write(kernel_model(k, n, kernel).SerializeToString())
                session = self.session_factory(path, self.threads)
                sessions.append((kernel, session, session.get_inputs()[0].name))
            wait = CpuWait(enabled=self.clock is REAL_CLOCK)
            with wait:
                measured = self._time_rounds(todo, sessions, counts, (k, n))
            if wait.capacity > 0:  # added up raw, clipped once (short blocks read nothing alone)
                self._others += wait.others
                self._capacity += wait.capacity
                self.waited = CpuWait.share_of(self._others, self._capacity)
            for key, value in measured.items():
                if key not in self.table:
                    self.table[key] = value
                    self.measured += 1
                    self._timed.add(key)
            del sessions

    @property
    def busy(self) -> bool:
        """Whether some timing of this object was taken on a busy machine (see
        :data:`~onnx_conv2matmul.speed.machine.BUSY_WAIT_SHARE`): its timings choose nothing."""
        return is_busy(self.waited)

    def _time_rounds(
        self, todo: Sequence[Kernel], sessions: Sequence[Any], counts: Sequence[int], shape: tuple[int, int]
    ) -> dict[str, float]:
        """The fastest run of each kernel at each row count, the kernels' runs interleaved round
        by round in a rotating order; keyed as :meth:`entry`."""
        k, n = shape
        rng = np.random.default_rng(0)
        found: dict[str, float] = {}
        for count in counts:
            timed = timed_rows(k, n, count)
            x = rng.standard_normal((timed, k)).astype(np.float32)
            samples: dict[Kernel, list[float]] = {kernel: [] for kernel in todo}
            last: list[float] = []  # the last warm-up run of each kernel, in milliseconds
            for _ in range(self.warmup):
                last = []
                for _, session, name in sessions:
                    start = self.clock()
                    session.run(None, {name: x})
                    last.append((self.clock() - start) * 1000)
            runs = self.runs
            if last and self.min_ms > 0:
                shortest, round_ms = max(min(last), 1e-6), max(sum(last), 1e-6)
                runs = max(runs, min(MAX_RUNS, math.ceil(self.min_ms / shortest)))
                runs = min(runs, self.runs + max(0, int(self.extra_ms / round_ms)))
                self.extra_ms -= (runs - self.runs) * round_ms
            for round_index in range(runs):
                shift = round_index % len(sessions)
                for kernel, session, name in [*sessions[shift:], *sessions[:shift]]:
                    start = self.clock()
                    session.run(None, {name: x})
                    samples[kernel].append((self.clock() - start) * 1000)
            for kernel in todo:
                found[self.entry(k, n, kernel, count)] = float(min(samples[kernel])) * count / timed
        return found

    def confirm(self, layers: Iterable[Layer], kernels: Sequence[Kernel]) -> int:
        """Time again, in fresh sessions (each for ``min_ms`` while ``extra_ms`` lasts), the
        ``kernels`` at the shapes and rows of ``layers`` that this object timed once (entries read
        from the cache are left: they were confirmed when they mattered), keeping the faster of the
        two timings of each; how many entries.

        A decision that refuses a kernel for being slower than float must hold on a second
        timing: the kernels of a small model take microseconds, and two cold runs, each the
        fastest of :data:`DEFAULT_RUNS`, put one 8-bit kernel at 1.13x and 0.96x float's."""
        todo: dict[tuple[int, int], tuple[set[Kernel], set[int]]] = {}
        for layer in layers:
            for kernel in kernels:
                keys = [self.entry(layer.k, layer.n, kernel, r) for r in layer.rows]
                if any(key in self._timed and key not in self._confirmed for key in keys):
                    found, rows = todo.setdefault((layer.k, layer.n), (set(), set()))
                    found.add(kernel)
                    rows.update(layer.rows)
        count = 0
        for (k, n), (found, rows) in todo.items():
            first = {}
            for kernel in found:
                for r in rows:
                    key = self.entry(k, n, kernel, r)
                    if key in self._timed and key not in self._confirmed and key in self.table:
                        first[key] = self.table.pop(key)
            self.measure_shape(k, n, sorted(found, key=lambda x: x.key), sorted(rows))
            for key, value in first.items():
                self.table[key] = min(value, self.table.get(key, value))
                self._confirmed.add(key)
                count += 1
        return count

    def prefetch(self, layers: Iterable[Layer], kernels: Sequence[Kernel]) -> None:
        """Measure every kernel at every shape and row count of ``layers`` not known yet, the
        kernels of one shape interleaved (:meth:`measure_shape`)."""
        shapes: dict[tuple[int, int], set[int]] = {}
        for layer in layers:
            shapes.setdefault((layer.k, layer.n), set()).update(layer.rows)
        for (k, n), rows in shapes.items():
            self.measure_shape(k, n, kernels, sorted(rows))

    def save(self) -> None:
        """Write the table to the cache file when this object timed something since it last did (no
        error when it cannot be written: a cache). The default run's speed filter asks after each
        layer: on the Parakeet-shaped encoder, writing the whole table 266 times cost 8 s."""
        if self.path is None or self.measured == self._saved:
            return
        self._saved = self.measured
        # Timed on a busy machine (over all the shapes timed): used by this run, never kept.
        table = {key: value for key, value in self.table.items() if not (self.busy and key in self._timed)}
        keep_cached(self.path, {"version": CACHE_VERSION, "costs": table}, indent=0, sort_keys=True)


def timed_rows(k: int, n: int, rows: int) -> int:
    """The rows a kernel of weight ``k x n`` is timed at for ``rows`` (see :data:`MAX_TIMED_VALUES`)."""
    return max(1, min(rows, MAX_TIMED_VALUES // max(k, n, 1)))


def now_text() -> str:
    """The time a figure is kept in the cache, as the notes that read it back show it."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def keep_cached(path: str, data: Any, **dump: Any) -> None:
    """Write ``data`` as JSON to the cache file ``path``, renamed into place; no error when it
    cannot be written (a cache: the next run measures again)."""
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(data, file, **dump)
        os.replace(temporary, path)


def _read(path: str) -> dict[str, float]:
    """The costs a cache file holds (nothing when it is missing, unreadable or of another version)."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    costs = data.get("costs")
    if not isinstance(costs, dict):
        return {}
    return {str(k): float(v) for k, v in costs.items() if isinstance(v, int | float) and math.isfinite(v)}


def kernel_model(k: int, n: int, kernel: Kernel) -> Any:
    """A model of one node: ``y = x @ W`` with ``x [rows, k]``, as float MatMul or MatMulNBits
    (random weights, symmetric: no zero points)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    opsets = [helper.make_opsetid("", 17)]
    if kernel.bits is None:
        weight = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")
        nodes = [helper.make_node("MatMul", ["x", "W"], ["y"])]
        initializers = [weight]
    else:
        blocks = -(-k // kernel.block_size)
        blob = kernel.block_size * kernel.bits // 8
        packed = rng.integers(0, 256, size=(n, blocks, blob), dtype=np.uint8)
        scales = (rng.random(n * blocks, dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
        attributes: dict[str, Any] = {"K": k, "N": n, "bits": kernel.bits, "block_size": kernel.block_size}
        if kernel.accuracy_level:
            attributes["accuracy_level"] = kernel.accuracy_level
        inputs = ["x", "B", "scales"]
        node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", **attributes)
        nodes = [node]
        initializers = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    graph = helper.make_graph(nodes, "kernel", [x], [y], initializers)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def model_cost(
    costs: KernelCosts, layers: Iterable[Layer], kernels: Mapping[str, Kernel] | Kernel
) -> tuple[float, ...]:
    """Milliseconds of the layers' MatMuls at each length, each layer with its kernel
    (``kernels`` by layer name, a layer left out runs in float; or one kernel for all)."""
    totals: list[float] = []
    for layer in layers:
        kernel = kernels if isinstance(kernels, Kernel) else kernels.get(layer.name, FLOAT_KERNEL)
        costs.measure(layer.k, layer.n, kernel, layer.rows)
        values = [costs.cost(layer.k, layer.n, kernel, rows) for rows in layer.rows]
        if not totals:
            totals = [0.0] * len(values)
        totals = [t + v for t, v in zip(totals, values, strict=True)]
    return tuple(totals)


def relative(cost: Sequence[float], baseline: Sequence[float]) -> float:
    """The geometric mean over the lengths of ``cost / baseline`` (1.0 when there is nothing)."""
    ratios = [c / b for c, b in zip(cost, baseline, strict=True) if b > 0 and c > 0]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 1.0
