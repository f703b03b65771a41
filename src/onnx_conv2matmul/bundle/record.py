"""What proves a folder is a bundle this tool wrote, so that replacing it deletes nothing else.

A bundle's ``manifest.json`` holds a record of the run that wrote it (:func:`record`): this
tool's name, a run id, and every other file of the folder with its size. An output folder that
exists is replaced only when it is empty, or when its record names every entry it holds, each
a regular file of the recorded size (:func:`refuse_unless_ours`). A file the user added, a
subfolder, a link, a file that changed size since, or a ``manifest.json`` without the record
(another tool's, or a bundle of an older version) makes the run stop before any work: the tool
deletes only what it can prove it wrote, never by a file name alone.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from typing import Any

from onnx_conv2matmul.bundle.layouts import MANIFEST
from onnx_conv2matmul.errors import InputError

TOOL = "onnx-conv2matmul"
KEY = "written"
"""The manifest's key for the record: ``{"tool", "run", "files": {name: bytes}}``."""


def record(folder: str) -> dict[str, Any]:
    """The record of a bundle staged in ``folder``: its files (hidden ones and the manifest
    aside, which :func:`refuse_unless_ours` counts itself) with their sizes, and a new run id."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") or name == MANIFEST or not os.path.isfile(path):
            continue
        files[name] = os.path.getsize(path)
    return {"tool": TOOL, "run": uuid.uuid4().hex, "files": files}


def _recorded(folder: str) -> dict[str, int] | str:
    """The files the folder's record names, or why there is no record to trust."""
    path = os.path.join(folder, MANIFEST)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return f"its {MANIFEST} is not a regular file"
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return f"it holds no {MANIFEST}"
    except (OSError, ValueError, RecursionError) as err:
        return f"its {MANIFEST} cannot be read ({type(err).__name__})"
    found = data.get(KEY) if isinstance(data, dict) else None
    if not isinstance(found, dict) or found.get("tool") != TOOL or not found.get("run"):
        return f"its {MANIFEST} holds no record of a run of this tool"
    files = found.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()
    ):
        return f"its {MANIFEST}'s record is damaged"
    return files


def refuse_unless_ours(folder: str) -> None:
    """Raise :class:`InputError` unless ``folder`` (an existing directory) is empty or a bundle
    this tool wrote, unchanged in its entries (see the module docstring)."""
    entries = sorted(os.listdir(folder))
    if not entries:
        return
    files = _recorded(folder)
    why = files if isinstance(files, str) else _foreign(folder, entries, files)
    if why:
        raise InputError(
            f"output folder {folder} is not a bundle this tool wrote, or it changed since: {why};"
            " nothing was deleted: remove it yourself or choose another folder"
        )


def _foreign(folder: str, entries: list[str], files: dict[str, int]) -> str:
    """What in ``folder`` its record does not account for ("" when everything)."""
    odd = []
    for name in entries:
        path = os.path.join(folder, name)
        mode = os.lstat(path).st_mode
        if name == MANIFEST:
            continue
        if name not in files or not stat.S_ISREG(mode) or os.path.getsize(path) != files[name]:
            odd.append(name + ("/" if stat.S_ISDIR(mode) else ""))
    if not odd:
        return ""
    shown = ", ".join(odd[:3]) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")
    return f"it holds what the tool did not write there: {shown}"
