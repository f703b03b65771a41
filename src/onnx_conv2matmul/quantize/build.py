"""The build stage of the one quantize pass: a candidate made in memory and opened in onnxruntime
without writing it to disk.

:func:`build` loads the input (its weights memory-mapped), rewrites it and quantizes it with the
settings decided; :func:`open_in_memory` hands the result to onnxruntime as bytes. The weights
the file already holds stay where they are (onnxruntime reads them from the input's folder), and
the arrays made in memory (the packed MatMulNBits weights, transposed conv weights) are handed to
the session apart from the graph, so no candidate is serialised with its weights nor written whole.

onnxruntime copies what it is given as an external initializer. A session that prepacks its
weights lays them out anew anyway; one that does not (the classes' switched session, the classes
built apart) borrows them instead, as initializers shared with the caller, read where they lie:
on the Parakeet-shaped encoder the classes' session held 0.6 GB of such copies, the int4 blocks
(memory-mapped from the scratch folder) and the transposed conv weights, and this was the run's
peak of memory.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from onnx_conv2matmul.files.load import load_input
from onnx_conv2matmul.quantize.nbits import NBitsResult, quantize_matmul_nbits
from onnx_conv2matmul.rewrite.passes import rewrite_model

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.blockwise import BlockCache
    from onnx_conv2matmul.quantize.other_weights import OtherWeightsResult
    from onnx_conv2matmul.quantize.plan import QuantizePlan
    from onnx_conv2matmul.quantize.settings import QuantizeOptions

IN_MEMORY_MIN_BYTES = 1024
"""Arrays made in memory of at least this many bytes go to onnxruntime as external initializers
(the smaller ones are serialised with the graph)."""
FOLDER_KEY = "session.model_external_initializers_file_folder_path"
"""onnxruntime's session setting: where a model given as bytes finds its external data."""
_IN_MEMORY = "in-memory"
"""The location a tensor passed as an external initializer is given in the graph (never read)."""
_BORROWED = "."
"""The location a borrowed (shared) initializer is given in the graph: onnxruntime checks that it
exists (the folder itself does) and never reads it, as the caller's array replaces it."""


@dataclasses.dataclass
class Candidate:
    """A quantized model in memory and what its quantization did."""

    model: ir.Model
    options: QuantizeOptions
    result: NBitsResult
    other_weights: OtherWeightsResult | None


def load_rewritten(plan: QuantizePlan) -> ir.Model:
    """The input loaded (its weights memory-mapped) and rewritten as the plan says."""
    from onnx_conv2matmul.files.progress import NullProgress

    loaded = load_input(
        plan.src, plan.dst, inplace=False, run_checker=False, progress=NullProgress(), timings={}
    )
    model = loaded.model
    rewrite_model(model, plan.convert, for_quantization=True)
    return model


def build(plan: QuantizePlan, options: QuantizeOptions, cache: BlockCache | None = None) -> Candidate:
    """The input loaded (memory-mapped), rewritten as the plan says and quantized with ``options``
    (``cache``: the blocks quantized before, reused)."""
    model = load_rewritten(plan)
    result = quantize_matmul_nbits(model, options, cache=cache)
    other = None
    if options.other_weights == "int8":
        from onnx_conv2matmul.quantize.other_weights import quantize_other_weights

        other = quantize_other_weights(model, cache=cache)
    return Candidate(model, options, result, other)


def open_beside_input(
    plan: QuantizePlan, model: ir.Model, *, prepack: bool, extra_outputs: Sequence[str] = ()
) -> Any:
    """:func:`open_in_memory` of a candidate made from the plan's input (its weights in files are
    read from the input's folder), in a session as the pass makes them
    (:func:`~onnx_conv2matmul.quantize.measure.session_options`, prepacking or not)."""
    from onnx_conv2matmul.quantize.measure import session_options

    folder = os.path.dirname(os.path.abspath(plan.src))
    return open_in_memory(model, folder, session_options(plan.verify, prepack=prepack), extra_outputs)


def open_in_memory(
    model: ir.Model,
    folder: str,
    session_options: Any,
    extra_outputs: Sequence[str] = (),
) -> Any:
    """An onnxruntime session of ``model`` (not changed) given as bytes: tensors in files of
    ``folder`` are read from there, main-graph arrays made in memory are handed over apart from the
    graph: as external initializers (onnxruntime copies them), or, when the session does not
    prepack, borrowed (:func:`release_borrowed` gives back the pages of those mapped from files).
    ``extra_outputs``: main-graph values added as outputs after the model's own (for the
    activation statistics; a run fetches them by name)."""
    import onnxruntime as ort

    from onnx_conv2matmul.quantize.measure import PREPACKING_KEY

    names: list[str] = []
    values: list[Any] = []
    arrays: list[np.ndarray] = []
    swapped: list[tuple[ir.Value, ir.TensorProtocol]] = []
    outputs = list(model.graph.outputs)
    here = os.path.realpath(folder)
    borrow = _config(session_options, PREPACKING_KEY) == "1"
    try:
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or not (value.uses() or value.is_graph_output()):
                continue  # unused: onnxruntime drops it before it could take it (serialized)
            if isinstance(tensor, ir.ExternalTensor):
                if os.path.realpath(str(tensor.base_dir)) == here:
                    continue  # read by onnxruntime from its file in ``folder``
            elif tensor.nbytes < IN_MEMORY_MIN_BYTES:
                continue  # small: serialized with the graph
            # Made in memory, or in a file elsewhere (a link of the input's, read where it lands:
            # memory-mapped, handed over as it lies).
            # onnxruntime takes only a buffer it can borrow: C-contiguous (a view, such as a
            # moved axis, would be copied into one it owns, which it refuses).
            array = np.ascontiguousarray(tensor.numpy())
            names.append(name)
            arrays.append(array)
            values.append(ort.OrtValue.ortvalue_from_numpy(array))
            swapped.append((value, tensor))
            value.const_value = ir.ExternalTensor(
                _BORROWED if borrow else _IN_MEMORY,
                0,
                tensor.nbytes,
                tensor.dtype,
                shape=ir.Shape(tensor.shape.numpy()),
                name=name,
                base_dir=folder,
            )
        if extra_outputs:
            by_name = {v.name: v for node in model.graph for v in node.outputs if v.name}
            present = {v.name for v in outputs}
            for name in extra_outputs:
                if name in by_name and name not in present:
                    model.graph.outputs.append(by_name[name])
        proto = ir.serde.serialize_model(model)
    finally:
        for value, tensor in swapped:
            value.const_value = tensor
        model.graph.outputs.clear()
        model.graph.outputs.extend(outputs)
    session_options.add_session_config_entry(FOLDER_KEY, os.path.abspath(folder))
    if names and borrow:
        for name, value in zip(names, values, strict=True):
            session_options.add_initializer(name, value)
    elif names:
        session_options.add_external_initializers(names, values)
    data = proto.SerializeToString()
    del proto
    session = ort.InferenceSession(data, session_options, providers=["CPUExecutionProvider"])
    if borrow:
        session.borrowed_initializers = values  # onnxruntime reads them where they lie: kept alive with it
        session.borrowed_mappings = [m for m in map(_mapping, arrays) if m is not None]
    return session


def release_borrowed(session: Any) -> None:
    """Drop from the process's memory the pages of the borrowed arrays that are memory-mapped files
    (the int4 blocks in the scratch folder): a run that needs them again reads them back from the
    file (usually from the page cache). Each class of the switched session touches only its
    own blocks, so after each class's runs the blocks read so far need not stay resident: on the
    Parakeet-shaped encoder they were 0.3 GB of the run's peak."""
    advice = getattr(mmap, "MADV_DONTNEED", None)  # not on every platform: then they stay
    for mapping in getattr(session, "borrowed_mappings", ()) if advice is not None else ():
        mapping.madvise(advice)


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The file mapping an array views, or None (memory of its own)."""
    base: Any = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    return base


def _config(session_options: Any, key: str) -> str | None:
    """A session setting's value, None when it was not set."""
    try:
        return str(session_options.get_session_config_entry(key))
    except RuntimeError:  # onnxruntime's answer for a key never set
        return None
