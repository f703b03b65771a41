"""Real files on this machine as the inputs of a file-type classifier (Magika's features).

Magika reads the first and last block of a file (4096 bytes), strips the whitespace at the
start of the first and at the end of the last, and keeps 1024 bytes of each, padded with the
token 256: ``bytes int32 [2048]`` per file. The files are those of the Python installation and
the system's shared data, in an order fixed by a seed, so the same set is drawn on every run.
"""

from __future__ import annotations

import os
import random
import sys
import sysconfig
from pathlib import Path

import numpy as np

BLOCK = 4096
HALF = 1024
PAD = 256


def features(path: Path) -> np.ndarray:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(BLOCK)
        handle.seek(max(0, size - BLOCK))
        tail = handle.read(BLOCK)
    beg = list(head.lstrip()[:HALF])
    end = list(tail.rstrip()[-HALF:]) if tail.rstrip() else []
    return np.array(beg + [PAD] * (HALF - len(beg)) + [PAD] * (HALF - len(end)) + end, np.int32)


def machine_files(count: int, seed: int = 0) -> list[Path]:
    """``count`` readable regular files of at least 8 bytes, of many kinds, in a fixed order."""
    roots = {sysconfig.get_paths()["stdlib"], sys.prefix, "/usr/share", "/etc", "/usr/include"}
    found: list[Path] = []
    for root in sorted(roots):
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder, name)
                try:
                    if path.is_file() and not path.is_symlink() and path.stat().st_size >= 8:
                        found.append(path)
                except OSError:
                    continue
    found = sorted(set(found))
    random.Random(seed).shuffle(found)
    readable = []
    for path in found:
        if os.access(path, os.R_OK):
            readable.append(path)
        if len(readable) == count:
            break
    return readable


def file_features(count: int, seed: int = 0) -> np.ndarray:
    return np.stack([features(path) for path in machine_files(count, seed)])
