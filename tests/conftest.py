"""Hypothesis profiles for the property tests, and fixtures shared by the test files.

``default``: what CI runs, about a minute of property tests on 2 cores.
``large``: 20 times the examples, to run by hand::

    HYPOTHESIS_PROFILE=large python -m pytest -q tests/test_properties.py tests/test_layout.py

``mutation``: a tenth of the default examples, derandomized, for mutation runs.

No profile has a deadline or the too-slow health check: no test depends on how fast
the machine is. Property tests size their runs with ``helpers.examples``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("large", settings.get_profile("default"), max_examples=2000)
# ``mutation``: scripts/mutation.sh (docs/mutation.md) runs the covering tests once per mutant;
# a few fixed examples keep that affordable and make every run draw the same ones.
settings.register_profile(
    "mutation", settings.get_profile("default"), max_examples=10, derandomize=True, database=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test of a trained model from a registry package (``network``) is also ``slow``: the
    default run leaves it out, ``-m slow`` runs it (before ``-m``'s selection: tryfirst)."""
    for item in items:
        if item.get_closest_marker("network") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process during the test, as in a terminal.

    A test run started in the background (``pytest ... &``, ``nohup``) ignores SIGINT; a test
    that interrupts its own process needs the disposition a terminal gives.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def kernel_cost_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kernel costs (kept under ``$XDG_CACHE_HOME``) go to a folder of this test session, never
    the user's cache: a test sees only what the session measured."""
    folder = tmp_path_factory.getbasetemp() / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    return folder


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine reads as quiet while anything is timed (see speed/machine.CpuWait): a test of
    what a quiet machine does (the kernel costs cached, a timing that decides) does not depend on
    the load the other tests put on it."""
    from onnx_conv2matmul.speed import costs, machine, timing

    class Quiet(machine.CpuWait):
        def __exit__(self, *_: object) -> None:
            self.share, self.capacity = 0.0, 1.0

    monkeypatch.setattr(costs, "CpuWait", Quiet)
    monkeypatch.setattr(timing, "CpuWait", Quiet)
