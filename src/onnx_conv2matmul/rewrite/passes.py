"""The rewrite as an onnx-ir pass, to compose with other passes.

Example::

    import onnx_ir as ir
    from onnx_conv2matmul import ConvertOptions
    from onnx_conv2matmul.rewrite.passes import ConvToMatMulPass

    model = ir.load("encoder.onnx")
    pass_ = ConvToMatMulPass(ConvertOptions(extended=True))
    result = ir.passes.PassManager([pass_])(model)
    print(pass_.report.totals())    # the report of the last call
    ir.save(model, "encoder.matmul.onnx")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import onnx_ir as ir

from onnx_conv2matmul._graphs import (
    NameAllocator,
    count_nodes,
    count_op,
    default_opset,
    used_names,
)
from onnx_conv2matmul.rewrite.analysis import analyze
from onnx_conv2matmul.rewrite.apply import Rewriter
from onnx_conv2matmul.rewrite.cleanup import cancel_transposes, remove_dead_weights, sink_transposes
from onnx_conv2matmul.rewrite.constants import MATMUL_WEIGHTS, WEIGHT_INPUTS, lift_weight_constants
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.report import ConvertReport


@dataclasses.dataclass
class ConvToMatMulResult(ir.passes.PassResult):
    """A :class:`~onnx_ir.passes.PassResult` with the rewrite's report."""

    report: ConvertReport = dataclasses.field(default_factory=ConvertReport)


class ConvToMatMulPass(ir.passes.InPlacePass):
    """Rewrite every pointwise Conv that can be proven exact into MatMul, in place.

    The steps, in order:

    0. Lift the weights held in ``Constant`` nodes and read by an input of ``lift`` into
       initializers (:mod:`~onnx_conv2matmul.rewrite.constants`): exact, and what onnxruntime's
       quantizers need to see them.
    1. Analyse every Conv-like node (and, with ``options.gemm``, every Gemm) of every graph:
       a plan, or a skip with its reason.
    2. Apply the plans (:class:`~onnx_conv2matmul.rewrite.apply.Rewriter`); each node made is
       marked on ``node.meta``.
    3. Collapse the Transpose chains holding a marked node
       (:mod:`~onnx_conv2matmul.rewrite.cleanup`).
    4. Remove the weights nothing reads any more.

    Transposed weights are lazy: they are computed when the model is serialized or
    saved. ``call`` returns a :class:`ConvToMatMulResult`; the report of the last call is
    also :attr:`report` (a pass manager returns a result of its own, without the report).

    Args:
        options: What the rewrite may do (the command line's flags).
        lift: The inputs (op type: indices) whose ``Constant`` weights are lifted: MatMul's B
            by default; every weight input (``constants.WEIGHT_INPUTS``) before a quantization.
    """

    def __init__(
        self, options: ConvertOptions | None = None, *, lift: Mapping[str, tuple[int, ...]] = MATMUL_WEIGHTS
    ) -> None:
        super().__init__()
        self.options = options or ConvertOptions()
        self.lift = lift
        self.report: ConvertReport | None = None

    def requires(self, model: ir.Model) -> None:
        """The input is an onnx-ir model whose default-domain opset, if imported, is valid.

        A model that imports no default-domain opset is not refused: its convs are
        reported as ``opset_unsupported``.
        """
        if not isinstance(model, ir.Model):
            raise ir.passes.PreconditionError(f"expected an onnx_ir.Model, got {type(model).__name__}")
        opset = default_opset(model)
        if opset is not None and opset < 1:
            raise ir.passes.PreconditionError(f"invalid opset version {opset} for the default ONNX domain")

    def call(self, model: ir.Model) -> ConvToMatMulResult:
        report = ConvertReport(options=self.options.to_dict(), opset=default_opset(model))
        report.transposes_before = count_op(model, "Transpose")
        report.nodes_before = count_nodes(model)
        report.constants_lifted = lift_weight_constants(model, self.lift)
        plans, report.entries = analyze(model, self.options)
        rewriter = Rewriter(NameAllocator(used_names(model)))
        for plan in plans:
            rewriter.apply(plan)
        report.transposes_cancelled = sink_transposes(model) + cancel_transposes(model)
        report.tensors_removed = remove_dead_weights(rewriter.converted_weights)
        report.transposes_after = count_op(model, "Transpose")
        report.nodes_after = count_nodes(model)
        self.report = report
        return ConvToMatMulResult(model, modified=bool(plans or report.constants_lifted), report=report)


def rewrite_model(
    model: ir.Model, options: ConvertOptions, *, for_quantization: bool = False
) -> ConvertReport:
    """Run the pass once on ``model`` (changed in place) and return its report.

    ``for_quantization``: lift every weight held in a ``Constant`` node (``constants.WEIGHT_INPUTS``),
    not only MatMul's, as every quantization path needs.
    """
    rewrite = ConvToMatMulPass(options, lift=WEIGHT_INPUTS if for_quantization else MATMUL_WEIGHTS)
    rewrite(model)
    assert rewrite.report is not None
    return rewrite.report
