"""The quantize workflow's search runs: the ``--auto`` search (see
:mod:`onnx_conv2matmul.quantize.search`) on the inputs the accuracy check uses, in a scratch
directory beside the output, and what the report keeps of it once that directory goes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.quantize.run import Run
    from onnx_conv2matmul.quantize.search import Prepared


def run_search(run: Run, workdir: str, model: ir.Model | Prepared, speed_filter: Any = None) -> None:
    """Run the search for ``run.auto`` on the inputs the accuracy check uses (given or
    synthesised), in ``workdir`` (a scratch directory beside the output, under its guard: see
    :meth:`onnx_conv2matmul.files.output.Output.scratch`); its result goes to ``run.report.auto``."""
    from onnx_conv2matmul.quantize import search as auto_search
    from onnx_conv2matmul.quantize.reference import feed_set

    plan = run.plan
    assert run.auto is not None
    if plan.verify.feeds is None:
        plan.progress.phase("Synthesising inputs")
    feeds = feed_set(plan.src, plan.verify)
    run.report.auto = auto_search.search(
        model,
        feeds,
        run.auto,
        workdir,
        deterministic=plan.verify.deterministic,
        progress=plan.progress.phase,
        original_score=run.original_score,
        memory=plan.verify.memory,
        speed_filter=speed_filter,
        check=plan.verify,
    )


def drop_reference(report: QuantizeReport) -> None:
    """The search's reference files go with its scratch directory: the report keeps none."""
    if report.auto is not None:
        report.auto.reference = report.auto.cache = None
