"""Build a bundle: a release folder in, a quantized folder a speech runtime loads out.

:func:`build_bundle` takes the fp32 Parakeet-style release folder (``encoder-model.onnx`` with
its data, ``decoder_joint-model.onnx``, ``vocab.txt``, optionally ``config.json``) and writes
the layout's files (see :mod:`onnx_conv2matmul.bundle.layouts`):

* the encoder through the quantize command's own path (:func:`quantize.workflow.quantize_file`:
  rewrite, MatMulNBits, accuracy check), with the options given (``auto`` included);
* the decoder_joint (onnx-asr), or the decoder and joiner split out of it exactly
  (sherpa-onnx, :mod:`onnx_conv2matmul.bundle.split`, checked in onnxruntime), through
  onnxruntime's int8 dynamic quantization;
* each model's quantize report beside it (``<model>.report.json``), the vocabulary, onnx-asr's
  ``config.json`` (the source's, with the keys it lacks derived from the models) or
  sherpa-onnx's metadata in the encoder, and ``manifest.json`` (every file with its size
  and sha256, each model's settings and accuracy).

Everything is written in a hidden staging directory beside the output folder, under the
output's lock, and renamed into place at the end: the output folder is the old one or the
new one, never a mix. An output folder that exists must be empty or a bundle this tool wrote,
unchanged (its manifest's record names every entry, see :mod:`onnx_conv2matmul.bundle.record`):
such a bundle is replaced whole; anything else is refused before any work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING

import onnx

from onnx_conv2matmul.bundle import layouts, record
from onnx_conv2matmul.bundle.layouts import Role
from onnx_conv2matmul.bundle.listing import bundle_report, report_path_for
from onnx_conv2matmul.bundle.report import BundleBuildReport, BundleFile, BundleModelResult
from onnx_conv2matmul.bundle.split import split_decoder_joint, verify_split
from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.files import output as _output
from onnx_conv2matmul.files import publish as _publish
from onnx_conv2matmul.files.paths import model_file_bytes
from onnx_conv2matmul.quantize.options import QuantizeOptions
from onnx_conv2matmul.quantize.plan import Request
from onnx_conv2matmul.quantize.workflow import quantize_file
from onnx_conv2matmul.verify.check import VerifyOptions

if TYPE_CHECKING:
    from onnx_conv2matmul.files.progress import Progress
    from onnx_conv2matmul.quantize.options import AutoOptions
    from onnx_conv2matmul.quantize.report import QuantizeReport
    from onnx_conv2matmul.rewrite.options import ConvertOptions
    from onnx_conv2matmul.speed.choose import SpeedOptions

logger = logging.getLogger(__name__)

# The decoder-side models run one step at a time; longer check inputs only cost memory
# (a joint's output is [B, T, U, classes]).
DECODER_CHECK = VerifyOptions(lengths=(1, 8), report_only=True)
# Encoder frames fed when the subsampling factor is read from the encoder itself.
_PROBE_FRAMES = 800


@dataclasses.dataclass
class BundleOptions:
    """How the models are quantized.

    Attributes:
        layout: ``onnx-asr`` or ``sherpa-onnx``.
        quantize: The encoder's MatMulNBits settings (default: the quantize command's).
        convert: The rewrite options of the encoder (default: the quantize command's).
        verify: The encoder's accuracy check (inputs, ``min_cosine``).
        auto: Search the encoder's settings (see :mod:`onnx_conv2matmul.quantize.search`).
        search_below: Below the accuracy criterion, search for settings that meet it, as
            ``quantize`` does with its default settings (None: when no settings were given).
        speed: Time the encoder's kernel settings on this CPU and keep the fastest that meets the
            accuracy target (:class:`~onnx_conv2matmul.speed.choose.SpeedOptions`); None: as given.
        tag: The onnx-asr ``quantization`` value the files are named for.
        run_checker: Run the ONNX checker on inputs and outputs.
    """

    layout: str = layouts.ONNX_ASR
    quantize: QuantizeOptions | None = None
    convert: ConvertOptions | None = None
    verify: VerifyOptions | None = None
    auto: AutoOptions | None = None
    speed: SpeedOptions | None = None
    search_below: bool | None = None
    tag: str = layouts.DEFAULT_TAG
    run_checker: bool = True


@dataclasses.dataclass
class Source:
    directory: str
    encoder: str
    decoder_joint: str
    vocab: layouts.Vocabulary
    vocab_path: str
    config: dict[str, object] | None
    config_path: str | None


def read_source(directory: str) -> Source:
    if not os.path.isdir(directory):
        raise InputError(f"source is not a directory: {directory}")
    paths = {}
    for name in (layouts.SOURCE_ENCODER, layouts.SOURCE_DECODER_JOINT, layouts.SOURCE_VOCAB):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise InputError(
                f"{name} not found in {directory}: the source is the fp32 release folder"
                f" ({layouts.SOURCE_ENCODER} with its data, {layouts.SOURCE_DECODER_JOINT},"
                f" {layouts.SOURCE_VOCAB}, optionally {layouts.SOURCE_CONFIG})"
            )
        paths[name] = path
    config_path = layouts.config_file_path(directory)
    return Source(
        directory,
        paths[layouts.SOURCE_ENCODER],
        paths[layouts.SOURCE_DECODER_JOINT],
        layouts.read_vocab(paths[layouts.SOURCE_VOCAB]),
        paths[layouts.SOURCE_VOCAB],
        layouts.read_config(config_path) if config_path else None,
        config_path,
    )


def _static_dim(value: onnx.ValueInfoProto, axis: int, what: str) -> int:
    dims = value.type.tensor_type.shape.dim
    if len(dims) <= axis or not dims[axis].HasField("dim_value"):
        raise InputError(f"{what}: input {value.name!r} has no fixed size on axis {axis}")
    return int(dims[axis].dim_value)


def model_facts(source: Source) -> layouts.ModelFacts:
    """Read the bundle's settings from the source models (and config.json, when present)."""
    encoder = onnx.load(source.encoder, load_external_data=False)
    decoder = onnx.load(source.decoder_joint, load_external_data=False)
    if not encoder.graph.input or len(decoder.graph.input) < 4 or not decoder.graph.output:
        raise InputError(f"{source.decoder_joint} is not a decoder_joint model with LSTM states")
    features = _static_dim(encoder.graph.input[0], 1, source.encoder)
    state = decoder.graph.input[3]
    joint_outputs = _static_dim(decoder.graph.output[0], 3, source.decoder_joint)
    subsampling = (source.config or {}).get("subsampling_factor")
    if not isinstance(subsampling, int):
        subsampling = _probe_subsampling(source.encoder, features)
    facts = layouts.ModelFacts(
        features=features,
        subsampling=subsampling,
        pred_layers=_static_dim(state, 0, source.decoder_joint),
        pred_hidden=_static_dim(state, 2, source.decoder_joint),
        joint_outputs=joint_outputs,
        vocab_size=source.vocab.size_without_blank,
    )
    if facts.durations < 0:
        raise InputError(
            f"{source.vocab_path} has {len(source.vocab.tokens)} tokens with the blank, more than"
            f" the joint's {joint_outputs} outputs"
        )
    return facts


def _probe_subsampling(encoder_path: str, features: int) -> int:
    """Input frames per output frame, from one run of the encoder."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # fatal only: the error is in the exception
    session = ort.InferenceSession(encoder_path, options, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    feeds = {
        inputs[0].name: np.zeros((1, features, _PROBE_FRAMES), dtype=np.float32),
        inputs[1].name: np.array([_PROBE_FRAMES], dtype=np.int64),
    }
    _, lengths = session.run(None, feeds)[:2]
    frames = int(np.asarray(lengths).reshape(-1)[0])
    if frames <= 0:
        return layouts.DEFAULT_SUBSAMPLING
    return max(1, round(_PROBE_FRAMES / frames))


def _min_cosine(report: QuantizeReport) -> float | None:
    if report.verification is None:
        return None
    data = report.verification.to_dict()
    cosines = [row["cosine"] for row in data.get("results", []) if row.get("cosine") is not None]
    return min(cosines) if cosines else None


def _write_report(model_path: str, report: QuantizeReport, published: str, origin: str | None = None) -> None:
    """The model's report beside it, naming where the model is published (``published``), not
    the staging directory it was written in; ``origin``: the user's file it was made from, when
    the input quantized was a part split from it in a scratch folder."""
    data = report.to_dict()
    shown = os.path.join(published, os.path.basename(model_path))
    if data.get("output") is not None:
        data["output"] = shown
    verification = data.get("verification") or {}
    if verification.get("candidate") is not None:
        verification["candidate"] = shown
    if origin is not None:
        data["input"] = origin
    _io.write_text_atomic(report_path_for(model_path), json.dumps(data, indent=2) + "\n")


def _check_output_dir(path: str, source: str) -> None:
    if not path:
        raise InputError("output folder path is empty")
    real = os.path.realpath(path)
    if real == os.path.realpath(source) or real.startswith(os.path.realpath(source) + os.sep):
        raise InputError(f"output folder {path} is the source folder or inside it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"output folder's parent does not exist: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output folder's parent is not writable: {parent}")
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isdir(path):
            raise InputError(f"output exists and is not a folder: {path}")
        record.refuse_unless_ours(path)


def build_bundle(
    source_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    options: BundleOptions | None = None,
    *,
    progress: Progress | None = None,
) -> BundleBuildReport:
    """Build a bundle of ``source_dir`` (the fp32 release folder) in ``output_dir``.

    Raises:
        InputError: a source folder without the release's files, an unusable output folder,
            a vocabulary or config that cannot be read, a decoder_joint that cannot be split.
        DestinationBusy: another run is writing ``output_dir``.
    """
    started = time.perf_counter()
    options = options or BundleOptions()
    layouts.check_layout(options.layout)
    layouts.check_tag(options.tag)
    src = os.fspath(source_dir)
    out = os.path.abspath(os.fspath(output_dir))
    source = read_source(src)
    _check_output_dir(out, src)
    facts = model_facts(source)
    report = BundleBuildReport(source_dir=src, layout=options.layout)
    if options.layout == layouts.ONNX_ASR:
        report.onnx_asr_quantization = options.tag
    used = [source.encoder, source.decoder_joint, source.vocab_path]
    report.source_bytes = (
        model_file_bytes(source.encoder)
        + model_file_bytes(source.decoder_joint)
        + os.path.getsize(source.vocab_path)
        + (os.path.getsize(source.config_path) if source.config_path else 0)
    )
    logger.debug("bundle %s -> %s (%s), inputs %s", src, out, options.layout, used)
    with _publish.Destination(out) as destination:
        staging = destination.staging_dir()
        _build_into(staging, destination.staging_dir(), source, facts, options, report, progress, out)
        if report.passed:
            if os.path.isdir(out) and not os.path.islink(out):
                record.refuse_unless_ours(out)  # again: the folder may have changed meanwhile
            _publish.publish_directory(staging, out)
            report.output_dir = out
    report.seconds = time.perf_counter() - started
    return report


def _build_into(
    staging: str,
    scratch: str,
    source: Source,
    facts: layouts.ModelFacts,
    options: BundleOptions,
    report: BundleBuildReport,
    progress: Progress | None,
    published: str,
) -> None:
    """Build the bundle into ``staging``; ``published``: the folder it becomes (the reports and
    the manifest name it)."""
    layout = options.layout
    bits = (options.quantize or QuantizeOptions()).bits
    roles = {role.name: role for role in layouts.ROLES[layout]}
    encoder_name = layouts.file_name(layout, roles["encoder"], options.tag, bits)
    encoder_report = quantize_file(
        source.encoder,
        os.path.join(staging, encoder_name),
        Request(
            convert=options.convert,
            quantize=options.quantize,
            verify=options.verify,
            run_checker=options.run_checker,
            progress=progress,
            auto=options.auto,
            speed=options.speed,
            search_below=options.search_below,
        ),
    )
    report.models.append(_result("encoder", encoder_name, staging, encoder_report))
    if encoder_report.output_path is None:
        return
    _write_report(os.path.join(staging, encoder_name), encoder_report, published)
    if layout == layouts.ONNX_ASR:
        name = layouts.file_name(layout, roles["decoder_joint"], options.tag, bits)
        _int8(source.decoder_joint, staging, name, "decoder_joint", options, report, published)
        report.config = layouts.onnx_asr_config(source.config, facts)
        config_text = json.dumps(report.config, indent=4) + "\n"
        _io.write_text_atomic(os.path.join(staging, layouts.SOURCE_CONFIG), config_text)
    else:
        report.metadata = layouts.sherpa_metadata(facts)
        _publish.set_metadata(os.path.join(staging, encoder_name), report.metadata)
        _split_and_quantize(source, staging, scratch, roles, options, report, published)
    _io.write_text_atomic(os.path.join(staging, layouts.vocab_file(layout)), source.vocab.text())
    if not report.passed:
        return
    listing = bundle_report(staging, manifest=True)
    listing.directory = published  # the folder the user named, not the staging one
    manifest = json.dumps({**listing.to_dict(), record.KEY: record.record(staging)}, indent=2) + "\n"
    _io.write_text_atomic(os.path.join(staging, layouts.MANIFEST), manifest)
    owners = {}
    for model in listing.models:
        for name in (model.name, *model.external_data):
            owners[name] = model.name
        owners[os.path.basename(report_path_for(model.name))] = model.name
    for name in sorted(os.listdir(staging)):
        path = os.path.join(staging, name)
        if os.path.isfile(path) and not name.startswith("."):
            report.files.append(BundleFile(name, os.path.getsize(path), owners.get(name)))


def _result(role: str, name: str, staging: str, quantized: QuantizeReport) -> BundleModelResult:
    passed = quantized.output_path is not None
    return BundleModelResult(
        role=role,
        file=name,
        mode=quantized.mode,
        bytes=quantized.output_bytes if passed else 0,
        source_bytes=quantized.input_bytes,
        min_cosine=_min_cosine(quantized),
        passed=passed,
        report=quantized.to_dict(),
    )


def _int8(
    source_path: str,
    staging: str,
    name: str,
    role: str,
    options: BundleOptions,
    report: BundleBuildReport,
    published: str,
    origin: str | None = None,
) -> None:
    quantized = quantize_file(
        source_path,
        os.path.join(staging, name),
        Request(convert=options.convert, int8=True, verify=DECODER_CHECK, run_checker=options.run_checker),
    )
    report.models.append(_result(role, name, staging, quantized))
    if quantized.output_path is not None:
        _write_report(os.path.join(staging, name), quantized, published, origin)


def _split_and_quantize(
    source: Source,
    staging: str,
    scratch: str,
    roles: dict[str, Role],
    options: BundleOptions,
    report: BundleBuildReport,
    published: str,
) -> None:
    """Split decoder_joint into float models in ``scratch``, check them, quantize into ``staging``.

    ``scratch`` is a staging directory of the destination: it is removed with it.
    """
    parts = split_decoder_joint(_io.load_model(source.decoder_joint).model)
    paths = {}
    for role, model in (("decoder", parts.decoder), ("joiner", parts.joiner)):
        paths[role] = os.path.join(scratch, f"{role}.onnx")
        external = _io.tensor_bytes(model) > _io.SINGLE_FILE_LIMIT_BYTES
        _output.save(model, paths[role], f"{role}.onnx.data" if external else None)
    del parts
    report.split = verify_split(
        source.decoder_joint,
        paths["decoder"],
        paths["joiner"],
        vocab_size=len(source.vocab.tokens),
    )
    if not report.split.passed:
        return
    for role in ("decoder", "joiner"):
        name = layouts.file_name(options.layout, roles[role], options.tag)
        _int8(paths[role], staging, name, role, options, report, published, origin=source.decoder_joint)
