"""Decide, for every Conv-like node, whether it can be rewritten exactly.

This module only reads the model. It returns a :class:`Plan` for every Conv that
can be rewritten and a skipped :class:`ConvEntry` (with its reason) for every other.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnx_conv2matmul._graphs import default_opset, walk_graphs
from onnx_conv2matmul.rewrite import fused as _fused
from onnx_conv2matmul.rewrite.gemm import GemmPlan, is_gemm, plan_gemm
from onnx_conv2matmul.rewrite.layout import added_transposes
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.reasons import SkipReason
from onnx_conv2matmul.rewrite.report import ConvEntry, Status
from onnx_conv2matmul.rewrite.weights import (
    _FLOAT_TYPES,
    MIN_OPSET_BFLOAT16_MATMUL,
    WeightPlan,
    _Skip,
    check_attribute_types,
    constant_tensor,
    constant_weight,
)

# Op types reported as convolutions; of these only com.microsoft FusedConv is rewritten.
_OTHER_CONV_OPS = frozenset(
    {"ConvInteger", "QLinearConv", "FusedConv", "NhwcConv", "NhwcFusedConv", "QLinearConvTranspose"}
)
_AUTO_PADS = frozenset({"NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"})

# Opsets the emitted ops need.
MIN_OPSET_PAD = 2  # Pad-2: pads as an attribute; Pad-11: pads as an input
MIN_OPSET_SLICE_STEPS = 10
# Before IR version 4 every initializer must also be a graph input (so it could be overridden).
MIN_IR_VERSION = 4


@dataclasses.dataclass
class Plan(WeightPlan):
    """How one Conv is rewritten. Built by :func:`analyze`, applied by ``rewrite.py``."""

    bias: ir.Value | None
    spatial_rank: int
    pads_begin: list[int]
    pads_end: list[int]
    strides: list[int]
    opset: int
    group: int = 1
    """Groups of channels, each with its own MatMul (extended mode)."""
    activation: _fused.Activation | None = None
    """A FusedConv's activation, emitted as its standard op after the conv."""
    sum_input: ir.Value | None = None
    """A FusedConv's input Z, added before the activation."""


def is_conv_like(node: ir.Node) -> bool:
    if node.op_type == "Conv":
        return True
    return node.op_type in _OTHER_CONV_OPS


def analyze(model: ir.Model, options: ConvertOptions) -> tuple[list[Plan | GemmPlan], list[ConvEntry]]:
    """Return the plans and the report entry of every Conv-like node (and Gemm, with
    ``options.gemm``), in graph order."""

    opset = default_opset(model)
    ambiguous = _names_in_several_scopes(model)
    plans: list[Plan | GemmPlan] = []
    entries: list[ConvEntry] = []
    for graph, scope in walk_graphs(model.graph):
        for node in graph:
            gemm = options.gemm and is_gemm(node)
            if not gemm and not is_conv_like(node):
                continue
            entry = ConvEntry(
                name=node.name or "",
                scope=scope,
                op_type=node.op_type,
                domain=node.domain,
                status=Status.SKIPPED,
            )
            entries.append(entry)
            try:
                plan: Plan | GemmPlan
                if gemm:
                    plan = plan_gemm(node, graph, entry, opset)
                else:
                    plan = _plan(node, graph, entry, opset, options)
                if plan.weight.name in ambiguous:
                    raise _Skip(
                        SkipReason.AMBIGUOUS_WEIGHT,
                        f"{plan.weight.name!r} is defined in several scopes",
                    )
                if model.ir_version < MIN_IR_VERSION:
                    raise _Skip(
                        SkipReason.OPSET_UNSUPPORTED,
                        f"IR version {model.ir_version} requires every initializer to be a graph input",
                    )
            except _Skip as skip:
                entry.reason = skip.reason
                entry.detail = skip.detail
            else:
                entry.status = Status.CONVERTED
                plans.append(plan)
    plans = _settle(plans, options)
    entries.extend(_function_entries(model, options))
    return plans, entries


def _settle(plans: list[Plan | GemmPlan], options: ConvertOptions) -> list[Plan | GemmPlan]:
    """Drop plans until every weight is converted whole and, by default, no Transpose is added.

    Dropping a conv can make a neighbour's conversion cost a Transpose, or leave a
    weight shared with a conv that stays, so this runs until nothing changes. Every round
    but the last drops at least one plan, so there are at most ``len(plans) + 1`` rounds.
    """
    for _ in range(len(plans) + 1):  # pragma: no mutate (equivalent: any larger bound)
        plans = _drop_shared_with_unconverted(plans)
        if options.allow_added_transposes:
            return plans
        kept = _drop_adding_transposes(plans)
        if len(kept) == len(plans):
            return kept
        plans = kept
    raise AssertionError("the plans kept changing after every conv was dropped")  # pragma: no mutate


def _drop_adding_transposes(plans: list[Plan | GemmPlan]) -> list[Plan | GemmPlan]:

    converted = {id(p.node) for p in plans if not isinstance(p, GemmPlan)}
    kept: list[Plan | GemmPlan] = []
    for plan in plans:
        if isinstance(plan, GemmPlan):
            kept.append(plan)  # a Gemm's MatMul form has no channel Transposes
            continue
        added = added_transposes(plan.node, plan.spatial_rank + 2, converted)
        if added <= 0:
            kept.append(plan)
            continue
        plan.entry.status = Status.SKIPPED
        plan.entry.reason = SkipReason.ADDS_TRANSPOSES
        plan.entry.detail = (
            f"its channels-last form would add {added} Transpose node{'s' if added > 1 else ''}:"
            " a neighbour needs channels-first data (--allow-added-transposes converts it)"
        )
        plan.entry.extra_ops = []
    return kept


def _names_in_several_scopes(model: ir.Model) -> set[str]:
    """Names defined (input, initializer, node output) in more than one graph."""
    seen: dict[str, int] = {}
    for graph, _ in walk_graphs(model.graph):
        names = {v.name for v in graph.inputs if v.name}
        names.update(graph.initializers.keys())
        names.update(o.name for n in graph for o in n.outputs if o.name)
        for name in names:
            seen[name] = seen.get(name, 0) + 1
    return {name for name, count in seen.items() if count > 1}


def _drop_shared_with_unconverted(plans: list[Plan | GemmPlan]) -> list[Plan | GemmPlan]:
    """Skip convs whose weight also feeds a node that stays, so no weight is stored twice.

    Every conv stores its weight transposed. A Gemm may store it in another form (see
    ``GemmPlan.stored_form``), or in none: reading an initializer as it is, it is kept, and
    it counts as a node that stays for a plan storing the same weight anew.
    """
    forms = {id(p.node): _stored_form(p) for p in plans}
    kept: list[Plan | GemmPlan] = []
    for plan in plans:
        form = forms[id(plan.node)]
        if form is None:
            kept.append(plan)
            continue
        others = [use.node for use in plan.weight.uses() if forms.get(id(use.node)) != form or use.idx != 1]
        if others:
            plan.entry.status = Status.SKIPPED
            plan.entry.reason = SkipReason.WEIGHT_SHARED
            user = others[0]
            plan.entry.detail = (
                f"{plan.weight.name!r} also feeds {user.op_type} {user.name or '(unnamed)'!r}, which stays"
            )
            plan.entry.extra_ops = []
            continue
        kept.append(plan)
    if len(kept) != len(plans):
        # Dropping one conv can leave another sharing its weight with a node that stays.
        return _drop_shared_with_unconverted(kept)
    return kept


def _stored_form(plan: Plan | GemmPlan) -> str | None:

    if isinstance(plan, GemmPlan):
        return plan.stored_form
    # A grouped conv stores its weight cut into groups: another form than a whole transpose.
    return "transposed" if plan.group == 1 else f"transposed in {plan.group} groups"


def _function_entries(model: ir.Model, options: ConvertOptions) -> list[ConvEntry]:

    entries = []
    for function in model.functions.values():
        for node in function:
            if is_conv_like(node) or (options.gemm and is_gemm(node)):
                entries.append(
                    ConvEntry(
                        name=node.name or "",
                        scope=f"function {function.domain}::{function.name}",
                        op_type=node.op_type,
                        domain=node.domain,
                        status=Status.SKIPPED,
                        reason=SkipReason.IN_FUNCTION,
                        detail=f"{node.op_type} nodes inside model-local functions are not rewritten",
                    )
                )
    return entries


def _ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    attr = node.attributes.get(name)
    if attr is None:
        return default
    return list(attr.as_ints())


def _plan(
    node: ir.Node,
    graph: ir.Graph,
    entry: ConvEntry,
    opset: int | None,
    options: ConvertOptions,
) -> Plan:
    fused = _fused.is_fused_conv(node)
    if (node.op_type != "Conv" or node.domain not in ("", "ai.onnx")) and not fused:
        domain = node.domain or "ai.onnx"
        raise _Skip(SkipReason.UNSUPPORTED_OP, f"{domain}::{node.op_type} is not rewritten")
    if opset is None:
        raise _Skip(SkipReason.OPSET_UNSUPPORTED, "model imports no default-domain opset")
    check_attribute_types(node)
    if len(node.inputs) < 2 or node.inputs[1] is None or node.inputs[0] is None:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"{node.op_type} without input or weight")
    weight = node.inputs[1]
    tensor, constant_node, shape = constant_weight(weight, entry)

    if len(shape) not in (3, 4, 5):
        raise _Skip(SkipReason.UNSUPPORTED_RANK, f"weight shape {shape}")
    if tensor.dtype not in _FLOAT_TYPES:
        raise _Skip(SkipReason.UNSUPPORTED_DTYPE, f"weight type {tensor.dtype.name}")
    if fused and tensor.dtype not in _fused.DTYPES:
        raise _Skip(
            SkipReason.UNSUPPORTED_DTYPE,
            f"weight type {tensor.dtype.name}: onnxruntime implements FusedConv for FLOAT and FLOAT16 only",
        )
    kernel = shape[2:]
    if any(k != 1 for k in kernel):
        raise _Skip(SkipReason.KERNEL_NOT_POINTWISE, f"kernel {kernel}")
    group = node.attributes.get_int("group", 1)
    if group < 1 or shape[0] % group:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"group {group} for {shape[0]} output channels")
    if group != 1 and shape[1] == 1:
        raise _Skip(SkipReason.DEPTHWISE, f"group {group}, one input channel per group")
    if group != 1 and not options.extended:
        raise _Skip(SkipReason.GROUPED, f"group {group}")
    activation, unsupported = _fused.activation(node) if fused else (None, None)
    if unsupported is not None:
        raise _Skip(SkipReason.UNSUPPORTED_ACTIVATION, unsupported)
    sum_input = _fused.sum_input(node) if fused else None
    if weight.is_graph_input():
        raise _Skip(
            SkipReason.WEIGHT_OVERRIDABLE,
            f"weight {weight.name!r} is an initializer that is also a graph input",
        )

    spatial = len(kernel)
    kernel_shape = _ints(node, "kernel_shape", kernel)
    strides = _ints(node, "strides", [1] * spatial)
    dilations = _ints(node, "dilations", [1] * spatial)
    pads = _ints(node, "pads", [0] * 2 * spatial)
    auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
    if kernel_shape != kernel:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"kernel_shape {kernel_shape} != weight {kernel}")
    if len(strides) != spatial or any(s < 1 for s in strides):
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"strides {strides}")
    if len(dilations) != spatial or any(d < 1 for d in dilations):
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"dilations {dilations}")
    if len(pads) != 2 * spatial or any(p < 0 for p in pads):
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"pads {pads}")
    if auto_pad not in _AUTO_PADS:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"auto_pad {auto_pad!r}")
    if auto_pad != "NOTSET" and "pads" in node.attributes:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"auto_pad {auto_pad} together with pads")
    _check_shapes(node, shape, tensor.dtype, group)
    if sum_input is not None and sum_input.dtype is not None and sum_input.dtype != tensor.dtype:
        raise _Skip(
            SkipReason.INVALID_ATTRIBUTES,
            f"input Z type {sum_input.dtype.name} != weight type {tensor.dtype.name}",
        )

    if tensor.dtype == ir.DataType.BFLOAT16 and opset < MIN_OPSET_BFLOAT16_MATMUL:
        raise _Skip(SkipReason.OPSET_UNSUPPORTED, f"bfloat16 MatMul needs opset 13, model has {opset}")

    extended: list[str] = []
    if any(s != 1 for s in strides):
        extended.append(f"strides {strides}")
    if any(p != 0 for p in pads):
        extended.append(f"pads {pads}")
    # For a kernel of 1, auto_pad pads nothing (see below): with unit strides the rewrite emits
    # exactly what it emits without auto_pad, so only strides make it need extended mode.
    if auto_pad != "NOTSET" and extended:
        extended.append(f"auto_pad {auto_pad}")
    if extended and not options.extended:
        raise _Skip(SkipReason.NEEDS_EXTENDED_MODE, ", ".join(extended))
    max_dilation = max(dilations)
    if max_dilation > 1:
        if not options.allow_non_unit_dilation:
            raise _Skip(SkipReason.DILATION_NEEDS_OPT_IN, f"dilations {dilations}")
        if options.max_dilation is not None and max_dilation > options.max_dilation:
            raise _Skip(
                SkipReason.DILATION_ABOVE_MAX,
                f"dilations {dilations} above max {options.max_dilation}",
            )
    # For a kernel of 1, every auto_pad mode pads nothing: SAME gives ceil(in/stride)
    # outputs, which is exactly what striding over the unpadded input gives.
    pads_begin = pads[:spatial] if auto_pad == "NOTSET" else [0] * spatial
    pads_end = pads[spatial:] if auto_pad == "NOTSET" else [0] * spatial
    if any(pads_begin + pads_end) and opset < MIN_OPSET_PAD:
        raise _Skip(SkipReason.OPSET_UNSUPPORTED, f"Pad needs opset {MIN_OPSET_PAD}, model has {opset}")
    if any(s != 1 for s in strides) and opset < MIN_OPSET_SLICE_STEPS:
        raise _Skip(
            SkipReason.OPSET_UNSUPPORTED,
            f"Slice with steps needs opset {MIN_OPSET_SLICE_STEPS}, model has {opset}",
        )
    if activation is not None and opset < _fused.MIN_OPSET_ACTIVATION:
        raise _Skip(
            SkipReason.OPSET_UNSUPPORTED,
            f"{activation.op_type} needs opset {_fused.MIN_OPSET_ACTIVATION}, model has {opset}",
        )
    notes = extended + ([f"group {group}"] if group > 1 else [])
    notes += [f"dilations {dilations}"] if max_dilation > 1 else []
    notes += [f"activation {activation}"] if activation is not None else []
    notes += ["input Z"] if sum_input is not None else []
    entry.detail = ", ".join(notes)
    owner = weight.graph  # a Constant's output belongs to the Constant's graph
    assert owner is not None
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return Plan(
        node=node,
        graph=graph,
        entry=entry,
        weight=weight,
        weight_tensor=tensor,
        weight_owner=owner,
        weight_constant_node=constant_node,
        bias=bias,
        spatial_rank=spatial,
        pads_begin=pads_begin,
        pads_end=pads_end,
        strides=strides,
        opset=opset,
        group=group,
        activation=activation,
        sum_input=sum_input,
    )


def _check_shapes(node: ir.Node, weight_shape: list[int], weight_dtype: ir.DataType, group: int) -> None:
    """Reject nodes whose input type, input shape or bias shape contradict the weight."""
    out_channels, in_channels = weight_shape[0], weight_shape[1] * group
    x = node.inputs[0]
    if x is not None and x.dtype is not None and x.dtype != weight_dtype:
        raise _Skip(
            SkipReason.INVALID_ATTRIBUTES,
            f"input type {x.dtype.name} != weight type {weight_dtype.name}",
        )
    if x is not None and x.shape is not None and len(x.shape) >= 2:
        if len(x.shape) != len(weight_shape):
            raise _Skip(
                SkipReason.INVALID_ATTRIBUTES,
                f"input rank {len(x.shape)} != weight rank {len(weight_shape)}",
            )
        channels = x.shape[1]
        if isinstance(channels, int) and channels != in_channels:
            raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"input channels {channels} != {in_channels}")
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is None:
        return
    found = constant_tensor(bias)
    bias_shape = list(found[0].shape.dims) if found is not None else None
    if bias_shape is None and bias.shape is not None and bias.shape.is_static():
        bias_shape = [int(d) for d in bias.shape.numpy()]
    if bias_shape is not None and bias_shape != [out_channels]:
        raise _Skip(SkipReason.INVALID_ATTRIBUTES, f"bias shape {bias_shape} != [{out_channels}]")
