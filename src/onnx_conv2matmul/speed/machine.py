"""The machine a timing runs on: the CPU's name, the memory available, the bytes of a model's files,
and whether the sessions to time fit in memory together."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Sequence

from onnx_conv2matmul.speed.latency import Mode

MEMORY_SHARE = 0.7
"""The share of the memory available that the sessions kept open together may take."""
SESSION_BYTES_PER_FILE_BYTE = 2
"""Estimated session memory per byte of model files (weights, plus a packed copy)."""


def cpu_name() -> str:
    """The CPU's model name as the system reports it (``model name`` in /proc/cpuinfo), and the
    number of CPUs this process may use."""
    name = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                name = value.strip()
                break
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 0
    return f"{name}, {count} CPUs"


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo, or None where the system does not say."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


LARGEST_SHARE = 1.2
"""By default the sessions open together may take this multiple of what the largest one needs: the
measurement never holds several times the original model in memory (so ``quantize``'s peak stays
near the model's size), whatever the number of candidates."""
SMALL_BUDGET_BYTES = 256 * 2**20
"""Below this, sessions are kept together whatever their number (small models are cheap to hold)."""


def default_budget(file_bytes: Sequence[int], available_bytes: int | None) -> int:
    """The memory the sessions open together may take when the caller sets none: a little more than
    the largest model's session (:data:`LARGEST_SHARE`), at least :data:`SMALL_BUDGET_BYTES`, and
    never more than a share (:data:`MEMORY_SHARE`) of what the system has available."""
    largest = SESSION_BYTES_PER_FILE_BYTE * max(file_bytes, default=0)
    budget = max(SMALL_BUDGET_BYTES, int(LARGEST_SHARE * largest))
    if available_bytes is not None:
        budget = min(budget, int(available_bytes * MEMORY_SHARE))
    return budget


def choose_mode(file_bytes: Sequence[int], budget_bytes: int | None) -> Mode:
    """Together when the estimated sessions fit in ``budget_bytes`` (None: no limit known)."""
    if budget_bytes is None:
        return Mode.TOGETHER
    needed = SESSION_BYTES_PER_FILE_BYTE * sum(file_bytes)
    return Mode.TOGETHER if needed <= budget_bytes else Mode.ONE_AT_A_TIME


def keeps_baseline(file_bytes: Sequence[int], baseline: int, budget_bytes: int) -> bool:
    """Timed one at a time, whether the baseline's session stays open through every round: it and
    the largest other model's fit in ``budget_bytes`` together. The Parakeet-shaped encoder's
    level candidates (2.3 GiB and twice 340 MiB) were timed in 56 s, 40 of them opening the
    original again in each of five rounds and once more to read its inputs."""
    others = [size for index, size in enumerate(file_bytes) if index != baseline]
    return SESSION_BYTES_PER_FILE_BYTE * (file_bytes[baseline] + max(others, default=0)) <= budget_bytes


BUSY_WAIT_SHARE = 0.2
"""Timings during which other processes used this share or more of the CPUs this process may
run on were taken on a busy machine: they do not choose anything (see :class:`CpuWait`). On a
2-core VM, while kernels were timed: 2-3% quiet, 41-44% with one busy loop beside, 64-75% with
two. Under such load a kernel that uses fewer threads looks faster than it is on a quiet machine
(PP-OCRv4 rec's MatMuls measured 1.04-1.08x float's at block 128 level 4 instead of 1.52x), and a
choice made on it flips with the load. (A thread's own run-queue wait is no such signal: on an
idle VM, waking a halted virtual CPU shows as wait, 40-60% of a short kernel timing.)"""


def _readings() -> tuple[float, float, int] | None:
    """CPU seconds the CPUs this process may run on spent busy so far (``/proc/stat``, steal
    included), CPU seconds this process used so far, and how many such CPUs; None where the
    system does not say."""
    try:
        cpus = os.sched_getaffinity(0)
        ticks = os.sysconf("SC_CLK_TCK")
        busy = 0
        with open("/proc/stat", encoding="ascii") as stat:
            for line in stat:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                values = [int(v) for v in fields[:8]]
                busy += sum(values) - values[3] - (values[4] if len(values) > 4 else 0)
    except (AttributeError, OSError, ValueError):
        return None
    own = os.times()
    return busy / ticks, own.user + own.system, len(cpus)


MIN_CAPACITY_S = 0.5
"""CPU seconds (wall time times the CPUs) a share of others' use must span to be known: the
counters tick at 10 ms, a few ticks off at each end, so a shorter span reads others at 10-20% on a
quiet machine (a small BERT's kernels, timed in 0.1 s, read busy in one cold run of two and chose
differently each time). Under it, the share is not known, so the timing is trusted."""


class CpuWait:
    """How much of the CPUs this process may run on other processes used while the block ran:
    their busy time (from ``/proc/stat``) minus this process's own, over the block's wall time
    times those CPUs. Near 0 on a quiet machine, whatever this process does; high when other
    processes take the CPUs. :attr:`share` is None where the system does not say (then the
    timing is trusted); :attr:`capacity` is the CPU seconds the block spanned and :attr:`others`
    the CPU seconds others used, not clipped (for adding up: see :meth:`share_of`)."""

    def __init__(self, enabled: bool = True) -> None:
        self.share: float | None = None
        self.capacity = 0.0
        self.others = 0.0
        self.enabled = enabled
        """False: nothing is measured (a timing on a fake clock says nothing of the machine)."""
        self._start: tuple[tuple[float, float, int], float] | None = None

    def __enter__(self) -> CpuWait:
        import time

        readings = _readings() if self.enabled else None
        self._start = None if readings is None else (readings, time.perf_counter())
        return self

    def __exit__(self, *_: object) -> None:
        import time

        if self._start is None:
            return
        end = _readings()
        if end is None:
            return
        (busy, own, cpus), started = self._start
        self.capacity = max(0.0, time.perf_counter() - started) * cpus
        if self.capacity > 0:
            self.others = (end[0] - busy) - (end[1] - own)
            self.share = self.share_of(self.others, self.capacity)

    @staticmethod
    def share_of(others: float, capacity: float) -> float | None:
        """Others' CPU seconds over the CPU seconds spanned, clipped to [0, 1]; None (not known)
        below :data:`MIN_CAPACITY_S`. Blocks are added up before this: both counts come in clock
        ticks (10 ms), so a block of a few milliseconds reads 0 or a whole tick by chance, and
        clipping each block keeps the chance highs and drops the chance lows (a quiet machine read
        6-24% busy summed clipped, -1% to -4% raw)."""
        if capacity < MIN_CAPACITY_S:
            return None
        return min(1.0, max(0.0, others / capacity))

    @property
    def busy(self) -> bool:
        return is_busy(self.share)


def is_busy(share: float | None) -> bool:
    """Whether timings taken while other processes used ``share`` of this process's CPUs were
    taken on a busy machine (:data:`BUSY_WAIT_SHARE`; None: not known, so not busy). The rule's
    one place."""
    return share is not None and share >= BUSY_WAIT_SHARE


def busy_text(share: float) -> str:
    """Why timings were not trusted, in words (``share``: :attr:`CpuWait.share`)."""
    return (
        f"the machine was busy while it timed (other processes used {share:.0%} of the CPUs this one"
        f" runs on, {BUSY_WAIT_SHARE:.0%} or more is busy)"
    )
