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


BUSY_WAIT_SHARE = 0.2
"""Timings during which this process's threads waited for a CPU this share of their time or more
were taken on a busy machine: they do not choose anything (see :class:`CpuWait`). A quiet 2-core
machine measured 0-1% while one timed kernels; two busy loops beside it, 47-59%. Under such load a
kernel that uses fewer threads looks faster than it is on a quiet machine (PP-OCRv4 rec's MatMuls
measured 1.04-1.08x float's at block 128 level 4 instead of 1.52x), and a choice made on it flips
with the load."""


def _thread_times() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process: nanoseconds it ran and waited on a run queue so far (Linux's
    ``/proc/self/task/*/schedstat``); None where the system does not say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    found: dict[str, tuple[int, int]] = {}
    for task in tasks:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/self/task/{task}/schedstat") as stat:
            ran, waited, *_ = stat.read().split()
            found[task] = (int(ran), int(waited))
    return found or None


class CpuWait:
    """The share of time this process's threads spent waiting for a CPU while the block ran, from
    the scheduler's own statistics: near 0 on a quiet machine, whatever this process does, and
    high when other processes take the CPUs. :attr:`share` is None where the system does not say
    (then the timing is trusted, as before)."""

    def __init__(self, enabled: bool = True) -> None:
        self.share: float | None = None
        self.enabled = enabled
        """False: nothing is measured (a timing on a fake clock says nothing of the machine)."""
        self._start: dict[str, tuple[int, int]] | None = None

    def __enter__(self) -> CpuWait:
        self._start = _thread_times() if self.enabled else None
        return self

    def __exit__(self, *_: object) -> None:
        if self._start is None:
            return
        end = _thread_times()
        if end is None:
            return
        ran = waited = 0
        for task, (run_ns, wait_ns) in end.items():
            before = self._start.get(task, (0, 0))
            ran += max(0, run_ns - before[0])
            waited += max(0, wait_ns - before[1])
        if ran + waited > 0:
            self.share = waited / (ran + waited)

    @property
    def busy(self) -> bool:
        return is_busy(self.share)


def is_busy(share: float | None) -> bool:
    """Whether timings taken while this process waited for a CPU ``share`` of its time were taken
    on a busy machine (:data:`BUSY_WAIT_SHARE`; None: not known, so not busy). The rule's one place."""
    return share is not None and share >= BUSY_WAIT_SHARE


def busy_text(share: float) -> str:
    """Why timings were not trusted, in words (``share``: :attr:`CpuWait.share`)."""
    return (
        f"the machine was busy while it timed (this process waited for a CPU {share:.0%} of the time,"
        f" {BUSY_WAIT_SHARE:.0%} or more is busy)"
    )
