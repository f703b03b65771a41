"""onnxruntime's weight-only algorithms, each applied to one MatMul at a time.

Every quantizer here has the interface of onnxruntime's per-node quantizers
(``quantize(node, [graph]) -> nodes``): ``graph`` holds the node's weight as its only
initializer and receives the new tensors. ``default`` and ``hqq`` are onnxruntime's own
per-node classes. ``k_quant`` and ``gptq`` exist in onnxruntime only as whole-model
functions (its bundled neural-compressor code); here each runs on a model made of the one
MatMul, so the result for a node is what onnxruntime's whole-model run gives for it,
without the whole model in protobuf. ``gptq`` needs the activations that reach each
MatMul's input A, captured beforehand on the calibration inputs (:func:`capture_inputs`).

onnxruntime's quantizers log as they go (every node at INFO, advice on the root logger, a
progress bar on stdout); their records are taken into this package's logger instead.

While :func:`onnxruntime_logs_captured` is active, a filter on each of onnxruntime's quantizer
loggers (and, for the records onnxruntime's modules send to the root logger, on the root logger)
re-logs every such record to :data:`logger` at DEBUG and drops it where it was. Nothing else
about logging changes: no level or propagation is set, no handler of the host's is added or
removed, and the records of any other library pass as they did. A host program that wants them
configures ``onnx_conv2matmul``'s logger as it likes.

onnxruntime also changes the root logger: importing ``matmul_nbits_quantizer`` calls
``logging.basicConfig`` (a stderr handler, level INFO), and ``quantize_dynamic`` logs through
``logging.warning``, which calls it too. ``basicConfig`` does nothing when the root logger has a
handler, so while onnxruntime's code runs (the import, through :func:`matmul_nbits_quantizer`
only, and every :func:`onnxruntime_logs_captured` block) a root logger without one gets a
placeholder; it passes a record on to ``logging.lastResort`` as Python would with no handler at
all, and is the only handler removed afterwards: never one of the host's. (A host that calls
``basicConfig`` from another thread during such a block finds it done nothing.)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import tempfile
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.errors import Hint, InputError, ModelRunError

if TYPE_CHECKING:
    # Imported where used: the command line reads ALGORITHMS before anything heavy.
    import numpy as np
    import onnx
    import onnx_ir as ir

ALGORITHMS = ("default", "k_quant", "gptq", "hqq")
"""The weight-only algorithms ``quantize`` offers (onnxruntime's names, lower case)."""

A_NAME, OUT_NAME = "__a__", "__out__"


class DeclinedError(Exception):
    """The algorithm left the node as it was."""


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def check_available(algorithm: str, *, has_calibration: bool) -> None:
    """Refuse an algorithm that cannot run here, before any work.

    Raises:
        InputError: ``hqq`` without torch; ``gptq`` without calibration inputs.
    """
    if algorithm == "hqq" and not torch_available():
        raise InputError(
            "the hqq algorithm needs torch, which is not installed"
            " (pip install 'onnx-conv2matmul[hqq]' installs it)"
        )
    if algorithm == "gptq" and not has_calibration:
        raise InputError("the gptq algorithm needs calibration inputs", hint=Hint.CALIBRATION_INPUTS)


def node_quantizer(
    algorithm: str,
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    activations: Mapping[str, Sequence[np.ndarray]] | None = None,
) -> Any:
    """A per-node quantizer for one algorithm and setting (see the module docstring)."""
    from onnxruntime.quantization.quant_utils import QuantFormat

    matmul_nbits_quantizer()  # first import: the root logger left as it is
    if algorithm == "default":
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        return DefaultWeightOnlyQuantizer(
            DefaultWeightOnlyQuantConfig(
                block_size=block_size,
                is_symmetric=symmetric,
                accuracy_level=accuracy_level,
                quant_format=QuantFormat.QOperator,
                op_types_to_quantize=("MatMul",),
                bits=bits,
            )
        )
    if algorithm == "hqq":
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            HQQWeightOnlyQuantConfig,
            HQQWeightOnlyQuantizer,
        )

        return HQQWeightOnlyQuantizer(
            HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits, op_types_to_quantize=("MatMul",))
        )
    config = {"bits": bits, "group_size": block_size, "scheme": "sym" if symmetric else "asym"}
    if algorithm == "k_quant":
        return _KQuant(config, accuracy_level)
    if algorithm == "gptq":
        assert activations is not None
        return _GPTQ(config, accuracy_level, activations)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _one_matmul_model(node: onnx.NodeProto, graph: onnx.GraphProto, a_type: int) -> onnx.ModelProto:
    """A model of the node alone: input A (renamed), the weight as initializer, the output."""
    import onnx

    one = onnx.NodeProto()
    one.CopyFrom(node)
    one.input[0] = A_NAME
    proto = onnx.helper.make_graph(
        [one],
        "one_matmul",
        [onnx.helper.make_tensor_value_info(A_NAME, a_type, None)],
        [onnx.helper.make_tensor_value_info(OUT_NAME, a_type, None)],
        initializer=list(graph.initializer),
    )
    return onnx.helper.make_model(proto, opset_imports=[onnx.helper.make_opsetid("", 13)])


def _take_result(result: Any, graph: onnx.GraphProto, a_name: str) -> list[onnx.NodeProto]:
    """The nodes of a quantized one-MatMul model, reading ``a_name``; its tensors go into ``graph``."""
    model = result.model if hasattr(result, "model") else result
    nodes = list(model.graph.node)
    if all(node.op_type == "MatMul" for node in nodes):
        raise DeclinedError("the algorithm left it in float")
    del graph.initializer[:]
    graph.initializer.extend(model.graph.initializer)
    for node in nodes:
        for i, name in enumerate(node.input):
            if name == A_NAME:
                node.input[i] = a_name
    return nodes


def _check_blocks(weight: onnx.TensorProto, config: Mapping[str, Any], *, zero_points: bool) -> None:
    """Decline what onnxruntime's neural-compressor code fails on.

    It packs 4-bit zero points across rows, and fails on an odd number of blocks along K.
    """
    blocks = -(-weight.dims[0] // config["group_size"])
    if zero_points and config["bits"] == 4 and blocks % 2:
        raise DeclinedError(
            "onnxruntime's k_quant and asymmetric gptq need an even number of blocks along K at 4 bits"
        )


class _KQuant:
    """onnxruntime's k-quant (``rtn_quantize(algorithm="k_quant")``) on one MatMul."""

    def __init__(self, config: dict[str, Any], accuracy_level: int) -> None:
        self.config = config
        self.accuracy_level = accuracy_level

    def quantize(self, node: onnx.NodeProto, graphs: list[onnx.GraphProto]) -> list[onnx.NodeProto]:
        from onnxruntime.quantization.neural_compressor.weight_only import rtn_quantize

        graph = graphs[-1]
        weight = graph.initializer[0]
        _check_blocks(weight, self.config, zero_points=True)
        model = _one_matmul_model(node, graph, weight.data_type)
        with _quiet_progress():
            result = rtn_quantize(
                model,
                weight_config={node.name: dict(self.config)},
                ratios={},
                accuracy_level=self.accuracy_level,
                algorithm="k_quant",
            )
        return _take_result(result, graph, node.input[0])


class _GPTQ:
    """onnxruntime's GPTQ (``gptq_quantize``) on one MatMul, fed the activations that reach it."""

    def __init__(
        self, config: dict[str, Any], accuracy_level: int, activations: Mapping[str, Sequence[np.ndarray]]
    ) -> None:
        self.config = config
        self.accuracy_level = accuracy_level
        self.activations = activations

    def quantize(self, node: onnx.NodeProto, graphs: list[onnx.GraphProto]) -> list[onnx.NodeProto]:
        from onnx.helper import np_dtype_to_tensor_dtype
        from onnxruntime.quantization.neural_compressor.weight_only import gptq_quantize

        # The node's input A carries the name of the tensor it reads in the model.
        source = node.input[0]
        batches = self.activations.get(source)
        if not batches:
            raise DeclinedError("onnxruntime's gptq quantizes the main graph only")
        graph = graphs[-1]
        _check_blocks(graph.initializer[0], self.config, zero_points=self.config["scheme"] == "asym")
        model = _one_matmul_model(node, graph, np_dtype_to_tensor_dtype(batches[0].dtype))
        with _quiet_progress():
            result = gptq_quantize(
                model,
                # Plain arrays for the one input: given as dicts, onnxruntime imports torch.
                dataloader=[(batch, None) for batch in batches],
                weight_config={node.name: dict(self.config)},
                n_samples=-1,
                accuracy_level=self.accuracy_level,
            )
        return _take_result(result, graph, node.input[0])


def capture_inputs(
    model: ir.Model,
    names: Sequence[str],
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    scratch_dir: str | None = None,
) -> dict[str, list[np.ndarray]]:
    """The values of the main-graph tensors ``names`` on each feed, as onnxruntime's GPTQ sees them.

    A value that holds NaN or Inf is refused (:class:`ModelRunError`): GPTQ's Hessian would
    turn every weight it quantizes into NaN.

    As ``gptq_quantize`` does: the model's outputs are replaced by these tensors and it runs
    in onnxruntime with default session options. The model is written to a scratch
    directory (with its weights in a data file) for that, then restored as it was.
    """
    import numpy as np
    import onnxruntime as ort

    from onnx_conv2matmul.files import output as _output

    values = {v.name: v for v in _main_graph_values(model.graph)}
    wanted = [values[name] for name in names]
    outputs = list(model.graph.outputs)
    model.graph.outputs.clear()
    try:
        model.graph.outputs.extend(wanted)
        with tempfile.TemporaryDirectory(dir=scratch_dir, prefix=".gptq-") as directory:
            path = os.path.join(directory, "model.onnx")
            _output.save(model, path, "model.onnx.data")
            so = ort.SessionOptions()
            so.log_severity_level = 4  # fatal only: the error is in the exception
            session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    finally:
        model.graph.outputs.clear()
        model.graph.outputs.extend(outputs)
    captured: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for index, feed in enumerate(feeds):
        # One run per feed for every tensor (gptq_quantize runs once per tensor and feed;
        # the values are the same).
        try:
            values = session.run(list(names), dict(feed))
        except Exception as err:
            from onnx_conv2matmul.verify.options import feed_source

            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ModelRunError(
                f"onnxruntime cannot run the model on inputs {feed_source(feed, index)}"
                f" to calibrate gptq: {first}",
                hint=Hint.INPUT_FILES,
            ) from err
        for name, value in zip(names, values, strict=True):
            array = np.asarray(value)
            if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
                from onnx_conv2matmul.verify.options import feed_source

                raise ModelRunError(
                    f"the model's MatMul input {name!r} holds NaN or Inf on inputs"
                    f" {feed_source(feed, index)}: gptq cannot calibrate on them (its weights would"
                    " be NaN)",
                    hint=Hint.INPUT_FILES,
                )
            captured[name].append(value)
    return captured


def _main_graph_values(graph: ir.Graph) -> Iterator[ir.Value]:
    yield from graph.inputs
    for node in graph:
        yield from node.outputs


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """The bundled neural-compressor code logs at INFO level (and warns that CUDA is missing when
    torch is installed): into this package's logger. Its progress bar is printed on stdout, which
    the library leaves alone: the command line keeps its stdout for JSON by itself."""
    with onnxruntime_logs_captured():
        yield


logger = logging.getLogger(__name__)

# The loggers onnxruntime's weight-only and dynamic quantizers log to by name.
_NAMED = (
    "onnxruntime.quantization.matmul_nbits_quantizer",
    "neural_compressor",
)
_ONNXRUNTIME_DIR = os.sep + "onnxruntime" + os.sep
_QUANTIZER = "onnxruntime.quantization.matmul_nbits_quantizer"
_importing = threading.Lock()


class _NoHandler(logging.Handler):
    """The root logger's placeholder: a record no other handler takes goes to
    ``logging.lastResort``, as it would with no handler at all."""

    def emit(self, record: logging.LogRecord) -> None:
        found = logging.Logger.manager.loggerDict.get(record.name)
        chain: logging.Logger | None = found if isinstance(found, logging.Logger) else logging.getLogger()
        while chain is not None:
            if any(h is not self for h in chain.handlers):
                return
            if not chain.propagate:
                break
            chain = chain.parent
        last = logging.lastResort
        if last is not None and record.levelno >= last.level:
            last.handle(record)


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """A block whose ``logging.basicConfig`` calls change nothing (see the module docstring)."""
    root = logging.getLogger()
    if root.handlers:
        yield
        return
    placeholder = _NoHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeHandler(placeholder)


def matmul_nbits_quantizer() -> types.ModuleType:
    """onnxruntime's ``matmul_nbits_quantizer`` module, imported without the root logger change
    its import makes (see the module docstring)."""
    module = sys.modules.get(_QUANTIZER)
    if module is not None:
        return module
    with _importing, root_logger_kept():
        return importlib.import_module(_QUANTIZER)


class _TakeOver(logging.Filter):
    """Re-log a record to :data:`logger` at DEBUG and drop it (only onnxruntime's, when asked)."""

    def __init__(self, *, onnxruntime_only: bool) -> None:
        super().__init__()
        self.onnxruntime_only = onnxruntime_only

    def filter(self, record: logging.LogRecord) -> bool:
        if self.onnxruntime_only and _ONNXRUNTIME_DIR not in record.pathname:
            return True
        logger.debug("%s [%s] %s", record.name, record.levelname, record.getMessage())
        return False


@contextlib.contextmanager
def onnxruntime_logs_captured() -> Iterator[None]:
    """Take onnxruntime's quantizer log records into this package's logger for the block."""
    filters = [(logging.getLogger(name), _TakeOver(onnxruntime_only=False)) for name in _NAMED]
    filters.append((logging.getLogger(), _TakeOver(onnxruntime_only=True)))
    for target, taker in filters:
        target.addFilter(taker)
    try:
        with root_logger_kept():
            yield
    finally:
        for target, taker in filters:
            target.removeFilter(taker)
