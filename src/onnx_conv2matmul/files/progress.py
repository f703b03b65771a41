"""Progress of long steps, as the library reports it: a protocol the caller implements (the
command line draws a bar), silent by default."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives progress of long steps (the CLI draws it; the API is silent by default)."""

    def phase(self, name: str) -> None: ...

    def advance(self, done: int, total: int) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    def phase(self, name: str) -> None:
        pass

    def advance(self, done: int, total: int) -> None:
        pass

    def close(self) -> None:
        pass
