"""Checking the paths a command is given before any work: the model to read, the outputs and
reports to write, the folder a failed output is kept in; none may replace a file the run reads.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable

from onnx_conv2matmul.errors import Hint, InputError


def check_paths(input_path: str, output_path: str | None, *, inplace: bool) -> str:
    """Validate the paths before any heavy work; return the output path.

    Raises:
        InputError: a bad input or output path; an output path together with ``inplace``,
            none without it, or one that is the input.
    """
    check_input_path(input_path)
    if inplace and output_path is not None:
        raise InputError(
            "an output path and replacing the input in place cannot be used together",
            hint=Hint.OUTPUT_AND_INPLACE,
        )
    if not inplace and output_path is None:
        raise InputError("give an output path, or replace the input in place", hint=Hint.NO_OUTPUT)
    output = input_path if inplace else output_path
    assert output is not None
    if not inplace and os.path.abspath(output) == os.path.abspath(input_path):
        raise InputError("output is the input", hint=Hint.OUTPUT_IS_INPUT)
    check_text_name(output, what="output")
    check_output_path(output)
    check_replaceable(output + ".data", what="output data file")
    return output


def check_input_path(path: str, *, what: str = "input") -> None:
    """Refuse, before any work, a model path that cannot be read as a model.

    Raises:
        InputError: an empty path, a name that is not valid UTF-8 (see
            :func:`check_text_name`), a missing, unreadable or empty file, a directory.
    """
    if not path:
        raise InputError(f"{what} path is empty")
    check_text_name(path, what=what)
    if not os.path.exists(path):
        raise InputError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise InputError(f"{what} is a directory, not an ONNX file: {path}")
    if not os.access(path, os.R_OK):
        raise InputError(f"{what} is not readable: {path}")
    if os.path.getsize(path) == 0:
        raise InputError(f"{what} is empty: {path}")


def check_text_name(path: str, *, what: str = "input") -> None:
    """Refuse a model path whose name (or its directory's, from the working directory on)
    is not valid UTF-8.

    Such a name reaches Python with its undecodable bytes as surrogates (``os.fsdecode``);
    onnx's checker, onnxruntime and the data-file locations stored in a model take text
    only, so the model could not be checked, run or written.
    """
    full = os.path.abspath(path)
    try:
        full.encode("utf-8")
    except UnicodeEncodeError:
        shown = full.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise InputError(
            f"{what} path is not valid UTF-8: {shown} (onnx and onnxruntime take UTF-8 file names only;"
            " rename the file or its directory)"
        ) from None


def check_output_path(path: str, *, what: str = "output") -> None:
    """Refuse, before any work, a path that a new file cannot be renamed onto.

    Raises:
        InputError: an empty path, one ending in ``/`` (a directory's name), a missing or
            unwritable directory, an existing directory, an existing file that is not
            writable, or anything existing that is not a regular file (a device, FIFO or
            socket, a link to one, or a file descriptor such as ``/dev/stdout``): renaming
            onto it would replace it instead of writing to it.
    """
    _check_path_text(path, what)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{what} directory does not exist: {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InputError(f"{what} directory is not writable: {directory}")
    if os.path.isdir(path):
        raise InputError(f"{what} is a directory: {path}")
    check_replaceable(path, what=what)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise InputError(f"{what} exists and is not writable: {path}")


def check_replaceable(path: str, *, what: str = "output") -> None:
    """Refuse an existing ``path`` that is not a regular file (see :func:`check_output_path`).

    A missing path or a broken link passes: there is nothing to replace.
    """
    if not os.path.exists(path):
        return
    if not stat.S_ISREG(os.stat(path).st_mode) or _leads_into_proc(path):
        raise InputError(
            f"{what} is not a regular file: {path} (a device, FIFO or socket, or a link to one"
            " or to a file descriptor; it would be replaced, not written to)"
        )


def check_report_path(path: str, *, what: str = "report") -> None:
    """Refuse, before any work, a report path :func:`write_text_atomic` cannot write.

    A symbolic link, a character device or a FIFO is written through, so it must lead to
    a writable regular file, character device or FIFO (not a directory, a block device or
    a socket); any other path must pass :func:`check_output_path`. ``what`` names the file in
    messages.
    """
    _check_path_text(path, what)
    if not written_through(path):
        check_output_path(path, what=what)
        return
    if not os.path.exists(path):
        raise InputError(f"{what} is a broken symbolic link: {path}")
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise InputError(f"{what} is a directory: {path}")
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        raise InputError(f"{what} is not a regular file, a character device or a FIFO: {path}")
    if not os.access(path, os.W_OK):
        raise InputError(f"{what} exists and is not writable: {path}")


def check_kept_path(path: str) -> None:
    """Refuse a destination for a failed output (``keep_on_failure``) that is not a directory.

    A failed output is moved to directory ``path``; a directory already there is replaced
    only when this tool kept a failed output there and nothing in it changed (see
    :mod:`onnx_conv2matmul.files.owned`); anything else (a file, a link, a folder of the
    user's) is refused before any work.
    """
    if os.path.islink(path):
        raise InputError(
            f"cannot keep a failed output in {path}: it is a symbolic link, not a directory",
            hint=Hint.KEPT_PATH,
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(
            f"cannot keep a failed output in {path}: it exists and is not a directory", hint=Hint.KEPT_PATH
        )
    if os.path.isdir(path):
        from onnx_conv2matmul.files.owned import foreign_entries

        odd = foreign_entries(path)
        if odd is None or odd:
            why = f"it holds {', '.join(odd[:3])}" if odd else "it is a folder this tool did not keep there"
            raise InputError(f"cannot keep a failed output in {path}: {why}", hint=Hint.KEPT_PATH)


def _check_path_text(path: str, what: str) -> None:
    if not path:
        raise InputError(f"{what} path is empty")
    if path.endswith(("/", os.sep)):
        if os.path.isdir(path):
            raise InputError(f"{what} is a directory: {path}")
        raise InputError(f"{what} path ends with '/', the name of a directory: {path}")


def written_through(path: str) -> bool:
    """Whether :func:`write_text_atomic` writes into ``path`` instead of replacing it."""
    if os.path.islink(path):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _leads_into_proc(path: str) -> bool:
    """Whether ``path`` or a link on its way leads into /proc.

    ``/dev/stdout`` and ``/dev/fd/1`` lead to ``/proc/self/fd/1``: a descriptor of this
    process, which looks like a regular file when the output is redirected to one.
    """
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's limit on links followed
        directory = os.path.realpath(os.path.dirname(current))
        if _in_proc(directory):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.normpath(os.path.join(directory, os.readlink(current)))
        if _in_proc(current):
            return True
    return False


def _in_proc(path: str) -> bool:
    return path == "/proc" or path.startswith("/proc/")


def files_of(paths: Iterable[str]) -> set[str]:
    """The real paths of ``paths`` and, for a directory among them, of the entries in it: the
    files a run reads besides its models (``--inputs`` files or folders, a settings file, the
    file of a validation function)."""
    found: set[str] = set()
    for path in paths:
        found.add(os.path.realpath(path))
        if os.path.isdir(path):
            with contextlib.suppress(OSError):
                found.update(os.path.realpath(os.path.join(path, name)) for name in os.listdir(path))
    return found


def check_not_read(path: str, read: Iterable[str], *, what: str) -> None:
    """Refuse, before any work, an output path that is one of the files the run reads (see
    :func:`files_of`): writing it would replace the run's own input."""
    if os.path.realpath(path) in files_of(read):
        raise InputError(f"the {what} would overwrite a file this run reads: {path}")


def fingerprint(path: str) -> tuple[int, ...] | None:
    """What tells whether the file at ``path`` (not a link's target) changed: device, inode,
    size, modification and change times; None when there is nothing there. A write, a
    truncation, a replacement or a ``chmod`` changes the change time, which no program can set
    back."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_not_a_data_name(path: str, output: str, what: str) -> None:
    """Refuse ``path`` when it names a data file ``output`` may be given (``<name>.data``, or
    ``<name>.N.data`` when that name is taken when the output is written): the report would
    overwrite the weights, or they would overwrite it."""
    import re

    directory, name = os.path.split(os.path.abspath(path))
    out_directory, out_name = os.path.split(os.path.abspath(output))
    if os.path.realpath(directory) != os.path.realpath(out_directory):
        return
    if re.fullmatch(rf"{re.escape(out_name)}(\.\d+)?\.data", name):
        raise InputError(
            f"the {what} would take a name the output's data file may be given ({out_name}.data,"
            f" {out_name}.N.data): {path}"
        )


def check_report_target(
    report_path: str,
    *,
    inputs: list[str],
    outputs: list[str],
    what: str = "report",
    read: Iterable[str] = (),
) -> None:
    """Refuse, before any work, a JSON report path that cannot be written or would replace a
    model file: an input, a file an input reads (its external data, however named), or an
    output being written (with its ``.data``); or any other file the run reads (``read``, see
    :func:`check_not_read`).

    The inputs are parsed (one protobuf parse each, no tensor data) only when the report
    path is an existing regular file: nothing else can be a file a model reads. ``what`` names
    the file in messages (another JSON file written the same way, e.g. a settings file).
    """
    check_report_path(report_path, what=what)
    protected = {os.path.realpath(p) for p in inputs}
    for out in outputs:
        protected.update({os.path.realpath(out), os.path.realpath(out + ".data")})
    for path in inputs:
        protected.add(os.path.realpath(path + ".data"))
    target = os.path.realpath(report_path)
    if target not in protected and os.path.isfile(report_path):
        from onnx_conv2matmul.files.paths import files_read_by

        for path in inputs:
            protected |= files_read_by(path)
    if target in protected:
        raise InputError(f"the {what} would overwrite a model file: {report_path}")
    for out in outputs:
        _check_not_a_data_name(report_path, out, what)
    check_not_read(report_path, read, what=what)
