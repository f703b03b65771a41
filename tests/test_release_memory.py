"""``release_freed_memory``: a full collection only when the resident memory grew enough for one
to give back an amount that matters, and then what a reference cycle held really goes."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from onnx_conv2matmul.verify import run as runs

MIB = 1 << 20


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each full collection ``release_freed_memory`` makes, counted."""
    made: list[int] = []
    real = gc.collect

    def counted(*args: int) -> int:
        made.append(1)
        return real(*args)

    monkeypatch.setattr(runs.gc, "collect", counted)
    monkeypatch.setattr(runs, "_low_water", None)
    return made


def test_collects_only_after_the_resident_memory_grew(
    collections: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    resident = [400 * MIB]
    monkeypatch.setattr(runs, "resident_bytes", lambda: resident[0])
    runs.release_freed_memory()  # the first call sets the low water mark
    assert len(collections) == 1
    for now in (450, 655, 300, 555):  # below the lowest point seen + 256 MiB
        resident[0] = now * MIB
        runs.release_freed_memory()
    assert len(collections) == 1
    resident[0] = 556 * MIB  # 300 + 256: the drop to 300 MiB counts as the new low
    runs.release_freed_memory()
    assert len(collections) == 2


def test_always_collects_below_the_threshold_and_sets_the_low_water_mark(
    collections: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the Transposes' trade opens its three timing sessions: a collection whatever the
    growth, after which the lowest point is where it left the memory."""
    resident = [400 * MIB]
    monkeypatch.setattr(runs, "resident_bytes", lambda: resident[0])
    runs.release_freed_memory()
    resident[0] = 450 * MIB  # grown by less than 256 MiB: the default skips it
    runs.release_freed_memory()
    assert len(collections) == 1
    runs.release_freed_memory(always=True)
    assert len(collections) == 2 and runs._low_water == 450 * MIB


def test_collects_every_time_where_the_resident_memory_cannot_be_read(
    collections: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runs, "resident_bytes", lambda: None)
    for _ in range(3):
        runs.release_freed_memory()
    assert len(collections) == 3


@pytest.mark.skipif(runs.resident_bytes() is None, reason="no /proc/self/statm here")
def test_what_a_reference_cycle_held_is_given_back(collections: list[int]) -> None:
    runs.release_freed_memory()
    before = runs.resident_bytes()
    assert before is not None
    gc.disable()  # no automatic collection between the del and the reading
    try:
        holder: dict[str, object] = {"weights": np.ones(384 * MIB // 8)}  # 384 MiB, touched
        holder["self"] = holder  # a cycle: only a collection frees it
        del holder
        grown = runs.resident_bytes()
    finally:
        gc.enable()
    assert grown is not None and grown > before + 300 * MIB
    runs.release_freed_memory()
    after = runs.resident_bytes()
    assert after is not None and after < before + 64 * MIB
    assert len(collections) == 2
