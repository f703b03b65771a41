"""Generate FastConformer / TDT ONNX models with random weights.

The models mirror the architecture of NVIDIA Parakeet TDT 0.6B v3 (a NeMo
FastConformer encoder and a TDT decoder + joint) in plain torch, so that test
fixtures and benchmark models can be produced without NeMo or downloaded
weights. The encoder's convolution module contains the pattern this project
rewrites: ``Transpose -> Conv(kernel 1) -> ... -> Conv(kernel 1) -> Transpose``.

Usage::

    python benchmarks/fastconformer.py encoder --size small --exporter dynamo --out enc.onnx
    python benchmarks/fastconformer.py decoder --size small --exporter dynamo --out dec.onnx
    python benchmarks/fastconformer.py release --size small --out DIR [--decisive-joint]
    python benchmarks/fastconformer.py cache [--dir DIR]

``release`` writes a folder laid out as the fp32 Parakeet TDT 0.6B v3 ONNX release
(``encoder-model.onnx`` + ``.data``, ``decoder_joint-model.onnx``, ``vocab.txt``,
``config.json``); ``tests/data/parakeet_small`` was made with
``release --size small --decisive-joint``.

Every export is checked against onnxruntime and summarised (parameter count,
file sizes, Conv nodes by kernel shape, Transpose nodes).  Needs torch, onnx,
onnxscript (for the dynamo exporter), numpy and onnxruntime.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn
from torch.export._patches import register_lstm_while_loop_decomposition

SEED = 0
INF_VAL = 10000.0  # NeMo's large value used to mask attention scores.
# Models whose weights exceed this many bytes are exported with external data;
# it stays well below the 2 GiB protobuf limit.
EXTERNAL_DATA_THRESHOLD = 1 << 30
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "onnx-conv2matmul-bench"
COMPLETE_MARKER = ".complete"
# Largest acceptable difference between torch and onnxruntime outputs.
CHECK_ATOL = 1e-3


# --------------------------------------------------------------------------- #
# Configurations
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class EncoderConfig:
    """Hyper-parameters of a FastConformer encoder."""

    feat_in: int
    sub_channels: int
    d_model: int
    ff_dim: int
    n_heads: int
    n_layers: int
    conv_kernel: int
    xscaling: bool = True
    # 0: relative positional encodings computed in the graph for the input's length.
    # N > 0: kept as a buffer of 2N-1 rows and sliced, as NeMo's RelPositionalEncoding does
    # (max_audio_length 5000: a [1, 9999, d_model] initializer in the export).
    positional_table: int = 0


@dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of a TDT prediction network + joint.

    ``vocab_size`` excludes the blank token; blank is the last index.
    """

    vocab_size: int
    pred_hidden: int
    pred_layers: int
    joint_hidden: int
    encoder_dim: int
    num_durations: int = 5


ENCODER_CONFIGS: dict[str, EncoderConfig] = {
    "parakeet": EncoderConfig(
        feat_in=128,
        sub_channels=256,
        d_model=1024,
        ff_dim=4096,
        n_heads=8,
        n_layers=24,
        conv_kernel=9,
    ),
    # The same layers at a quarter of the width and a quarter of the depth (about 40 MB of
    # weights against 2.4 GB): the benchmarks' quick size (scripts/benchmarks.sh --size medium).
    "medium": EncoderConfig(
        feat_in=128,
        sub_channels=64,
        d_model=256,
        ff_dim=1024,
        n_heads=4,
        n_layers=6,
        conv_kernel=9,
    ),
    "small": EncoderConfig(
        feat_in=32,
        sub_channels=16,
        d_model=64,
        ff_dim=128,
        n_heads=4,
        n_layers=2,
        conv_kernel=9,
    ),
}

DECODER_CONFIGS: dict[str, DecoderConfig] = {
    "parakeet": DecoderConfig(
        vocab_size=8192, pred_hidden=640, pred_layers=2, joint_hidden=640, encoder_dim=1024
    ),
    "medium": DecoderConfig(
        vocab_size=1024, pred_hidden=320, pred_layers=2, joint_hidden=320, encoder_dim=256
    ),
    "small": DecoderConfig(vocab_size=32, pred_hidden=32, pred_layers=2, joint_hidden=32, encoder_dim=64),
}
# The small encoder with the release's 128 mel features, which both runtimes' front ends
# produce (onnx-asr's NeMo preprocessors make 80 or 128, sherpa-onnx reads ``feat_dim``).
ENCODER_CONFIGS["small128"] = dataclasses.replace(ENCODER_CONFIGS["small"], feat_in=128)
DECODER_CONFIGS["small128"] = DECODER_CONFIGS["small"]

# Shapes of the random inputs used to export and to compare torch with
# onnxruntime: the first is the export example, the second has different
# dynamic dimensions to catch sizes frozen into the graph.
# Encoder: (batch, audio frames); lengths are [T, T-37, ...].
ENCODER_CHECK_SHAPES = {
    "small": [(2, 160), (1, 93)],
    "medium": [(2, 1000), (1, 611)],
    "parakeet": [(2, 1000), (1, 611)],
}
ENCODER_CHECK_SHAPES["small128"] = ENCODER_CHECK_SHAPES["small"]
# Decoder: (batch, encoder frames, target tokens).
DECODER_CHECK_SHAPES = {
    "small": [(2, 20, 8), (3, 7, 1)],
    "medium": [(2, 125, 16), (1, 40, 1)],
    "parakeet": [(2, 125, 16), (1, 40, 1)],
}
DECODER_CHECK_SHAPES["small128"] = DECODER_CHECK_SHAPES["small"]
# ONNX opset per exporter: the dynamo exporter implements opset >= 18 and cannot
# down-convert the encoder to 17 (no Pad adapter), the legacy one defaults to 17.
DEFAULT_OPSET = {"dynamo": 18, "legacy": 17}


# --------------------------------------------------------------------------- #
# FastConformer encoder
# --------------------------------------------------------------------------- #


class DwStridingSubsampling(nn.Module):
    """NeMo ``dw_striding`` subsampling: 8x in time and frequency, then Linear."""

    kernel_size = 3
    stride = 2
    padding = 1
    num_stages = 3

    def __init__(self, feat_in: int, channels: int, feat_out: int) -> None:
        super().__init__()
        if feat_in % 8:
            raise ValueError(f"feat_in must be divisible by 8, got {feat_in}")
        k, s, p = self.kernel_size, self.stride, self.padding
        layers: list[nn.Module] = [nn.Conv2d(1, channels, k, s, p), nn.ReLU()]
        for _ in range(self.num_stages - 1):
            layers += [
                nn.Conv2d(channels, channels, k, s, p, groups=channels),
                nn.Conv2d(channels, channels, 1),
                nn.ReLU(),
            ]
        self.conv = nn.Sequential(*layers)
        self.out = nn.Linear(channels * (feat_in // 8), feat_out)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Frame count after subsampling, computed in float like NeMo's ``calc_length``."""
        out = lengths.to(torch.float32)
        for _ in range(self.num_stages):
            out = torch.floor((out + 2 * self.padding - self.kernel_size) / self.stride + 1.0)
        return out.to(torch.int64)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map features ``[B, T, F]`` to ``[B, T/8, d_model]`` and subsampled lengths."""
        x = self.conv(x.unsqueeze(1))  # [B, C, T/8, F/8]
        b, _, t, _ = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, -1))
        return x, self.output_lengths(lengths)


def relative_positional_encoding(length: int, d_model: int, device: torch.device) -> torch.Tensor:
    """Sinusoidal encodings of relative positions ``length-1 .. -(length-1)``.

    Same values as NeMo's ``RelPositionalEncoding`` (Transformer-XL style), but
    computed for the actual length instead of sliced from a precomputed table,
    which keeps small exported models small.  Returns ``[1, 2*length-1, d_model]``.
    """
    positions = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device)
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d_model)
    )
    angles = positions.unsqueeze(1) * inv_freq  # [2L-1, d_model/2]
    # Interleave so that even channels hold sin and odd channels hold cos.
    pe = torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).reshape(-1, d_model)
    return pe.unsqueeze(0)


class RelPositionMultiHeadAttention(nn.Module):
    """Multi-head attention with Transformer-XL relative positions (NeMo flavour)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_heads, self.d_k))
        nn.init.normal_(self.pos_bias_u, std=0.02)
        nn.init.normal_(self.pos_bias_v, std=0.02)

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        """Align ``[B, H, T, 2T-1]`` position scores so column j means offset i-j."""
        b, h, qlen, pos_len = x.shape
        x = F.pad(x, (1, 0))
        x = x.reshape(b, h, -1, qlen)
        return x[:, :, 1:].reshape(b, h, qlen, pos_len)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, d_model]`` -> ``[B, T, H, d_k]``."""
        return x.reshape(x.shape[0], -1, self.n_heads, self.d_k)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, att_mask: torch.Tensor) -> torch.Tensor:
        """Self-attention over ``x [B, T, d]``; ``att_mask [B, T, T]`` is True where masked."""
        b = x.shape[0]
        q = self._split_heads(self.linear_q(x))
        k = self._split_heads(self.linear_k(x)).transpose(1, 2)
        v = self._split_heads(self.linear_v(x)).transpose(1, 2)
        p = self._split_heads(self.linear_pos(pos_emb)).transpose(1, 2)  # [1, H, 2T-1, d_k]

        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul(q_with_bias_v, p.transpose(-2, -1)))
        matrix_bd = matrix_bd[:, :, :, : matrix_ac.shape[-1]]
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)

        mask = att_mask.unsqueeze(1)
        scores = scores.masked_fill(mask, -INF_VAL)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, -1, self.n_heads * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    """Linear -> SiLU -> Linear."""

    def __init__(self, d_model: int, ff_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, ff_dim)
        self.linear2 = nn.Linear(ff_dim, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the position-wise feed-forward network."""
        return self.linear2(F.silu(self.linear1(x)))


class ConformerConvolution(nn.Module):
    """Conformer convolution module with pointwise Conv1d layers (kernel size 1)."""

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, kernel_size=1)
        self.depthwise_conv = nn.Conv1d(
            d_model, d_model, kernel_size, padding=(kernel_size - 1) // 2, groups=d_model
        )
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, kernel_size=1)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]`` -> ``[B, T, d]``; ``pad_mask [B, T]`` is True on padding."""
        x = x.transpose(1, 2)  # [B, d, T]
        x = self.pointwise_conv1(x)
        x = F.glu(x, dim=1)
        x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)
        x = self.depthwise_conv(x)
        x = self.batch_norm(x)
        x = F.silu(x)
        x = self.pointwise_conv2(x)
        return x.transpose(1, 2)


class ConformerLayer(nn.Module):
    """Macaron conformer block: FF/2, self-attention, convolution, FF/2, LayerNorm."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.norm_feed_forward1 = nn.LayerNorm(d)
        self.feed_forward1 = FeedForward(d, cfg.ff_dim)
        self.norm_self_att = nn.LayerNorm(d)
        self.self_attn = RelPositionMultiHeadAttention(d, cfg.n_heads)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConformerConvolution(d, cfg.conv_kernel)
        self.norm_feed_forward2 = nn.LayerNorm(d)
        self.feed_forward2 = FeedForward(d, cfg.ff_dim)
        self.norm_out = nn.LayerNorm(d)

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        att_mask: torch.Tensor,
        pad_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Apply one conformer layer to ``x [B, T, d]``."""
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), pos_emb, att_mask)
        x = x + self.conv(self.norm_conv(x), pad_mask)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class FastConformerEncoder(nn.Module):
    """FastConformer encoder: ``(audio_signal [B, F, T], length [B])`` -> ``([B, d, T/8], [B])``."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pre_encode = DwStridingSubsampling(cfg.feat_in, cfg.sub_channels, cfg.d_model)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.n_layers))
        self.xscale = math.sqrt(cfg.d_model) if cfg.xscaling else 1.0
        if cfg.positional_table:
            pe = relative_positional_encoding(cfg.positional_table, cfg.d_model, torch.device("cpu"))
            self.register_buffer("pe", pe, persistent=True)

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode features; returns ``outputs [B, d_model, T']`` and ``encoded_lengths [B]``."""
        x, encoded_lengths = self.pre_encode(audio_signal.transpose(1, 2), length)
        x = x * self.xscale
        t = x.shape[1]
        n = self.cfg.positional_table
        if n:
            # Row n-1 is offset 0: rows n-t .. n+t-2 are offsets t-1 .. -(t-1).
            pos_emb = self.pe[:, n - t : n - 1 + t]
        else:
            pos_emb = relative_positional_encoding(t, self.cfg.d_model, x.device)

        pad_mask = torch.arange(t, device=x.device).unsqueeze(0) >= encoded_lengths.unsqueeze(1)
        att_mask = pad_mask.unsqueeze(1) | pad_mask.unsqueeze(2)  # [B, T', T']
        for layer in self.layers:
            x = layer(x, pos_emb, att_mask, pad_mask)
        return x.transpose(1, 2), encoded_lengths


# --------------------------------------------------------------------------- #
# TDT decoder + joint
# --------------------------------------------------------------------------- #


class TdtDecoderJoint(nn.Module):
    """LSTM prediction network and TDT joint, with the interface of NeMo's decoder_joint export."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        blank = cfg.vocab_size
        self.embedding = nn.Embedding(cfg.vocab_size + 1, cfg.pred_hidden, padding_idx=blank)
        self.lstm = nn.LSTM(cfg.pred_hidden, cfg.pred_hidden, num_layers=cfg.pred_layers)
        self.joint_enc = nn.Linear(cfg.encoder_dim, cfg.joint_hidden)
        self.joint_pred = nn.Linear(cfg.pred_hidden, cfg.joint_hidden)
        self.joint_out = nn.Linear(cfg.joint_hidden, cfg.vocab_size + 1 + cfg.num_durations)

    def forward(
        self,
        encoder_outputs: torch.Tensor,
        targets: torch.Tensor,
        target_length: torch.Tensor,
        input_states_1: torch.Tensor,
        input_states_2: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return joint logits ``[B, T, U, V+1+D]``, lengths and the new LSTM (h, c)."""
        embedded = self.embedding(targets).transpose(0, 1)  # [U, B, H], time-major LSTM
        pred, (h, c) = self.lstm(embedded, (input_states_1, input_states_2))
        f = self.joint_enc(encoder_outputs.transpose(1, 2))  # [B, T, J]
        g = self.joint_pred(pred.transpose(0, 1))  # [B, U, J]
        joint = torch.relu(f.unsqueeze(2) + g.unsqueeze(1))
        return self.joint_out(joint), target_length, h, c


# --------------------------------------------------------------------------- #
# Model construction and example inputs
# --------------------------------------------------------------------------- #


def randomize_norm_layers(model: nn.Module, generator: torch.Generator) -> None:
    """Give LayerNorm/BatchNorm layers non-trivial parameters, as a trained model has.

    Their default init (weight 1, bias 0, BatchNorm an identity) would make all
    LayerNorm parameters equal, which the legacy exporter deduplicates.
    """
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            n = module.num_features
            module.running_mean = 0.1 * torch.randn(n, generator=generator)
            module.running_var = 0.5 + torch.rand(n, generator=generator)
        if isinstance(module, (nn.BatchNorm1d, nn.LayerNorm)):
            with torch.no_grad():
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))


def build_encoder(size: str, positional_table: int = 0) -> FastConformerEncoder:
    """Build the encoder of the given size with seeded random weights, in eval mode.

    ``positional_table``: see :attr:`EncoderConfig.positional_table` (the weights are the
    same either way).
    """
    torch.manual_seed(SEED)
    cfg = dataclasses.replace(ENCODER_CONFIGS[size], positional_table=positional_table)
    model = FastConformerEncoder(cfg)
    randomize_norm_layers(model, torch.Generator().manual_seed(SEED))
    return model.eval()


def build_decoder(size: str) -> TdtDecoderJoint:
    """Build the decoder + joint of the given size with seeded random weights, in eval mode."""
    torch.manual_seed(SEED)
    return TdtDecoderJoint(DECODER_CONFIGS[size]).eval()


def encoder_inputs(size: str, batch: int, frames: int) -> dict[str, torch.Tensor]:
    """Random features ``[B, feat_in, T]`` and lengths ``[T, T-37, ...]``."""
    generator = torch.Generator().manual_seed(SEED + 1)
    feat_in = ENCODER_CONFIGS[size].feat_in
    lengths = [frames - 37 * i for i in range(batch)]
    return {
        "audio_signal": torch.randn(batch, feat_in, frames, generator=generator),
        "length": torch.tensor(lengths, dtype=torch.int64),
    }


def decoder_inputs(size: str, batch: int, frames: int, tokens: int) -> dict[str, torch.Tensor]:
    """Random encoder frames, targets, lengths ``[U, U-3, ...]`` and LSTM states."""
    cfg = DECODER_CONFIGS[size]
    generator = torch.Generator().manual_seed(SEED + 1)
    state_shape = (cfg.pred_layers, batch, cfg.pred_hidden)
    return {
        "encoder_outputs": torch.randn(batch, cfg.encoder_dim, frames, generator=generator),
        # int32, as NeMo exports the decoder (and as sherpa-onnx feeds it).
        "targets": torch.randint(0, cfg.vocab_size, (batch, tokens), generator=generator, dtype=torch.int32),
        "target_length": torch.tensor([max(tokens - 3 * i, 1) for i in range(batch)], dtype=torch.int32),
        "input_states_1": torch.randn(state_shape, generator=generator),
        "input_states_2": torch.randn(state_shape, generator=generator),
    }


@dataclass(frozen=True)
class ModelSpec:
    """What to export: the model, check inputs (the first is the export example), ONNX names."""

    model: nn.Module
    inputs: list[dict[str, torch.Tensor]]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]


def encoder_spec(size: str, positional_table: int = 0) -> ModelSpec:
    """Export specification of the FastConformer encoder."""
    return ModelSpec(
        model=build_encoder(size, positional_table),
        inputs=[encoder_inputs(size, *shape) for shape in ENCODER_CHECK_SHAPES[size]],
        output_names=["outputs", "encoded_lengths"],
        dynamic_axes={
            "audio_signal": {0: "batch", 2: "time"},
            "length": {0: "batch"},
            "outputs": {0: "batch", 2: "encoded_time"},
            "encoded_lengths": {0: "batch"},
        },
    )


def decoder_spec(size: str) -> ModelSpec:
    """Export specification of the TDT decoder + joint."""
    return ModelSpec(
        model=build_decoder(size),
        inputs=[decoder_inputs(size, *shape) for shape in DECODER_CHECK_SHAPES[size]],
        output_names=["outputs", "prednet_lengths", "output_states_1", "output_states_2"],
        dynamic_axes={
            "encoder_outputs": {0: "batch", 2: "time"},
            "targets": {0: "batch", 1: "tokens"},
            "target_length": {0: "batch"},
            "input_states_1": {1: "batch"},
            "input_states_2": {1: "batch"},
            "outputs": {0: "batch", 1: "time", 2: "tokens"},
            "prednet_lengths": {0: "batch"},
            "output_states_1": {1: "batch"},
            "output_states_2": {1: "batch"},
        },
    )


# --------------------------------------------------------------------------- #
# Export, verification and statistics
# --------------------------------------------------------------------------- #


def export(spec: ModelSpec, out: Path, exporter: str, opset: int, external_data: bool | None = None) -> None:
    """Export ``spec.model`` to ``out`` with the dynamo or the legacy (TorchScript) exporter.

    The dynamo exporter writes ``out`` plus one ``out.data`` file when the weights
    are large (or when ``external_data`` is True).  The legacy exporter switches to
    external data by itself above 2 GB, writing one file per tensor next to ``out``.
    """
    input_names = list(spec.inputs[0])
    args = tuple(spec.inputs[0].values())
    if exporter == "dynamo":
        dims: dict[str, torch.export.Dim] = {}
        dynamic_shapes = {
            name: {
                axis: dims.setdefault(dim_name, torch.export.Dim(dim_name))
                for axis, dim_name in spec.dynamic_axes[name].items()
            }
            for name in input_names
        }
        weight_bytes = sum(p.numel() * p.element_size() for p in spec.model.parameters())
        # torch 2.13 registers the while_loop LSTM decomposition only while
        # capturing the graph; the later decomposition step falls back to the
        # Python-loop one, freezing the LSTM's sequence length to the example's
        # (pytorch/pytorch#191855).  Keep the while_loop version for the whole export.
        with register_lstm_while_loop_decomposition():
            torch.onnx.export(
                spec.model,
                args,
                out,
                dynamo=True,
                input_names=input_names,
                output_names=spec.output_names,
                opset_version=opset,
                dynamic_shapes=dynamic_shapes,
                external_data=(
                    weight_bytes > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data
                ),
            )
    else:
        # The legacy exporter writes >2 GiB models as external data only when
        # given the path as a str.
        torch.onnx.export(
            spec.model,
            args,
            str(out),
            dynamo=False,
            input_names=input_names,
            output_names=spec.output_names,
            opset_version=opset,
            dynamic_axes=spec.dynamic_axes,
        )


def compare_with_onnxruntime(spec: ModelSpec, path: Path) -> None:
    """Run the model in torch and onnxruntime on each check input; print max abs diffs.

    Raises ``RuntimeError`` when an output's shape differs or a difference exceeds
    ``CHECK_ATOL``.
    """
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for inputs in spec.inputs:
        with torch.no_grad():
            expected = spec.model(*inputs.values())
        actual = session.run(spec.output_names, {k: v.numpy() for k, v in inputs.items()})
        shapes = {name: list(v.shape) for name, v in inputs.items()}
        print(f"torch vs onnxruntime on {shapes}:")
        for name, ref, got in zip(spec.output_names, expected, actual, strict=True):
            ref_np = ref.numpy()
            if ref_np.shape != got.shape:
                raise RuntimeError(f"{name}: shape {got.shape} from onnxruntime, {ref_np.shape} from torch")
            diff = np.max(np.abs(ref_np.astype(np.float64) - got.astype(np.float64)))
            print(f"  {name:16s} shape {list(got.shape)}  max abs diff {diff:.3g}")
            if diff > CHECK_ATOL:
                raise RuntimeError(f"{name}: onnxruntime differs from torch by {diff:.3g}")


def iter_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Yield every node of ``graph``, including nodes of subgraphs (If/Loop/Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attr.graphs:
                    yield from iter_nodes(subgraph)


def constant_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Shapes of initializers and Constant node outputs (no external data is read)."""
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    for node in iter_nodes(graph):
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    shapes[node.output[0]] = list(attr.t.dims)
    return shapes


def conv_kernel_shape(node: onnx.NodeProto, shapes: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    """Kernel shape of a Conv node: its attribute, else the spatial dims of its weight."""
    for attr in node.attribute:
        if attr.name == "kernel_shape":
            return tuple(attr.ints)
    weight = shapes.get(node.input[1])
    if weight is None:
        raise ValueError(f"cannot determine the kernel shape of Conv node {node.name!r}")
    return tuple(weight[2:])


def external_data_files(model: onnx.ModelProto, directory: Path) -> set[Path]:
    """Files referenced by the model's external-data initializers."""
    files = set()
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            location = next(e.value for e in init.external_data if e.key == "location")
            files.add(directory / location)
    return files


def describe_onnx(path: Path) -> None:
    """Print opset, file sizes, Conv nodes by kernel shape and Transpose placement."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    data_files = external_data_files(model, path.parent)
    data_bytes = sum(f.stat().st_size for f in data_files)
    print(f"opset: {opsets}, producer: {model.producer_name} {model.producer_version}")
    print(
        f"model file: {path.stat().st_size / 1e6:.2f} MB; "
        f"external data: {len(data_files)} file(s), {data_bytes / 1e6:.2f} MB"
    )

    shapes = constant_shapes(graph)
    nodes = list(iter_nodes(graph))
    producers = {out: node for node in nodes for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    kernels: Counter[tuple[int, ...]] = Counter()
    pointwise = fed_by_transpose = feeding_transpose = 0
    for node in nodes:
        if node.op_type != "Conv":
            continue
        kernel = conv_kernel_shape(node, shapes)
        kernels[kernel] += 1
        if all(k == 1 for k in kernel):
            pointwise += 1
            producer = producers.get(node.input[0])
            fed_by_transpose += producer is not None and producer.op_type == "Transpose"
            feeding_transpose += any(c.op_type == "Transpose" for c in consumers.get(node.output[0], []))
    ops = Counter(node.op_type for node in nodes)
    print(
        f"nodes: {len(nodes)}, initializers: {len(graph.initializer)}, "
        f"Constant nodes: {ops['Constant']}, BatchNormalization: {ops['BatchNormalization']}"
    )
    print(
        f"Conv nodes: {sum(kernels.values())} (pointwise {pointwise}, "
        f"other {sum(kernels.values()) - pointwise}); by kernel shape: "
        + ", ".join(f"{list(k)}: {n}" for k, n in sorted(kernels.items()))
    )
    print(
        f"Transpose nodes: {ops['Transpose']}; pointwise Conv fed by Transpose: "
        f"{fed_by_transpose}, feeding a Transpose: {feeding_transpose}"
    )


def run_export(
    spec: ModelSpec, out: Path, exporter: str, opset: int, external_data: bool | None = None
) -> None:
    """Export, summarise and verify one model."""
    n_params = sum(p.numel() for p in spec.model.parameters())
    print(f"{type(spec.model).__name__}: {n_params:,} parameters ({n_params / 1e6:.1f}M)")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    export(spec, out, exporter, opset, external_data)
    print(f"{exporter} export to {out} took {time.perf_counter() - start:.1f} s")
    describe_onnx(out)
    compare_with_onnxruntime(spec, out)


# --------------------------------------------------------------------------- #
# Release folder: the layout of the fp32 Parakeet TDT 0.6B v3 ONNX release
# --------------------------------------------------------------------------- #

# ``release --size S`` exports these model sizes (the small one with 128 mel features).
RELEASE_SIZES = {"small": "small128", "medium": "medium", "parakeet": "parakeet"}
RELEASE_ENCODER = "encoder-model.onnx"
RELEASE_DECODER = "decoder_joint-model.onnx"
BLANK = "<blk>"
# As onnx-asr reads it: the model class, the mel features and the encoder's frame rate.
RELEASE_CONFIG = {"model_type": "nemo-conformer-tdt", "features_size": 128, "subsampling_factor": 8}


def vocabulary(vocab_size: int) -> list[str]:
    """``vocab_size`` distinct SentencePiece-like tokens: ``<unk>`` then word pieces.

    Odd ids start a word (``\u2581`` prefix, shown as a space by both runtimes), even
    ids continue one. The blank is not included (it comes last, see :func:`write_vocab`).
    """
    tokens = ["<unk>"]
    for i in range(1, vocab_size):
        letters, n = "", i
        while n:
            n, r = divmod(n - 1, 26)
            letters = chr(ord("a") + r) + letters
        tokens.append("\u2581" + letters if i % 2 else letters)
    return tokens


def write_vocab(path: Path, vocab_size: int) -> None:
    """``vocab.txt`` as the release has it: ``<token> <id>`` per line, blank last."""
    lines = [f"{token} {i}" for i, token in enumerate([*vocabulary(vocab_size), BLANK])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# The decisive joint (``release --decisive-joint``): the tokens it emits in turn, starting
# after the blank, and how many frames each one advances (its TDT duration index).
DECISIVE_CHAIN = list(range(1, 13))
DECISIVE_MARGIN = 8.0
# The encoder's share of the joint's input, small enough never to change a decision.
DECISIVE_ENCODER_SCALE = 0.01


@torch.no_grad()
def make_joint_decisive(model: TdtDecoderJoint) -> None:
    """Make the decoder + joint emit a fixed token chain, each decision by a wide margin.

    The prediction network forgets its state (recurrent weights 0, forget gates shut), so
    its output depends on the last token alone; the joint's output layer is then solved so
    that, after the blank or token ``DECISIVE_CHAIN[i]``, token ``DECISIVE_CHAIN[i + 1]``
    (cyclically) leads every other class by ``DECISIVE_MARGIN``, the blank trails by as
    much, and duration index ``1 + i % 3`` leads the other durations by as much. The
    encoder's output still flows into the joint, scaled down so that it cannot change a
    decision. The text is then a fixed sequence whose length follows the audio's, and int8
    or int4 weights (errors far below the margin) give the same text as float: a runtime
    test compares texts without quantization noise deciding the outcome.
    """
    hidden = model.lstm.hidden_size
    for layer in range(model.lstm.num_layers):
        # Gates in torch's order (input, forget, cell, output): input and output open,
        # forget shut, no recurrent input, and a stronger input so tokens stay apart.
        getattr(model.lstm, f"weight_hh_l{layer}").zero_()
        getattr(model.lstm, f"weight_ih_l{layer}").mul_(4.0)
        getattr(model.lstm, f"bias_hh_l{layer}").zero_()
        bias = getattr(model.lstm, f"bias_ih_l{layer}")
        bias.zero_()
        bias[:hidden] = 4.0
        bias[hidden : 2 * hidden] = -30.0
        bias[3 * hidden :] = 4.0
    model.joint_enc.weight.mul_(DECISIVE_ENCODER_SCALE)
    model.joint_enc.bias.zero_()
    model.joint_pred.weight.mul_(4.0)
    model.joint_pred.bias.zero_()
    blank = model.embedding.num_embeddings - 1
    previous = [blank, *DECISIVE_CHAIN]
    targets = torch.tensor([[p] for p in previous], dtype=torch.int64)
    pred, _ = model.lstm(model.embedding(targets).transpose(0, 1))  # [1, P, H]
    features = torch.relu(model.joint_pred(pred[0]))  # [P, J]
    classes = model.joint_out.out_features
    wanted = torch.zeros(len(previous), classes)
    for i in range(len(previous)):
        nxt = DECISIVE_CHAIN[i % len(DECISIVE_CHAIN)]
        wanted[i, nxt] = DECISIVE_MARGIN
        wanted[i, blank] = -DECISIVE_MARGIN
        wanted[i, blank + 1 + 1 + i % 3] = DECISIVE_MARGIN
    # Least squares through the bias: [features, 1] @ [W^T; b] = wanted.
    design = torch.cat([features, torch.ones(len(previous), 1)], dim=1)
    # numpy's SVD-based solver: the minimum-norm exact solution of this underdetermined
    # system (torch's default driver returned a wrong one on some runs).
    exact, *_ = np.linalg.lstsq(design.double().numpy(), wanted.double().numpy(), rcond=None)
    solution = torch.from_numpy(exact).float()
    model.joint_out.weight.copy_(solution[:-1].T)
    model.joint_out.bias.copy_(solution[-1])
    fitted = design @ solution
    error = float((fitted - wanted).abs().max())
    if error > 1e-3 * DECISIVE_MARGIN:
        raise RuntimeError(f"the decisive joint misses its targets by {error:.3g}")


def fold_constants(path: Path) -> None:
    """Fold what the exporter computes from constants at run time, whatever its size.

    The exporter folds only small tensors: at the parakeet size the LSTM weights stay
    ``Unsqueeze(initializer)``, which onnxruntime's dynamic quantizer skips, while NeMo's
    export (TorchScript, constants folded) has them as initializers.
    """
    import onnxscript.optimizer

    limit = 1 << 30
    model = onnx.load(str(path))
    model = onnxscript.optimizer.optimize(model, input_size_limit=limit, output_size_limit=limit)
    onnx.save(model, str(path))


def write_release(size: str, out: Path, opset: int, decisive: bool) -> None:
    """Export a folder laid out as the fp32 Parakeet TDT 0.6B v3 ONNX release.

    ``encoder-model.onnx`` with its weights in ``encoder-model.onnx.data``,
    ``decoder_joint-model.onnx``, ``vocab.txt`` (``vocab_size`` tokens and the blank) and
    ``config.json``. The parakeet and medium sizes keep the relative positional table as NeMo does.
    """
    model_size = RELEASE_SIZES[size]
    table = NEMO_MAX_AUDIO_LENGTH if size in CACHE_SIZES else 0
    encoder, decoder = encoder_spec(model_size, table), decoder_spec(model_size)
    if decisive:
        make_joint_decisive(decoder.model)
    out.mkdir(parents=True, exist_ok=True)
    run_export(encoder, out / RELEASE_ENCODER, "dynamo", opset, external_data=True)
    run_export(decoder, out / RELEASE_DECODER, "dynamo", opset, external_data=False)
    fold_constants(out / RELEASE_DECODER)
    compare_with_onnxruntime(decoder, out / RELEASE_DECODER)
    cfg = DECODER_CONFIGS[model_size]
    write_vocab(out / "vocab.txt", cfg.vocab_size)
    config = dict(RELEASE_CONFIG, features_size=ENCODER_CONFIGS[model_size].feat_in)
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    joint = cfg.vocab_size + 1 + cfg.num_durations
    print(f"release folder {out}: {cfg.vocab_size} tokens + blank, {cfg.num_durations} durations", end="")
    print(f" (joint outputs: {joint})")


# --------------------------------------------------------------------------- #
# Benchmark cache
# --------------------------------------------------------------------------- #

# NeMo's RelPositionalEncoding default: a table of 2 * 5000 - 1 relative positions.
NEMO_MAX_AUDIO_LENGTH = 5000

CACHE_JOBS: list[tuple[str, list[str], str]] = [
    ("encoder-dynamo", ["encoder", "--exporter", "dynamo"], "encoder-model.onnx"),
    ("encoder-legacy", ["encoder", "--exporter", "legacy"], "encoder-model.onnx"),
    (
        "encoder-dynamo-table",
        ["encoder", "--exporter", "dynamo", "--positional-table", str(NEMO_MAX_AUDIO_LENGTH)],
        "encoder-model.onnx",
    ),
    ("decoder", ["decoder", "--exporter", "dynamo"], "decoder_joint-model.onnx"),
    # The release's folder: encoder (positional table kept), decoder_joint, vocab.txt, config.json.
    ("release", ["release"], ""),
]


# The sizes ``cache`` builds: parakeet, the benchmarks' figures, and medium, the same layers
# smaller, for a quick run of every benchmark (its own folder, see :func:`cache_dir_for`).
CACHE_SIZES = ("parakeet", "medium")


def cache_dir_for(cache_dir: Path, size: str) -> Path:
    """Where ``cache --size SIZE`` puts its models: ``cache_dir`` itself for parakeet (the
    folder the benchmarks read by default), ``cache_dir/medium`` for the medium size."""
    return cache_dir if size == "parakeet" else cache_dir / size


def build_cache(cache_dir: Path, size: str = "parakeet") -> None:
    """Export the models of ``size`` (parakeet or medium) into ``cache_dir``, skipping completed ones.

    Layout: ``encoder-dynamo/encoder-model.onnx`` (+ ``.data``),
    ``encoder-legacy/encoder-model.onnx`` (+ one file per tensor),
    ``encoder-dynamo-table/encoder-model.onnx`` (the positional table kept as NeMo does) and
    ``decoder/decoder_joint-model.onnx``, and ``release/`` laid out as the fp32 release
    (see :func:`write_release`).  Each export runs in its own process
    (so memory is returned between exports) and a marker file is written only
    after it succeeded, so an interrupted export is redone from scratch.
    """
    paths = []
    for name, command, filename in CACHE_JOBS:
        target_dir = cache_dir / name
        path = target_dir / filename if filename else target_dir
        paths.append(path)
        marker = target_dir / COMPLETE_MARKER
        if marker.exists():
            print(f"[cache] {name}: present ({marker.read_text().strip()})")
            continue
        shutil.rmtree(target_dir, ignore_errors=True)
        target_dir.mkdir(parents=True)
        argv = [sys.executable, __file__, *command, "--size", size, "--out", str(path)]
        print(f"[cache] {name}: {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        pid = os.posix_spawn(sys.executable, argv, os.environ)
        _, status, usage = os.wait4(pid, 0)  # rusage of this child alone
        elapsed = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"[cache] {name}: export failed")
        summary = f"built in {elapsed:.0f} s, peak RSS {usage.ru_maxrss / 1024**2:.2f} GiB"
        marker.write_text(summary + "\n")
        print(f"[cache] {name}: {summary}")
    print("[cache] models:")
    for path in paths:
        print(f"  {path}")


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("encoder", "export a FastConformer encoder"),
        ("decoder", "export a TDT decoder + joint"),
    ]:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--size", choices=list(ENCODER_CONFIGS), default="small")
        sub.add_argument("--exporter", choices=["dynamo", "legacy"], default="dynamo")
        sub.add_argument("--out", type=Path, required=True, help="output .onnx path")
        sub.add_argument(
            "--opset",
            type=int,
            help="ONNX opset (default: 18 for dynamo, 17 for legacy)",
        )
        if name == "encoder":
            sub.add_argument(
                "--positional-table",
                type=int,
                default=0,
                metavar="N",
                help=(
                    "keep the relative positional encodings as a [1, 2N-1, d_model] table sliced"
                    f" in the graph, as a NeMo export does (N={NEMO_MAX_AUDIO_LENGTH} there); default:"
                    " computed in the graph"
                ),
            )
    release = commands.add_parser(
        "release", help="export a folder laid out as the fp32 Parakeet TDT 0.6B v3 ONNX release"
    )
    release.add_argument("--size", choices=list(RELEASE_SIZES), default="small")
    release.add_argument("--out", type=Path, required=True, help="output folder")
    release.add_argument("--opset", type=int, default=DEFAULT_OPSET["dynamo"], help="ONNX opset (default 18)")
    release.add_argument(
        "--decisive-joint",
        action="store_true",
        help="a joint that emits a fixed token chain by wide margins (for runtime tests)",
    )
    cache = commands.add_parser("cache", help="build the benchmark models (parakeet size by default)")
    cache.add_argument("--dir", type=Path, default=DEFAULT_CACHE_DIR, help="cache directory")
    cache.add_argument(
        "--size",
        choices=CACHE_SIZES,
        default="parakeet",
        help="medium: the same layers smaller, in DIR/medium, for a quick run of the benchmarks",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.command == "cache":
        build_cache(cache_dir_for(args.dir.expanduser(), args.size), args.size)
        return
    if args.command == "release":
        write_release(args.size, args.out, args.opset, args.decisive_joint)
        return
    if args.command == "encoder":
        spec = encoder_spec(args.size, args.positional_table)
    else:
        spec = decoder_spec(args.size)
    opset = args.opset or DEFAULT_OPSET[args.exporter]
    run_export(spec, args.out, args.exporter, opset)


if __name__ == "__main__":
    main()
