"""Weight-only quantization with onnxruntime's own quantizers, one weight at a time.

``MatMulNBitsQuantizer`` loads the whole model into protobuf (several times the model
in memory for a 2.5 GB encoder). Here each MatMul is handed, with only its own weight,
to the per-node quantizer that ``MatMulNBitsQuantizer`` itself uses
(``DefaultWeightOnlyQuantizer.quantize``); the nodes and tensors it returns replace the
MatMul in the onnx-ir model, and the fp32 weight is unmapped right after. Peak memory is
the quantized model plus one fp32 weight. ``--int8-dynamic`` calls onnxruntime's
``quantize_dynamic`` as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from onnx_conv2matmul._graphs import NameAllocator, is_external, used_names, walk_graphs
from onnx_conv2matmul.report import NBitsProjection

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
# The block sizes onnxruntime's MatMulNBits quantizer (MlasQuantizeBlockwise) accepts.
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class QuantizeOptions:
    """MatMulNBits settings (onnxruntime's names in brackets).

    Attributes:
        bits: 4 or 8 (``bits``).
        block_size: One of :data:`BLOCK_SIZES`, 16 to 256 (``block_size``).
        symmetric: Symmetric quantization without zero points (``is_symmetric``).
        accuracy_level: 0-4 (``accuracy_level``); 0 leaves the attribute out.
        exclude: Glob patterns of MatMul node names to leave in float.
        include: When given, only MatMul nodes matching one of these are quantized.
    """

    bits: int = 4
    block_size: int = 64
    symmetric: bool = False
    accuracy_level: int = 0
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES[:-1])) + f" or {BLOCK_SIZES[-1]}"
            raise ValueError(
                f"block size must be a power of 2 that MatMulNBits supports ({sizes}), got {self.block_size}"
            )
        if not 0 <= self.accuracy_level <= 4:
            raise ValueError(f"accuracy level must be 0-4, got {self.accuracy_level}")

    def selects(self, name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return False
        return not self.include or any(fnmatch.fnmatchcase(name, p) for p in self.include)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["exclude"], data["include"] = list(self.exclude), list(self.include)
        return data


@dataclasses.dataclass
class WeightStats:
    """Weight bytes of a model and how many of them the MatMulNBits quantizer takes."""

    total_bytes: int = 0
    quantizable_bytes: int = 0
    quantizable_matmuls: int = 0

    @property
    def share(self) -> float:
        return self.quantizable_bytes / self.total_bytes if self.total_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "share": round(self.share, 4)}


def _constant_2d_weight(node: ir.Node) -> ir.Value | None:
    """Input B when it is what MatMulNBits takes: a 2-D float initializer, not a graph input."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    b = node.inputs[1]
    if b is None or not b.is_initializer() or b.is_graph_input() or b.const_value is None:
        return None
    tensor = b.const_value
    if len(tensor.shape) != 2 or tensor.dtype not in _FLOATS:
        return None
    return b


def weight_stats(model: ir.Model) -> WeightStats:
    """Float weight bytes in every scope, and the share on MatMul input B (quantizable)."""
    stats = WeightStats()
    seen: set[int] = set()
    for graph, _ in walk_graphs(model.graph):
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is not None and tensor.dtype.is_floating_point():
                stats.total_bytes += int(tensor.nbytes)
        for node in graph:
            if node.op_type == "Constant" and "value" in node.attributes:
                attr = node.attributes["value"]
                if attr.type == ir.AttributeType.TENSOR and attr.value.dtype.is_floating_point():
                    stats.total_bytes += int(attr.value.nbytes)
            b = _constant_2d_weight(node)
            if b is not None:
                stats.quantizable_matmuls += 1
                if id(b) not in seen:
                    seen.add(id(b))
                    stats.quantizable_bytes += int(b.const_value.nbytes)  # type: ignore[union-attr]
    return stats


def matmul_nbits_sizes(k: int, n: int, scale_itemsize: int, options: QuantizeOptions) -> tuple[int, int, int]:
    """The bytes of the tensors MatMulNBits gets for a ``[K, N]`` weight: (packed, scales, zero points).

    onnxruntime's layout (``DefaultWeightOnlyQuantizer.qbits_block_quant``, QOperator format):
    K is padded to whole blocks; B is uint8 ``[N, blocks, block_size * bits / 8]``; the scales
    are ``[N, blocks]`` in the weight's float type (bfloat16 stays 2 bytes); the zero points,
    only when asymmetric, are uint8 ``[N, ceil(blocks / (8 / bits))]`` (two 4-bit points a byte).
    """
    blocks = -(-k // options.block_size)
    per_byte = 8 // options.bits
    packed = n * blocks * (-(-options.block_size // per_byte))
    scales = n * blocks * scale_itemsize
    zero_points = 0 if options.symmetric else n * (-(-blocks // per_byte))
    return packed, scales, zero_points


def nbits_projection(before: ir.Model, after: ir.Model, options: QuantizeOptions) -> NBitsProjection:
    """What :func:`quantize_matmul_nbits` would make of ``after`` (``before`` rewritten), from shapes.

    Reads no tensor data. Every MatMul whose input B :func:`weight_stats` counts as
    quantizable gets MatMulNBits (the include and exclude patterns are not applied); a weight
    shared by several of them is quantized once, and its float bytes go when every reader
    is quantized.
    """
    from onnx_conv2matmul._io import tensor_bytes

    projection = NBitsProjection(
        bits=options.bits,
        block_size=options.block_size,
        symmetric=options.symmetric,
        weights_without_rewrite=weight_stats(before),
        weights_with_rewrite=weight_stats(after),
        tensor_bytes=tensor_bytes(after),
    )
    weights: dict[int, ir.Value] = {}
    readers: dict[int, int] = {}
    for graph, _ in walk_graphs(after.graph):
        for node in graph:
            b = _constant_2d_weight(node)
            if b is not None:
                weights[id(b)] = b
                readers[id(b)] = readers.get(id(b), 0) + 1
    for key, b in weights.items():
        tensor = b.const_value
        assert tensor is not None
        k, n = (int(d) for d in tensor.shape.numpy())
        packed, scales, zero_points = matmul_nbits_sizes(k, n, int(tensor.dtype.itemsize), options)
        projection.packed_bytes += packed
        projection.scale_bytes += scales
        projection.zero_point_bytes += zero_points
        if len(b.uses()) == readers[key] and not b.is_graph_output():
            projection.float_bytes_removed += int(tensor.nbytes)
    return projection


@dataclasses.dataclass
class NBitsResult:
    quantized: int = 0
    excluded: list[str] = dataclasses.field(default_factory=list)
    matmuls: int = 0


def quantize_matmul_nbits(model: ir.Model, options: QuantizeOptions) -> NBitsResult:
    """Replace every selected MatMul with a constant 2-D weight by MatMulNBits, in place."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    quantizer = DefaultWeightOnlyQuantizer(
        DefaultWeightOnlyQuantConfig(
            block_size=options.block_size,
            is_symmetric=options.symmetric,
            accuracy_level=options.accuracy_level,
            quant_format=QuantFormat.QOperator,
            op_types_to_quantize=("MatMul",),
            bits=options.bits,
        )
    )
    names = NameAllocator(used_names(model))
    result = NBitsResult()
    # Quantized tensors per fp32 weight, so a shared weight is quantized once.
    done: dict[int, dict[str, ir.Value]] = {}
    for graph, _ in walk_graphs(model.graph):
        for node in list(graph):
            b = _constant_2d_weight(node)
            if node.op_type == "MatMul":
                result.matmuls += 1
            if b is None:
                continue
            if not options.selects(node.name or ""):
                result.excluded.append(node.name or "")
                continue
            _replace(node, graph, b, quantizer, names, done)
            result.quantized += 1
            if not b.uses() and b.graph is not None and b.name is not None:
                b.graph.initializers.pop(b.name)
    model.opset_imports.setdefault("com.microsoft", 1)
    return result


def _replace(
    node: ir.Node,
    graph: ir.Graph,
    b: ir.Value,
    quantizer: Any,
    names: NameAllocator,
    done: dict[int, dict[str, ir.Value]],
) -> None:
    a = node.inputs[0]
    out = node.outputs[0]
    assert a is not None and b.name is not None and b.const_value is not None
    tensor = b.const_value
    # Materialize the bytes (an external tensor would be serialized as a file reference).
    loaded = ir.Tensor(tensor.numpy(), name=b.name)
    scratch = onnx.GraphProto(initializer=[ir.serde.serialize_tensor(loaded)])
    del loaded
    if is_external(tensor):
        tensor.release()  # the proto holds the bytes now; drop the mapping
    a_name, out_name = "__a__", "__out__"
    proto_node = onnx.helper.make_node(
        "MatMul", [a_name, b.name], [out_name], name=node.name or f"{b.name}_MatMul"
    )
    with _quiet_quantizer_logs():
        new_protos: Sequence[onnx.NodeProto] = quantizer.quantize(proto_node, [scratch])
    if len(new_protos) == 1 and new_protos[0] is proto_node:
        return  # the quantizer declined
    owner = b.graph or graph
    tensors = done.get(id(b))
    if tensors is None:
        tensors = {}
        for tp in scratch.initializer:
            if tp.name == b.name:
                continue
            # Copy out of the proto: a tensor viewing it would keep the whole scratch graph,
            # fp32 weight included, alive.
            name = names.new(tp.name)
            array = np.array(ir.serde.deserialize_tensor(tp).numpy(), copy=True)
            value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
            value.type = ir.TensorType(value.const_value.dtype)  # type: ignore[union-attr]
            value.shape = ir.Shape(list(tp.dims))
            owner.register_initializer(value)
            tensors[tp.name] = value
        done[id(b)] = tensors
    del scratch
    values: dict[str, ir.Value] = {a_name: a, **tensors}
    new_nodes: list[ir.Node] = []
    last: ir.Value | None = None
    for proto in new_protos:
        inputs = [values[name] if name else None for name in proto.input]
        outputs = []
        for name in proto.output:
            value = ir.Value(name=names.new(f"{node.name or b.name}/{proto.op_type}_out"))
            values[name] = value
            outputs.append(value)
        attributes = [ir.serde.deserialize_attribute(attr) for attr in proto.attribute]
        new_nodes.append(
            ir.Node(
                proto.domain,
                proto.op_type,
                inputs,
                attributes,
                outputs=outputs,
                name=names.new(proto.name or f"{node.name}/{proto.op_type}"),
            )
        )
        last = values.get(out_name, last)
    assert last is not None, "the quantizer must produce the MatMul's output"
    out_name_kept = out.name
    out.name = names.new(f"{out_name_kept}__replaced")
    last.name = out_name_kept
    last.type, last.shape = out.type, out.shape
    ir.convenience.replace_all_uses_with(out, last, replace_graph_outputs=True)
    graph.insert_after(node, new_nodes)
    graph.remove(node, safe=True)


@contextlib.contextmanager
def _quiet_quantizer_logs() -> Iterator[None]:
    """onnxruntime's quantizer logs every node at INFO level; keep the terminal for the report."""
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


# Float types onnxruntime's quantize_dynamic cannot take: it inserts DynamicQuantizeLinear,
# which reads float32 only, and writes a model that does not load.
_NOT_INT8_DYNAMIC = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def int8_dynamic_obstacle(model: ir.Model) -> str | None:
    """Why ``quantize_dynamic`` cannot take ``model``, or ``None``.

    Names the first graph input, output or tensor (initializer or node attribute, in any
    scope) of a 16-bit float type.
    """
    from onnx_conv2matmul._graphs import tensor_holders

    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.dtype in _NOT_INT8_DYNAMIC:
            return f"graph input or output {value.name!r} is {value.dtype.name.lower()}"
    for holder in tensor_holders(model):
        tensor = holder.get()
        if tensor.dtype in _NOT_INT8_DYNAMIC:
            return f"tensor {tensor.name!r} is {tensor.dtype.name.lower()}"
    return None


def int8_dynamic(
    model: ir.Model, input_path: str, output_path: str, options: QuantizeOptions, *, external_data: bool
) -> None:
    """onnxruntime's ``quantize_dynamic`` with int8 weights (for a decoder/joint).

    ``options.exclude`` / ``options.include`` select nodes by name, as for MatMulNBits.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    names = [n.name for g, _ in walk_graphs(model.graph) for n in g if n.name]
    excluded = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in options.exclude)]
    included = [n for n in names if options.include and options.selects(n)]
    # onnxruntime warns on the root logger that pre-processing may help; keep stderr for our report.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            input_path,
            output_path,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded,
            nodes_to_quantize=included or None,
            use_external_data_format=external_data,
        )
    finally:
        root.setLevel(level)
