"""The bundle command's listing: every model in a folder with its external data and sizes, and
with ``--manifest`` each file's sha256 and the settings and accuracy of the quantize report beside
each model; what a speech-recognition bundle named like these models lacks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from onnx_conv2matmul.errors import InputError
from onnx_conv2matmul.files import load as _io
from onnx_conv2matmul.quantize.report import BundleModel, BundleReport

if TYPE_CHECKING:
    from collections.abc import Sequence


def bundle_sizes(directory: str) -> list[tuple[str, int, list[str]]]:
    """Each model in ``directory``: (file name, bytes with its external data, data files).

    Each model goes through the same loader as the rewrite, so missing or short external
    data is an error here too, and so is a directory without any ``.onnx`` file.
    """
    if not os.path.isdir(directory):
        raise InputError(f"not a directory: {directory}")
    names = [
        name
        for name in sorted(os.listdir(directory))
        if name.endswith(".onnx") and os.path.isfile(os.path.join(directory, name))
    ]
    if not names:
        raise InputError(f"no .onnx models in {directory}")
    models = []
    for name in names:
        loaded = _io.load_model(os.path.join(directory, name))
        data = sorted(os.path.relpath(f, directory) for f in loaded.external_files)
        models.append((name, loaded.total_bytes, data))
    return models


REPORT_SUFFIX = ".report.json"
"""A model's quantize report beside it: ``encoder.int4.onnx`` -> ``encoder.int4.report.json``."""


def report_path_for(model_path: str) -> str:
    """Where ``bundle`` looks for a model's quantize report (see :data:`REPORT_SUFFIX`)."""
    base = model_path[: -len(".onnx")] if model_path.endswith(".onnx") else model_path
    return base + REPORT_SUFFIX


def bundle_report(directory: str, *, manifest: bool = False) -> BundleReport:
    """The bundle command's report: :func:`bundle_sizes` as typed data.

    With ``manifest``, each model also lists its files (the ``.onnx`` and its data files)
    with their sizes and sha256, and the quantization settings and accuracy from its
    quantize report beside it (:func:`report_path_for`), when there is one.

    Raises:
        InputError: as :func:`bundle_sizes`; also a report beside a model that is not a
            quantize report.
    """
    models = []
    for name, size, data in bundle_sizes(directory):
        files = quantization = None
        if manifest:
            files = [_file_entry(directory, n) for n in (name, *data)]
            quantization = _quantization_from_report(os.path.join(directory, name))
        models.append(BundleModel(name, size, data, files, quantization))
    return BundleReport(directory, models, _bundle_warnings([m.name for m in models]))


_ENCODER_WORDS = ("encoder",)
_DECODER_WORDS = ("decoder", "joint", "joiner")


def _bundle_warnings(names: Sequence[str]) -> list[str]:
    """What a speech-recognition bundle named like these models lacks, by the files' names.

    A transducer's runtimes load the encoder together with its decoder and joint (onnx-asr:
    ``encoder-model*.onnx`` with ``decoder_joint-model*.onnx``; sherpa-onnx: an encoder, a
    decoder and a joiner): one side without the other does not load.
    """

    def named(words: tuple[str, ...]) -> list[str]:
        return [n for n in names if any(w in n.lower() for w in words)]

    encoders, decoders = named(_ENCODER_WORDS), named(_DECODER_WORDS)
    decoders = [n for n in decoders if n not in encoders]
    if encoders and not decoders:
        return [
            f"only an encoder ({', '.join(encoders)}): no decoder or joint model beside it, which"
            " speech runtimes load with it (onnx-asr: decoder_joint-model.onnx; sherpa-onnx: decoder"
            " and joiner)"
        ]
    if decoders and not encoders:
        return [
            f"no encoder model beside {', '.join(decoders)}: speech runtimes load the encoder with it"
            " (onnx-asr: encoder-model.onnx)"
        ]
    return []


def _file_entry(directory: str, name: str) -> dict[str, object]:
    import hashlib

    digest = hashlib.sha256()
    path = os.path.join(directory, name)
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as file:
        while n := file.readinto(buffer):
            digest.update(view[:n])
            size += n
    return {"path": name, "bytes": size, "sha256": digest.hexdigest()}


def _quantization_from_report(model_path: str) -> dict[str, object] | None:
    """The settings and accuracy a model's quantize report gives, or None without one."""
    import json

    path = report_path_for(model_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read the quantize report {path}: {err}") from err
    except RecursionError as err:
        raise InputError(f"not a quantize report (nested too deeply): {path}") from err
    if not isinstance(data, dict) or data.get("command") != "quantize" or "options" not in data:
        raise InputError(f"not a quantize report: {path}")
    verification = data.get("verification") or {}
    cosines: dict[str, float] = {}
    for row in verification.get("results", []):
        if row.get("cosine") is not None:
            name = row["output"]
            cosines[name] = min(cosines.get(name, 1.0), row["cosine"])
    options = data.get("options", {})
    return {
        "report": os.path.basename(path),
        "mode": data.get("mode"),
        "settings": options.get("quantize"),
        "accuracy": {
            "min_cosine_per_output": cosines,
            "min_cosine": min(cosines.values()) if cosines else None,
            "criterion": verification.get("criterion"),
            "passed": verification.get("passed"),
            "inputs": [item.get("file") for item in verification.get("input_files", [])] or "synthesised",
        },
    }
