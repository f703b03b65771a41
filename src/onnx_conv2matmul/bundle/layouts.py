"""The two bundle layouts as data: file names, vocabulary files, metadata, config.

**onnx-asr** (0.12): ``load_model("nemo-parakeet-tdt-0.6b-v3", path=DIR, quantization=Q)``
looks for ``encoder-model{?Q}.onnx`` and ``decoder_joint-model{?Q}.onnx`` with the same ``Q``
(``?`` is one character of a glob: ``.`` or ``_``), ``vocab.txt`` and, when present,
``config.json``. One suffix names both files, so the bundle's ``Q`` names the bundle's
recipe, ``int4`` by default: the encoder is int4 and holds nearly all of the bytes; the
decoder_joint file carries the same suffix whatever it holds (int8 by default; the
manifest says what each file is). A glob such as ``int?`` would match differently named
files only because onnx-asr passes ``Q`` to a glob, which it does not document.

**sherpa-onnx** (2.0): ``OfflineRecognizer.from_transducer(encoder, decoder, joiner,
tokens, model_type="nemo_transducer")``: three files named by the caller (so each is named
for what it holds), ``tokens.txt`` (``<token> <id>`` lines, ``<blk>`` last), and settings in
the encoder's metadata (:func:`sherpa_metadata`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from onnx_conv2matmul.errors import InputError

ONNX_ASR = "onnx-asr"
SHERPA_ONNX = "sherpa-onnx"
LAYOUTS = (ONNX_ASR, SHERPA_ONNX)

# The fp32 release folder (what onnx-asr loads with quantization=None).
SOURCE_ENCODER = "encoder-model.onnx"
SOURCE_DECODER_JOINT = "decoder_joint-model.onnx"
SOURCE_VOCAB = "vocab.txt"
SOURCE_CONFIG = "config.json"
BLANK = "<blk>"

DEFAULT_TAG = "int4"
"""The onnx-asr bundle's ``quantization`` value (see the module docstring)."""

MANIFEST = "manifest.json"
"""The manifest every bundle holds (the listing of ``bundle --check --manifest``)."""

# onnx-asr's NeMo model class for TDT models, and the settings it reads (asr.AsrConfig).
ONNX_ASR_MODEL_TYPE = {True: "nemo-conformer-tdt", False: "nemo-conformer-rnnt"}
DEFAULT_SUBSAMPLING = 8  # FastConformer; when neither config.json nor the encoder tells


@dataclasses.dataclass(frozen=True)
class Role:
    """One model of a bundle: which source model it comes from and how it is quantized.

    ``quantization`` is ``"encoder"`` (the quantize command's MatMulNBits path, with the
    bundle's options) or ``"int8_dynamic"`` (onnxruntime's ``quantize_dynamic``).
    """

    name: str
    source: str
    quantization: str


ENCODER = Role("encoder", SOURCE_ENCODER, "encoder")
DECODER_JOINT = Role("decoder_joint", SOURCE_DECODER_JOINT, "int8_dynamic")
DECODER = Role("decoder", SOURCE_DECODER_JOINT, "int8_dynamic")
JOINER = Role("joiner", SOURCE_DECODER_JOINT, "int8_dynamic")

ROLES = {ONNX_ASR: (ENCODER, DECODER_JOINT), SHERPA_ONNX: (ENCODER, DECODER, JOINER)}


def file_name(layout: str, role: Role, tag: str, bits: int = 4) -> str:
    """The file a model takes in a layout.

    onnx-asr: ``encoder-model.<tag>.onnx`` and ``decoder_joint-model.<tag>.onnx``.
    sherpa-onnx: ``encoder.int<bits>.onnx``, ``decoder.int8.onnx``, ``joiner.int8.onnx``.
    """
    if layout == ONNX_ASR:
        return f"{role.source.removesuffix('.onnx')}.{tag}.onnx"
    kind = f"int{bits}" if role.quantization == "encoder" else "int8"
    return f"{role.name}.{kind}.onnx"


def vocab_file(layout: str) -> str:
    return SOURCE_VOCAB if layout == ONNX_ASR else "tokens.txt"


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise InputError(f"unknown bundle layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def check_tag(tag: str) -> None:
    """A suffix onnx-asr's glob matches literally: letters, digits, ``-`` and ``_``."""
    if not tag or not all(c.isalnum() or c in "-_" for c in tag):
        raise InputError(f"bundle quantization name {tag!r}: use letters, digits, '-' or '_' (e.g. int4)")


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """``vocab.txt`` read: the tokens by id, the blank's id."""

    tokens: list[str]
    blank: int

    @property
    def size_without_blank(self) -> int:
        return len(self.tokens) - 1

    def text(self) -> str:
        """The file as both runtimes read it: ``<token> <id>`` lines, ids in order."""
        return "".join(f"{token} {i}\n" for i, token in enumerate(self.tokens))


def read_vocab(path: str) -> Vocabulary:
    """Read a NeMo ``vocab.txt``; the blank must be ``<blk>`` with the last id.

    Raises:
        InputError: a line that is not ``<token> <id>``, ids that are not 0..n-1 in order,
            no ``<blk>``, or ``<blk>`` not last (sherpa-onnx requires it last).
    """
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read the vocabulary {path}: {err}") from err
    tokens: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        token, _, index = line.rpartition(" ")
        if not token or not index.isdigit() or int(index) != len(tokens):
            raise InputError(f"{path}:{number}: expected '<token> {len(tokens)}', got {line!r}")
        tokens.append(token)
    if BLANK not in tokens:
        raise InputError(f"{path}: no blank token {BLANK}")
    blank = tokens.index(BLANK)
    if blank != len(tokens) - 1:
        raise InputError(f"{path}: the blank {BLANK} has id {blank}, not the last id {len(tokens) - 1}")
    return Vocabulary(tokens, blank)


def read_config(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise InputError(f"{path} does not hold a JSON object")
    return data


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What a bundle's settings are derived from, read from the source models.

    Attributes:
        features: The encoder's input features (its ``audio_signal`` axis 1).
        subsampling: Input frames per encoder output frame.
        pred_layers, pred_hidden: The prediction network's state shape ``[layers, B, hidden]``.
        joint_outputs: The joint's last axis: classes (tokens + blank) and durations.
        vocab_size: Tokens without the blank (``vocab.txt``'s lines - 1).
    """

    features: int
    subsampling: int
    pred_layers: int
    pred_hidden: int
    joint_outputs: int
    vocab_size: int

    @property
    def durations(self) -> int:
        """TDT durations (0 for an RNN-T joint)."""
        return self.joint_outputs - self.vocab_size - 1

    @property
    def is_tdt(self) -> bool:
        return self.durations > 0


def onnx_asr_config(source: Mapping[str, object] | None, facts: ModelFacts) -> dict[str, object]:
    """``config.json`` for onnx-asr: the source's, with the keys it lacks derived from the models."""
    config = dict(source or {})
    config.setdefault("model_type", ONNX_ASR_MODEL_TYPE[facts.is_tdt])
    config.setdefault("features_size", facts.features)
    config.setdefault("subsampling_factor", facts.subsampling)
    return config


def sherpa_metadata(facts: ModelFacts, normalize_type: str = "per_feature") -> dict[str, str]:
    """The encoder metadata sherpa-onnx reads (as NeMo's export script for sherpa writes it).

    ``vocab_size`` excludes the blank; ``url`` contains ``tdt`` for a TDT model, which is
    how sherpa-onnx tells TDT from RNN-T; ``normalize_type`` is NeMo's feature normalization
    (``per_feature`` for Parakeet).
    """
    return {
        "vocab_size": str(facts.vocab_size),
        "subsampling_factor": str(facts.subsampling),
        "pred_rnn_layers": str(facts.pred_layers),
        "pred_hidden": str(facts.pred_hidden),
        "normalize_type": normalize_type,
        "feat_dim": str(facts.features),
        "model_type": "EncDecRNNTBPEModel",
        "model_author": "NeMo",
        "url": "nemo-tdt" if facts.is_tdt else "nemo-rnnt",
        "comment": "built by onnx-conv2matmul bundle",
    }


def config_file_path(directory: str) -> str | None:
    path = os.path.join(directory, SOURCE_CONFIG)
    return path if os.path.isfile(path) else None
