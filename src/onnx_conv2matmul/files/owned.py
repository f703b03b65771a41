"""A mark that proves a folder is this tool's, so that it is removed or replaced by proof, not by name.

Every directory the tool makes for itself (a staging or scratch directory beside an output, see
:mod:`onnx_conv2matmul.files.publish`, and the folder a failed output is kept in) holds a hidden
file :data:`MARK` written right after the directory was made: this tool's name and a run id, and,
for a folder handed to the user, the files it holds with their sizes. The recovery of a killed
run removes a hidden directory whose name looks like a staging directory only when it holds the
mark; a kept folder is replaced only when the mark names every entry in it, unchanged. A folder
of the same name that the user made is left alone, whatever it holds.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from typing import Any

MARK = ".onnx-conv2matmul-owned"
TOOL = "onnx-conv2matmul"


def mark(folder: str, *, files: bool = False) -> None:
    """Write the mark into ``folder``; with ``files``, list the files it holds (with sizes)."""
    data: dict[str, Any] = {"tool": TOOL, "run": uuid.uuid4().hex}
    if files:
        data["files"] = {
            name: os.path.getsize(os.path.join(folder, name))
            for name in sorted(os.listdir(folder))
            if name != MARK and os.path.isfile(os.path.join(folder, name))
        }
    path = os.path.join(folder, MARK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def _read(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, MARK)
    try:
        if os.path.islink(folder) or not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("tool") != TOOL or not data.get("run"):
        return None
    return data


def is_marked(folder: str) -> bool:
    """Whether ``folder`` (not a link) holds this tool's mark: a directory the tool made."""
    return _read(folder) is not None


def foreign_entries(folder: str) -> list[str] | None:
    """What in ``folder`` its mark does not account for (a file not listed, of another size, or
    anything that is not a regular file); None when it holds no mark with a file list."""
    data = _read(folder)
    files = None if data is None else data.get("files")
    if not isinstance(files, dict):
        return None
    odd = []
    for name in sorted(os.listdir(folder)):
        if name == MARK:
            continue
        path = os.path.join(folder, name)
        if files.get(name) != os.lstat(path).st_size or not stat.S_ISREG(os.lstat(path).st_mode):
            odd.append(name)
    return odd
