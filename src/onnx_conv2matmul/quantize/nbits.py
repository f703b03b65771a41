"""Weight-only quantization with onnxruntime's own quantizers, one weight at a time.

``MatMulNBitsQuantizer`` loads the whole model into protobuf (several times the model
in memory). Here each MatMul is quantized alone, with the setting
:meth:`QuantizeOptions.setting_for` resolves for it, by the algorithm's per-node
quantizer (see :mod:`onnx_conv2matmul.quantize.weight_only`): for the default algorithm,
onnxruntime's ``DefaultWeightOnlyQuantizer.qbits_block_quant`` on the weight's array,
with the node and tensors named as its ``quantize_matmul`` names them; otherwise the
MatMul is handed, with only its own weight in a protobuf graph, to the algorithm's
quantizer. The new node and tensors replace the MatMul in the onnx-ir model, and the
fp32 weight is unmapped right after. Peak memory is the quantized model plus one fp32
weight. ``--int8-dynamic`` calls onnxruntime's ``quantize_dynamic`` as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from onnx_conv2matmul._graphs import NameAllocator, is_external, used_names, walk_graphs
from onnx_conv2matmul.quantize.projection import constant_2d_weight
from onnx_conv2matmul.quantize.settings import NodeSetting, QuantizeOptions

if TYPE_CHECKING:
    from onnx_conv2matmul.quantize.blockwise import BlockCache


@dataclasses.dataclass
class NBitsResult:
    """What :func:`quantize_matmul_nbits` did.

    Attributes:
        quantized: How many MatMuls became MatMulNBits.
        excluded: MatMuls with a constant 2-D weight left in float by the settings.
        matmuls: Every MatMul of the model.
        settings: The setting each quantized MatMul got, by node name.
        not_quantized: Nodes the algorithm left in float, with why (e.g. gptq inside subgraphs).
        unknown_nodes: Names in ``QuantizeOptions.nodes`` that are no quantizable MatMul.
        unmatched_patterns: ``exclude``, ``include`` and ``bits_for`` patterns that match no
            quantizable MatMul.
    """

    quantized: int = 0
    excluded: list[str] = dataclasses.field(default_factory=list)
    matmuls: int = 0
    settings: dict[str, NodeSetting] = dataclasses.field(default_factory=dict)
    not_quantized: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unknown_nodes: list[str] = dataclasses.field(default_factory=list)
    unmatched_patterns: list[str] = dataclasses.field(default_factory=list)


def quantize_matmul_nbits(
    model: ir.Model,
    options: QuantizeOptions,
    *,
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    scratch_dir: str | None = None,
    cache: BlockCache | None = None,
) -> NBitsResult:
    """Replace every selected MatMul with a constant 2-D weight by MatMulNBits, in place.

    ``cache`` keeps the default algorithm's block quantization of each weight and setting
    (see :class:`onnx_conv2matmul.quantize.blockwise.BlockCache`): a weight quantized before
    with the same setting is not read or quantized again.

    Each MatMul gets its setting from :meth:`QuantizeOptions.setting_for`, quantized by
    the options' algorithm. ``gptq`` needs ``feeds`` (calibration inputs of the model): the
    activations reaching each MatMul are captured first, with the model written once to
    ``scratch_dir`` (a temporary directory by default).

    Raises:
        InputError: the algorithm cannot run here (``hqq`` without torch, ``gptq`` without feeds).
    """
    from onnx_conv2matmul.quantize import weight_only as _weight_only

    _weight_only.check_available(options.algorithm, has_calibration=bool(feeds))
    result = NBitsResult()
    targets: list[tuple[ir.Graph, ir.Node, ir.Value, NodeSetting]] = []
    for graph, _ in walk_graphs(model.graph):
        for node in graph:
            if node.op_type == "MatMul":
                result.matmuls += 1
            b = constant_2d_weight(node)
            if b is None:
                continue
            setting = options.setting_for(node.name or "")
            if setting.bits is None:
                result.excluded.append(node.name or "")
            else:
                targets.append((graph, node, b, setting))
    known = {node.name for _, node, _, _ in targets} | set(result.excluded)
    result.unknown_nodes = [name for name in options.nodes if name not in known]
    patterns = [*options.exclude, *options.include, *(p for p, _ in options.bits_for)]
    result.unmatched_patterns = [
        p for p in dict.fromkeys(patterns) if not any(fnmatch.fnmatchcase(n or "", p) for n in known)
    ]
    activations: dict[str, list[np.ndarray]] | None = None
    if options.algorithm == "gptq":
        assert feeds
        sources = sorted(
            {
                a.name
                for g, n, _, _ in targets
                if g is model.graph and (a := n.inputs[0]) is not None and a.name is not None
            }
        )
        # No MatMul of the main graph to quantize: nothing to capture (onnxruntime refuses a run
        # that asks for no output).
        activations = (
            _weight_only.capture_inputs(model, sources, feeds, scratch_dir=scratch_dir) if sources else {}
        )
    names = NameAllocator(used_names(model))
    quantizers: dict[NodeSetting, Any] = {}
    # Quantized tensors per fp32 weight and setting, so a shared weight is quantized once.
    done: dict[tuple[int, NodeSetting], dict[str, ir.Value]] = {}
    for graph, node, b, setting in targets:
        quantizer = quantizers.get(setting)
        if quantizer is None:
            quantizer = quantizers[setting] = _weight_only.node_quantizer(
                options.algorithm,
                bits=setting.bits or 4,
                block_size=setting.block_size,
                symmetric=setting.symmetric,
                accuracy_level=options.accuracy_level,
                activations=activations,
            )
        # GPTQ's result depends on the activations too: no sharing.
        share = options.algorithm != "gptq"
        declined = _replace(node, graph, b, quantizer, names, done if share else {}, setting, cache)
        if declined is None:
            result.quantized += 1
            result.settings[node.name or ""] = setting
        else:
            result.not_quantized.append((node.name or "", declined))
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
    done: dict[tuple[int, NodeSetting], dict[str, ir.Value]],
    setting: NodeSetting,
    cache: BlockCache | None = None,
) -> str | None:
    """Quantize one MatMul; why not when the quantizer declined it (the node is unchanged)."""
    from onnx_conv2matmul.quantize.weight_only import matmul_nbits_quantizer

    matmul_nbits_quantizer()  # first import: the root logger left as it is
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    from onnx_conv2matmul.quantize.weight_only import DeclinedError

    a = node.inputs[0]
    out = node.outputs[0]
    assert a is not None and b.name is not None and b.const_value is not None
    owner = b.graph or graph
    try:
        direct = type(quantizer) is DefaultWeightOnlyQuantizer and b.const_value.dtype in _DIRECT_TYPES
        if direct:
            new_nodes, last = _quantize_direct(node, a, b, quantizer, names, done, setting, owner, cache)
        else:
            new_nodes, last = _quantize_through_proto(node, a, b, quantizer, names, done, setting, owner)
    except DeclinedError as declined:
        return str(declined)
    out_name_kept = out.name
    out.name = names.new(f"{out_name_kept}__replaced")
    last.name = out_name_kept
    last.type, last.shape = out.type, out.shape
    ir.convenience.replace_all_uses_with(out, last, replace_graph_outputs=True)
    graph.insert_after(node, new_nodes)
    graph.remove(node, safe=True)
    return None


# Weights the default algorithm quantizes without a protobuf round trip (bfloat16 takes it:
# onnxruntime converts it to float32 and back on the way).
_DIRECT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})


def _initializer(owner: ir.Graph, names: NameAllocator, wanted: str, array: np.ndarray) -> ir.Value:
    name = names.new(wanted)
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.type = ir.TensorType(value.const_value.dtype)  # type: ignore[union-attr]
    value.shape = ir.Shape(list(array.shape))
    owner.register_initializer(value)
    return value


def _quantize_direct(
    node: ir.Node,
    a: ir.Value,
    b: ir.Value,
    quantizer: Any,
    names: NameAllocator,
    done: dict[tuple[int, NodeSetting], dict[str, ir.Value]],
    setting: NodeSetting,
    owner: ir.Graph,
    cache: BlockCache | None = None,
) -> tuple[list[ir.Node], ir.Value]:
    """The default algorithm on the weight's array: onnxruntime's block quantization, the node
    and tensors as its ``quantize_matmul`` names them, without copying the fp32 weight into a
    protobuf and back."""
    assert b.name is not None and b.const_value is not None
    tensor = b.const_value
    bits = quantizer.config.bits
    key = (id(b), setting)
    tensors = done.get(key)
    if tensors is None:
        cache_key = f"{node.name}|{b.name}|{setting.bits}|{setting.block_size}|{setting.symmetric}"
        cached = cache.get(cache_key) if cache is not None else None
        if cached is not None:
            packed, scales, zero_points = cached
        else:
            packed, scales, zero_points = quantizer.qbits_block_quant(tensor.numpy())
            if is_external(tensor):
                tensor.release()  # read once; drop the mapping
            if cache is not None:
                cache.put(cache_key, packed, scales, zero_points)
        tensors = {
            "packed": _initializer(owner, names, f"{b.name}_Q{bits}", packed),
            "scales": _initializer(owner, names, f"{b.name}_scales", scales),
        }
        if not quantizer.config.is_symmetric:
            tensors["zero_points"] = _initializer(owner, names, f"{b.name}_zero_points", zero_points)
        done[key] = tensors
    rows, cols = tensor.shape.numpy()
    attributes = [ir.AttrInt64("K", rows), ir.AttrInt64("N", cols)]
    if quantizer.config.accuracy_level:
        attributes.append(ir.AttrInt64("accuracy_level", quantizer.config.accuracy_level))
    attributes += [ir.AttrInt64("bits", bits), ir.AttrInt64("block_size", quantizer.config.block_size)]
    name = node.name or f"{b.name}_MatMul"
    last = ir.Value(name=names.new(f"{name}/MatMulNBits_out"))
    new = ir.Node(
        "com.microsoft",
        "MatMulNBits",
        [a, *tensors.values()],
        attributes,
        outputs=[last],
        name=names.new(f"{name}_Q{bits}"),
    )
    return [new], last


def _quantize_through_proto(
    node: ir.Node,
    a: ir.Value,
    b: ir.Value,
    quantizer: Any,
    names: NameAllocator,
    done: dict[tuple[int, NodeSetting], dict[str, ir.Value]],
    setting: NodeSetting,
    owner: ir.Graph,
) -> tuple[list[ir.Node], ir.Value]:
    """Hand onnxruntime's per-node quantizer the MatMul with only its own weight in a graph."""
    from onnx_conv2matmul.quantize.weight_only import A_NAME, OUT_NAME, DeclinedError

    assert b.name is not None and b.const_value is not None
    tensor = b.const_value
    # Materialize the bytes (an external tensor would be serialized as a file reference).
    loaded = ir.Tensor(tensor.numpy(), name=b.name)
    scratch = onnx.GraphProto(initializer=[ir.serde.serialize_tensor(loaded)])
    del loaded
    if is_external(tensor):
        tensor.release()  # the proto holds the bytes now; drop the mapping
    # Input A keeps its name: GPTQ looks its activations up by it.
    a_name = a.name or A_NAME
    proto_node = onnx.helper.make_node(
        "MatMul", [a_name, b.name], [OUT_NAME], name=node.name or f"{b.name}_MatMul"
    )
    with _quiet_quantizer_logs():
        new_protos: Sequence[onnx.NodeProto] = quantizer.quantize(proto_node, [scratch])
    if len(new_protos) == 1 and new_protos[0] is proto_node:
        raise DeclinedError("the quantizer left it in float")
    key = (id(b), setting)
    tensors = done.get(key)
    if tensors is None:
        tensors = {}
        for tp in scratch.initializer:
            if tp.name == b.name:
                continue
            # Copy out of the proto: a tensor viewing it would keep the whole scratch graph,
            # fp32 weight included, alive.
            array = np.array(ir.serde.deserialize_tensor(tp).numpy(), copy=True)
            tensors[tp.name] = _initializer(owner, names, tp.name, array)
        done[key] = tensors
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
        last = values.get(OUT_NAME, last)
    assert last is not None, "the quantizer must produce the MatMul's output"
    return new_nodes, last


@contextlib.contextmanager
def _quiet_quantizer_logs() -> Iterator[None]:
    """onnxruntime's quantizer logs every node at INFO level: into this package's logger (see
    :mod:`onnx_conv2matmul.quantize.weight_only`), so the terminal is left to the report."""
    import warnings

    from onnx_conv2matmul.quantize.weight_only import onnxruntime_logs_captured

    with onnxruntime_logs_captured(), warnings.catch_warnings():
        # HQQ hands torch a read-only weight, which it only reads; torch warns all the same.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield
