"""onnxruntime's weight-only algorithms, each applied to one MatMul at a time.

Every quantizer here has the interface of onnxruntime's per-node quantizers
(``quantize(node, [graph]) -> nodes``): ``graph`` holds the node's weight as its only
initializer and receives the new tensors. ``default`` and ``hqq`` are onnxruntime's own
per-node classes. ``k_quant`` and ``gptq`` exist in onnxruntime only as whole-model
functions (its bundled neural-compressor code); here each runs on a model made of the one
MatMul, so the result for a node is what onnxruntime's whole-model run gives for it,
without the whole model in protobuf. ``gptq`` needs the activations that reach each
MatMul's input A, captured beforehand on the calibration inputs (:func:`capture_inputs`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onnx_conv2matmul.errors import Hint, InputError, ModelRunError
from onnx_conv2matmul.quantize.logs import matmul_nbits_quantizer

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
    from onnx_conv2matmul.quantize.logs import onnxruntime_logs_captured

    with onnxruntime_logs_captured():
        yield
