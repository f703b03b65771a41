"""Reading model files (their paths checked first, by :mod:`onnx_conv2matmul.files.checks`).

Loading parses only the ``.onnx`` protobuf; external data stays on disk and is
memory-mapped by onnx-ir when a tensor is read. Writing is :mod:`onnx_conv2matmul.files.output`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import onnx
from google.protobuf.message import DecodeError

from onnx_conv2matmul.errors import CheckerError, Hint, InputError
from onnx_conv2matmul.files.checks import check_input_path, written_through
from onnx_conv2matmul.files.checks import check_paths as check_paths  # imported from here by quantize/
from onnx_conv2matmul.files.modes import usual_mode
from onnx_conv2matmul.files.paths import contained_location, model_tensors

if TYPE_CHECKING:  # imported where used: loading parses and starts the copy before importing onnx-ir
    from typing import Protocol

    import onnx_ir as ir

    from onnx_conv2matmul.files.progress import Progress

    class Prefetcher(Protocol):
        """What :func:`load_input` asks of the output being written (an
        :class:`onnx_conv2matmul.files.output.Output`; naming it here would close a circle)."""

        def prefetch(self, proto: onnx.ModelProto, base_dir: str) -> None: ...

        def protect(self, paths: list[str]) -> None: ...


# Above this size a single-file model cannot be serialized (protobuf limit is 2 GiB).
SINGLE_FILE_LIMIT_BYTES = 1_900_000_000


@dataclasses.dataclass
class LoadedModel:
    model: ir.Model
    path: str
    external_files: list[str]
    total_bytes: int
    linked_files: list[str] = dataclasses.field(default_factory=list)
    """External data files named beside the model that are links into the store the model file
    itself links into (a Hugging Face cache): read where they land (see :func:`build_model`).
    The ONNX checker refuses such data, so :func:`load_input` does not run it on the input."""

    @property
    def checker_applies(self) -> bool:
        """Whether the ONNX checker can check the input (it refuses linked data, wherever it lands)."""
        return not self.linked_files

    @property
    def linked_note(self) -> str | None:
        """What the report says of linked data (None: there is none)."""
        if not self.linked_files:
            return None
        return (
            f"{len(self.linked_files)} external data file(s) of the input are links into the store"
            " its .onnx links into (a Hugging Face cache): read where they land; the ONNX checker,"
            " which refuses linked data, ran on the output only"
        )

    @property
    def has_external_data(self) -> bool:
        return bool(self.external_files)


def _iter_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    from onnx_conv2matmul._graphs import tensor_holders

    return (holder.get() for holder in tensor_holders(model))


def parse_model(path: str) -> onnx.ModelProto:
    """Parse the ``.onnx`` at ``path`` without reading external data.

    Raises:
        InputError: missing, empty, truncated or non-ONNX file.
    """
    check_input_path(path)
    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as err:
        raise InputError(f"not a valid ONNX file (cannot be parsed): {path}") from err
    except Exception as err:  # protobuf raises assorted errors on garbage
        raise InputError(f"not a valid ONNX file (cannot be parsed): {path}") from err
    if not proto.HasField("graph") or proto.ir_version <= 0 or not proto.opset_import:
        raise InputError(f"not a valid ONNX file (no graph, IR version or opset; truncated?): {path}")
    return proto


def load_model(path: str) -> LoadedModel:
    """Parse ``path`` and build its graph (see :func:`build_model`)."""
    return build_model(parse_model(path), path)


def build_model(proto: onnx.ModelProto, path: str) -> LoadedModel:
    """Build the graph of ``proto``, parsed from ``path``; check its external data without
    reading it. ``proto`` is consumed: the graph takes its tensors.

    Raises:
        InputError: an invalid model; missing, unreadable or short external data, or
            external data outside the model's directory.
    """
    base_dir = os.path.dirname(os.path.abspath(path))
    import onnx_ir as ir

    from onnx_conv2matmul._graphs import is_external, tensor_holders

    home = os.path.dirname(os.path.realpath(path)) if os.path.islink(path) else None

    _check_tensor_data(proto, path)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as err:
        raise InputError(f"not a valid ONNX model ({err.__class__.__name__}: {err}): {path}") from err
    del proto
    external: dict[str, int] = {}
    linked: set[str] = set()
    for holder in tensor_holders(model):
        tensor = holder.get()
        if not is_external(tensor):
            continue
        tensor.base_dir = base_dir  # what ir.external_data.set_base_dir does, without its slow type checks
        location = contained_location(base_dir, str(tensor.location), home)
        if location is not None and home is not None and os.path.dirname(location) == home != base_dir:
            # A link into the model's store: read where it lands (onnx-ir reads no link that
            # leaves the directory it is given).
            linked.add(os.path.join(base_dir, str(tensor.location)))
            tensor = _rehomed(tensor, location)
            holder.set(tensor)
        if location is None:
            raise InputError(
                f"external data location {str(tensor.location)!r} of tensor {tensor.name!r}"
                f" is outside the model's directory: {path}"
            )
        if location not in external:
            if not os.path.isfile(location):
                raise InputError(f"external data file not found: {location} (needed by {path})")
            if not os.access(location, os.R_OK):
                raise InputError(f"external data file is not readable: {location}")
            external[location] = os.path.getsize(location)
        nbytes = int(tensor.nbytes)
        end = (tensor.offset or 0) + max(nbytes, tensor.length or 0)
        if end > external[location]:
            raise InputError(
                f"external data file is truncated: {location} has {external[location]} bytes,"
                f" tensor {tensor.name!r} needs {end}"
            )
        if tensor.length is not None and tensor.length != nbytes:
            shape = [int(d) for d in tensor.shape.numpy()]
            raise InputError(
                f"tensor {tensor.name!r} declares a length of {tensor.length} bytes in {location}"
                f" (its external_data 'length'), its shape {shape} and type {tensor.dtype.name}"
                f" take {nbytes}: {path}"
            )
    total = os.path.getsize(path) + sum(external.values())
    return LoadedModel(
        model=model,
        path=path,
        external_files=sorted(external),
        total_bytes=total,
        linked_files=sorted(linked),
    )


def _rehomed(tensor: Any, real: str) -> Any:
    """``tensor`` (an onnx-ir external tensor) read from the file ``real`` it reaches by a link."""
    import onnx_ir as ir

    return ir.ExternalTensor(
        os.path.basename(real),
        tensor.offset,
        tensor.length,
        tensor.dtype,
        shape=tensor.shape,
        name=tensor.name,
        doc_string=tensor.doc_string,
        base_dir=os.path.dirname(real),
    )


def _check_tensor_data(proto: onnx.ModelProto, path: str) -> None:
    """Refuse a tensor stored in the model whose data does not fit its shape and type.

    The ONNX checker refuses data that is too short (but not data that is too long), and
    only when it runs; a tensor read later would fail in the middle of the work.
    External data is checked against its file by :func:`build_model`.
    """
    import onnx_ir as ir

    for tensor in model_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue
        try:
            dtype = ir.DataType(tensor.data_type)
        except ValueError:
            continue  # an unknown type: the loader reports it
        count = math.prod(tensor.dims)
        if dtype == ir.DataType.STRING:
            field, have, need = "string_data", len(tensor.string_data), count
        elif dtype == ir.DataType.UNDEFINED:
            continue
        elif tensor.HasField("raw_data"):
            field, have, need = "raw_data", len(tensor.raw_data), -(-count * dtype.bitwidth // 8)
        else:
            try:
                field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
            except (KeyError, ValueError):
                continue  # a type onnx does not know how to store: the loader reports it
            have = len(getattr(tensor, field))
            if dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128):
                need = 2 * count
            elif dtype.bitwidth < 8:
                need = -(-count * dtype.bitwidth // 8)  # packed, a byte per value
            else:
                need = count
        if have != need or count < 0:
            unit = "bytes" if field == "raw_data" else "values"
            raise InputError(
                f"tensor {tensor.name!r} holds {have} {unit} of data ({field}), its shape"
                f" {list(tensor.dims)} and type {dtype.name} need {need}: {path}"
            )


def check_not_overwriting_inputs(loaded: LoadedModel, destination: str) -> None:
    """Refuse an output ``.onnx`` that is a file the input reads (its data file never
    takes an existing name, see :mod:`onnx_conv2matmul.files.publish`)."""
    targets = {os.path.realpath(destination)}
    inputs = {os.path.realpath(p) for p in loaded.external_files}
    if os.path.realpath(destination) != os.path.realpath(loaded.path):
        inputs.add(os.path.realpath(loaded.path))
    clash = sorted(targets & inputs)
    if clash:
        raise InputError(f"the output would overwrite a file the input model needs: {clash[0]}")


def tensor_bytes(model: ir.Model) -> int:
    return sum(int(t.nbytes) for t in _iter_tensors(model))


def write_text_atomic(path: str, text: str) -> None:
    """Write a text file (a report) that a reader never sees half written.

    A new path or a regular file gets a temporary file renamed into place. A symbolic link,
    a character device or a FIFO is written through instead (opened and written, never
    replaced): ``/dev/stdout``, ``/dev/null``, a pipe, or a link to the file meant; a FIFO
    waits for a reader.
    """
    if written_through(path):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        usual_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_checker(path: str, label: str | None = None) -> None:
    """Run the ONNX checker on a saved file; external data is not read."""
    try:
        onnx.checker.check_model(path)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid model"
        raise CheckerError(f"ONNX checker rejected {label or path}: {first}") from err


def load_input(
    src: str,
    dst: str,
    *,
    inplace: bool,
    run_checker: bool,
    progress: Progress,
    timings: dict[str, float],
    output: Prefetcher | None = None,
) -> LoadedModel:
    """Load the input and check it before any heavy work (shared by the commands that write).

    With ``output``, its data file starts copying as soon as the input is parsed.
    """
    start = time.perf_counter()
    progress.phase("Loading")
    proto = parse_model(src)
    if output is not None:
        output.prefetch(proto, os.path.dirname(os.path.abspath(src)))
    loaded = build_model(proto, src)
    del proto
    if not inplace:
        check_not_overwriting_inputs(loaded, dst)
        if output is not None:
            output.protect(loaded.external_files)
    timings["load"] = time.perf_counter() - start
    # The ONNX checker refuses external data behind a link, wherever it lands: for such an input
    # the loader's own checks (where each link lands, every tensor's bytes) stand, and the output
    # is checked (see LoadedModel.linked_note).
    if run_checker and loaded.checker_applies:
        progress.phase("Checking the input")
        start = time.perf_counter()
        try:
            check_model(src, "the input")
        except CheckerError as err:
            raise InputError(str(err), hint=Hint.SKIP_INPUT_CHECKER) from err
        timings["checker_input"] = time.perf_counter() - start
    return loaded


def check_model(path: str, label: str | None = None) -> None:
    """:func:`run_checker`, for :func:`load_input`, whose flag has that name."""
    run_checker(path, label)
