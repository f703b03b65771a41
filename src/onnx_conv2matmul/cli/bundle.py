"""The ``bundle`` command: build a bundle from a release folder, or list one (``--check``)."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from onnx_conv2matmul.bundle.layouts import (
    DEFAULT_TAG,
    LAYOUTS,
    ONNX_ASR,
    SOURCE_DECODER_JOINT,
    SOURCE_ENCODER,
)
from onnx_conv2matmul.cli.common import (
    OUTCOME,
    emit_report,
    files_read,
    handled_errors,
    progress_for,
    quiet_onnxruntime,
    stderr_console,
)
from onnx_conv2matmul.cli.flags import build_verify_options, nbits_given
from onnx_conv2matmul.cli.quantize import parse_bits_for, quantize_command
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files.checks import check_report_target
from onnx_conv2matmul.quantize.options import resolve
from onnx_conv2matmul.rewrite.options import ConvertOptions

# The quantize command's options that apply to the bundle's encoder (and its checks and report).
_ENCODER_OPTIONS = (
    "bits",
    "block_size",
    "symmetric",
    "accuracy_level",
    "exclude",
    "include",
    "bits_for",
    "algorithm",
    "config",
    "inputs",
    "strict_conv1x1",
    "no_dilation",
    "max_dilation",
    "allow_added_transposes",
    "no_gemm",
    "min_cosine",
    "criterion",
    "other_weights",
    "auto",
    "max_evaluations",
    "no_bench",
    "bench_lengths",
    "bench_rounds",
    "skip_checker",
    "report_json",
    "report_json_stdout",
    "quiet",
)


@click.command("bundle")
@click.argument("paths", nargs=-1, metavar="SRC_DIR OUT_DIR", type=click.Path())
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default=ONNX_ASR,
    show_default=True,
    help=(
        "onnx-asr: encoder-model.Q.onnx, decoder_joint-model.Q.onnx, vocab.txt, config.json."
        " sherpa-onnx: encoder, decoder and joiner (split out of decoder_joint), tokens.txt, metadata."
    ),
)
@click.option(
    "--quantization",
    "tag",
    default=DEFAULT_TAG,
    show_default=True,
    metavar="Q",
    help="onnx-asr: the quantization= value the bundle loads with (its files' suffix).",
)
@click.option(
    "--check",
    "check_dir",
    metavar="DIR",
    type=click.Path(),
    default=None,
    help="Build nothing: list the models in DIR with their external data, sizes and the total.",
)
@click.option(
    "--manifest",
    type=click.Path(dir_okay=False),
    default=None,
    help=(
        "With --check: write a JSON manifest, every file of every model with its size and sha256, and"
        " each model's quantization settings and accuracy from MODEL.report.json beside it (a built"
        " bundle holds one as manifest.json)."
    ),
)
def bundle_command(
    paths: tuple[str, ...], layout: str, tag: str, check_dir: str | None, manifest: str | None, **kwargs: Any
) -> None:
    """Quantize the fp32 release folder SRC_DIR into a folder OUT_DIR that a speech runtime loads.

    SRC_DIR holds encoder-model.onnx (with its data), decoder_joint-model.onnx, vocab.txt and
    optionally config.json. The encoder is quantized as by quantize (its options apply, --auto
    included), the decoder side with int8 dynamic quantization; every model's accuracy is
    measured, and OUT_DIR gets the models, their reports, the vocabulary and manifest.json.
    """
    if check_dir is not None:
        _check(check_dir, paths, manifest, bool(kwargs["report_json_stdout"]))
        return
    OUTCOME.start(bool(kwargs["report_json_stdout"]), paths[0] if paths else "", quiet=bool(kwargs["quiet"]))
    with handled_errors():
        quiet_onnxruntime()
        if len(paths) != 2:
            hint = " (to list a bundle: bundle --check DIR)" if len(paths) == 1 else ""
            raise click.UsageError(f"bundle takes SRC_DIR and OUT_DIR{hint}")
        if manifest is not None:
            raise click.UsageError("--manifest goes with --check: a built bundle holds manifest.json")
        report = _build(paths[0], paths[1], layout, tag, kwargs)
    sys.exit(report.return_code)


def _build(src: str, out: str, layout: str, tag: str, kwargs: dict[str, Any]) -> Any:
    from onnx_conv2matmul.bundle.build import BundleOptions
    from onnx_conv2matmul.cli.render.bundle import print_bundle_build_report

    quiet = bool(kwargs["quiet"])
    console = stderr_console(quiet)
    report_json = kwargs["report_json"]
    # First: every error from here on ends in the report too.
    sources = [os.path.join(src, name) for name in (SOURCE_ENCODER, SOURCE_DECODER_JOINT)]
    read = files_read(kwargs["inputs"], kwargs.get("validate"), kwargs["config"])
    OUTCOME.claim_report(report_json, inputs=sources, outputs=[], read=read)
    given = nbits_given(
        bits=kwargs["bits"],
        block_size=kwargs["block_size"],
        symmetric=kwargs["symmetric"],
        accuracy_level=kwargs["accuracy_level"],
        exclude=kwargs["exclude"],
        include=kwargs["include"],
        bits_for=parse_bits_for(kwargs["bits_for"]),
        algorithm=kwargs["algorithm"],
        other_weights=kwargs["other_weights"],
    )
    resolved = resolve(
        given,
        config=kwargs["config"],
        int8_dynamic=False,
        auto=kwargs["auto"],
        min_cosine=kwargs["min_cosine"],
        max_evaluations=kwargs["max_evaluations"],
        save_config=False,
        bench=not kwargs["no_bench"],
        bench_lengths=kwargs["bench_lengths"],
        bench_rounds=kwargs["bench_rounds"],
    )
    try:
        convert = ConvertOptions(
            extended=not kwargs["strict_conv1x1"],
            allow_non_unit_dilation=not kwargs["no_dilation"],
            max_dilation=kwargs["max_dilation"],
            allow_added_transposes=kwargs["allow_added_transposes"],
            gemm=not kwargs["no_gemm"],
        )
    except ValueError as err:
        raise InputError(str(err)) from err
    verify = build_verify_options(kwargs, kwargs["min_cosine"], kwargs["inputs"])
    OUTCOME.watch(out, report_json)
    encoder = os.path.join(src, SOURCE_ENCODER)
    options = BundleOptions(
        layout=layout,
        quantize=resolved.quantize,
        convert=convert,
        verify=verify,
        auto=resolved.auto,
        speed=resolved.speed,
        search_below=resolved.search_below,
        tag=tag,
        run_checker=not kwargs["skip_checker"],
    )
    progress = progress_for(console, encoder, quiet) if os.path.isfile(encoder) else None
    from onnx_conv2matmul import api

    report = api.build_bundle(src, out, options, progress=progress)
    print_bundle_build_report(console, report)
    error = None
    if not report.passed and any(not m.passed for m in report.models) and kwargs["min_cosine"] is not None:
        error = f"accuracy below --min-cosine {kwargs['min_cosine']:g}; nothing was written"
    emit_report(report, report_json, error)
    return report


def _check(directory: str, paths: tuple[str, ...], manifest: str | None, json_stdout: bool) -> None:
    OUTCOME.start(json_stdout, directory)
    with handled_errors():
        if paths:
            raise click.UsageError("--check DIR lists a bundle: give no SRC_DIR OUT_DIR with it")
        from onnx_conv2matmul.cli.render.bundle import print_bundle_report

        console = stderr_console(False)
        if manifest is not None:
            models = [os.path.join(directory, n) for n in _onnx_names(directory)]
            # Every file of the folder is the check's input, or the bundle's own (its manifest).
            check_report_target(manifest, inputs=models, outputs=[], read=[directory])
            OUTCOME.watch(manifest)
        from onnx_conv2matmul import api

        report = api.check_bundle(directory, manifest=manifest is not None)
        print_bundle_report(console, report)
        emit_report(report, manifest)


def _onnx_names(directory: str) -> list[str]:
    """The .onnx files in ``directory`` (none when it is not one: the command says so later)."""
    try:
        return [name for name in os.listdir(directory) if name.endswith(".onnx")]
    except OSError:
        return []


def _add_encoder_options() -> None:
    """Give ``bundle`` the quantize command's options for the encoder (same flags, same help)."""
    by_name = {param.name: param for param in quantize_command.params}
    verify = [p for p in quantize_command.params if p.name and p.name.startswith("verify_")]
    bundle_command.params.extend([by_name[name] for name in _ENCODER_OPTIONS] + verify)


_add_encoder_options()
