"""One function per command, each returning its typed report; the command line calls these.

``convert`` (a model in memory), :func:`convert_file`, :func:`verify_files`, :func:`quantize_file`,
:func:`inspect_file`, :func:`check_bundle` and :func:`build_bundle`. None of them prints, handles a
signal or exits: errors are :mod:`onnx_conv2matmul.errors`' exceptions, outcomes are reports (``return_code``
is what the command line exits with). onnx-ir and onnxruntime are imported on first use.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, overload

import onnx

from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files.checks import check_input_path, check_kept_path, check_paths
from onnx_conv2matmul.files.load import load_input
from onnx_conv2matmul.files.progress import NullProgress, Progress
from onnx_conv2matmul.rewrite.options import ConvertOptions
from onnx_conv2matmul.rewrite.report import ConvertReport
from onnx_conv2matmul.verify.check import VerifyOptions, verify_models

if TYPE_CHECKING:
    # onnx-ir and the rewrite are imported where used, so that convert_file has parsed its
    # input and started copying its data file before importing them (the copy starts sooner).
    from collections.abc import Sequence

    import onnx_ir as ir

    from onnx_conv2matmul.bundle.build import BundleOptions
    from onnx_conv2matmul.bundle.report import BundleBuildReport
    from onnx_conv2matmul.quantize.metric import MetricTarget
    from onnx_conv2matmul.quantize.options import AutoOptions, QuantizeOptions
    from onnx_conv2matmul.quantize.report import BundleReport, InspectReport, QuantizeReport
    from onnx_conv2matmul.quantize.transposes import TransposeOptions
    from onnx_conv2matmul.speed.bench import BenchReport
    from onnx_conv2matmul.speed.choose import SpeedOptions
    from onnx_conv2matmul.speed.timing import TimingOptions
    from onnx_conv2matmul.verify.report import VerifyCommandReport

FAILED_SUFFIX = ".verify-failed"


@overload
def convert(model: ir.Model, options: ConvertOptions | None = None) -> tuple[ir.Model, ConvertReport]: ...
@overload
def convert(
    model: onnx.ModelProto, options: ConvertOptions | None = None
) -> tuple[onnx.ModelProto, ConvertReport]: ...
def convert(
    model: ir.Model | onnx.ModelProto, options: ConvertOptions | None = None
) -> tuple[ir.Model | onnx.ModelProto, ConvertReport]:
    """Rewrite every pointwise Conv that can be proven exact into MatMul.

    An onnx-ir model is changed in place and returned; a ModelProto is not
    changed: a new one is returned. Weights are transposed lazily, when the
    model is serialized or saved.
    """
    from onnx_conv2matmul.rewrite.passes import rewrite_model

    options = options or ConvertOptions()
    if isinstance(model, onnx.ModelProto):
        import onnx_ir as ir

        ir_model = ir.serde.deserialize_model(model)
        report = rewrite_model(ir_model, options)
        return ir.serde.serialize_model(ir_model), report
    return model, rewrite_model(model, options)


def convert_file(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str] | None,
    options: ConvertOptions | None = None,
    *,
    inplace: bool = False,
    run_checker: bool = True,
    verify: VerifyOptions | None = None,
    keep_on_failure: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Rewrite the model at ``input_path`` and write it to ``output_path``.

    The output gets one ``<output>.data`` file when the input had external data
    or when it would not fit in one file. Nothing is written at the destination
    unless every step succeeded.

    With ``verify``, the written model is compared with the input in
    onnxruntime before it is published; when they differ the report says so
    (``return_code`` 1) and nothing is published, except with ``keep_on_failure``,
    which moves the files to ``<output>.verify-failed/``.

    Raises:
        InputError: bad paths or input file, or with ``keep_on_failure`` a
            ``<output>.verify-failed`` that is not a directory (nothing is written).
        CheckerError: the ONNX checker rejected the result (nothing is written).
        ModelRunError: the input model cannot run on the synthesised inputs.
    """
    options = options or ConvertOptions()
    progress = progress or NullProgress()
    try:
        src = os.fspath(input_path)
        dst = check_paths(src, os.fspath(output_path) if output_path is not None else None, inplace=inplace)
        if keep_on_failure and verify is not None:
            check_kept_path(dst + FAILED_SUFFIX)
        with _output.Output(dst, source=None if inplace else src) as output:
            return _convert_to(src, output, options, inplace, run_checker, verify, keep_on_failure, progress)
    finally:
        progress.close()


def _convert_to(
    src: str,
    output: _output.Output,
    options: ConvertOptions,
    inplace: bool,
    run_checker: bool,
    verify: VerifyOptions | None,
    keep_on_failure: bool,
    progress: Progress,
) -> ConvertReport:
    dst = output.path
    timings: dict[str, float] = {}
    loaded = load_input(
        src, dst, inplace=inplace, run_checker=run_checker, progress=progress, timings=timings, output=output
    )
    modes = _output.file_modes(loaded.path, loaded.external_files)
    start = time.perf_counter()
    progress.phase("Rewriting")
    model, report = convert(loaded.model, options)
    timings["rewrite"] = time.perf_counter() - start
    report.input_path = src
    report.input_bytes = loaded.total_bytes
    report.timings = timings  # filled in as the steps run
    start = time.perf_counter()
    progress.phase("Saving")
    # External data when the input had it, or when the model is too big for one file.
    external = loaded.has_external_data or _io.tensor_bytes(model) > _io.SINGLE_FILE_LIMIT_BYTES
    with output.stage(model, external=external, progress=progress.advance) as staged:
        timings["save"] = time.perf_counter() - start
        if run_checker:
            progress.phase("Checking the output")
            start = time.perf_counter()
            _io.run_checker(staged.onnx_path, "the rewritten model")
            timings["checker"] = time.perf_counter() - start
            report.checker = "passed"
        else:
            report.checker = "skipped"
        report.output_bytes = staged.size
        report.external_data = staged.data_path is not None
        if verify is not None:
            progress.phase("Verifying")
            start = time.perf_counter()
            result = verify_models(src, staged.onnx_path, verify)
            timings["verify"] = time.perf_counter() - start
            result.candidate = dst
            report.verification = result
            if not result.passed:
                # Nothing at the destination; with keep_on_failure the files go aside.
                report.output_path = staged.keep(dst + FAILED_SUFFIX, modes) if keep_on_failure else None
                return report
        progress.phase("Publishing")
        staged.publish(modes)
    report.output_path = dst
    return report


def verify_files(
    original: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    options: VerifyOptions | None = None,
) -> VerifyCommandReport:
    """Run two models with the same inputs and outputs in onnxruntime and compare the outputs.

    ``options`` chooses the inputs (synthesised, or real ones in ``feeds``) and the criterion
    (exact-rewrite tolerances by default, or ``min_cosine`` for a quantized candidate). The
    report's ``return_code`` is 1 when an output differs.

    Raises:
        InputError: a path that is not a readable file, or a check that does not fit the
            memory budget (``options.memory``).
        ModelRunError: a model that onnxruntime cannot load (the original or the candidate),
            or an original it cannot run on those inputs (a candidate that fails to run
            fails the comparison).
        OutOfMemory: memory ran out during the check.
    """
    from onnx_conv2matmul.verify.report import VerifyCommandReport

    paths = [os.fspath(original), os.fspath(candidate)]
    for path in paths:
        check_input_path(path)
    return VerifyCommandReport(verify_models(paths[0], paths[1], options, candidate_given=True))


def quantize_file(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    options: QuantizeOptions | None = None,
    *,
    int8_dynamic: bool = False,
    auto: AutoOptions | None = None,
    convert_options: ConvertOptions | None = None,
    verify: VerifyOptions | None = None,
    run_checker: bool = True,
    progress: Progress | None = None,
    speed: SpeedOptions | None = None,
    metric: MetricTarget | None = None,
    search_below: bool | None = None,
    transposes: TransposeOptions | None = None,
) -> QuantizeReport:
    """Rewrite pointwise convs and Gemms, quantize, compare with the input, then publish.

    ``options``: the MatMulNBits settings (:class:`~onnx_conv2matmul.quantize.options.QuantizeOptions`;
    :func:`~onnx_conv2matmul.quantize.options.resolve` builds them from a settings file and checks
    combinations as the command line does). ``int8_dynamic``: onnxruntime's ``quantize_dynamic``
    instead. ``auto``: search for the smallest settings meeting its target (they replace
    ``options``). ``convert_options``: the rewrite (extended mode and dilation on by default here).
    ``verify``: the inputs of the accuracy check and its criterion: ``min_cosine`` for every
    sample, by default the floor 0.99 (``report_only`` measures only). ``metric``: the user's
    score of a model file and its largest drop, as the criterion (and the search's target).
    Nothing is written unless the result met the criterion. Below it, ``search_below`` (by
    default: when ``options`` is None, no ``auto``, not ``int8_dynamic``) runs the search with
    the same criterion and writes its model instead, with a warning. ``speed``: time the result
    against the input on this CPU and, where it leaves several kernel settings (accuracy levels,
    block sizes), keep the fastest that meets the same criterion
    (:class:`~onnx_conv2matmul.speed.choose.SpeedOptions`, which
    :func:`~onnx_conv2matmul.quantize.options.resolve` builds as the command line does); None
    (the default here) times nothing. ``transposes``: weigh the pointwise convs whose rewrite
    adds Transposes by measurement and keep them or not by its preference
    (:class:`~onnx_conv2matmul.quantize.transposes.TransposeOptions`; None, the default here,
    leaves them as ``convert_options`` says).

    Raises:
        InputError: bad paths, options or inputs (nothing is written).
        ValidationError: the metric's function fails or returns no number.
        TargetUnreachable: with ``auto`` (or a search below the criterion), the target is not
            met even in float.
    """
    from onnx_conv2matmul.quantize import workflow
    from onnx_conv2matmul.quantize.plan import Request

    request = Request(
        quantize=options,
        int8=int8_dynamic,
        auto=auto,
        convert=convert_options,
        verify=verify,
        run_checker=run_checker,
        progress=progress,
        speed=speed,
        metric=metric,
        search_below=search_below,
        transposes=transposes,
    )
    return workflow.quantize_file(input_path, output_path, request)


def bench_models(
    paths: Sequence[str | os.PathLike[str]],
    lengths: Sequence[int] | None = None,
    *,
    baseline: int = 0,
    options: TimingOptions | None = None,
) -> BenchReport:
    """Time the models at ``paths`` side by side on this CPU (batch 1, interleaved rounds),
    against ``paths[baseline]``; a warning names each quantized model slower than a float
    baseline (:func:`onnx_conv2matmul.speed.bench.bench_models`).

    Raises:
        InputError: a path that is not a readable ONNX file, before any timing.
    """
    from onnx_conv2matmul.speed import bench

    for path in paths:
        _io.parse_model(os.fspath(path))
    return bench.bench_models(paths, lengths, baseline=baseline, options=options)


def inspect_file(
    path: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    quantize_options: QuantizeOptions | None = None,
    *,
    run_checker: bool = True,
) -> InspectReport:
    """What :func:`convert_file` with ``options`` would do to the model at ``path``, and what
    MatMulNBits with ``quantize_options`` would make of the result; reads the ``.onnx`` only and
    writes nothing."""
    from onnx_conv2matmul.quantize.inspection import inspect_file as inspect

    return inspect(path, options, quantize_options, run_checker=run_checker)


def check_bundle(directory: str | os.PathLike[str], *, manifest: bool = False) -> BundleReport:
    """The models in ``directory`` with their external data, sizes and the total; with
    ``manifest``, every file's size and sha256 and each model's settings and accuracy from the
    ``.report.json`` beside it. ``report.to_dict()`` is the manifest."""
    from onnx_conv2matmul.bundle.listing import bundle_report

    return bundle_report(os.fspath(directory), manifest=manifest)


def build_bundle(
    source_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    options: BundleOptions | None = None,
    *,
    progress: Progress | None = None,
) -> BundleBuildReport:
    """Quantize the fp32 release folder ``source_dir`` (``encoder-model.onnx`` with its data,
    ``decoder_joint-model.onnx``, ``vocab.txt``, optionally ``config.json``) into a folder
    ``output_dir`` that onnx-asr or sherpa-onnx loads (``options.layout``); see
    :mod:`onnx_conv2matmul.bundle.build`. Nothing is written when an accuracy check fails."""
    from onnx_conv2matmul.bundle.build import build_bundle as build

    return build(source_dir, output_dir, options, progress=progress)
