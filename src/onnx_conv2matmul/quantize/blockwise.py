"""Block quantization in numpy, as MatMulNBits stores it: onnxruntime's own block quantizer, its
inverse, and the activation-weighted error the ``--auto`` search predicts accuracy from.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from onnx_conv2matmul.quantize.options import Setting
from onnx_conv2matmul.quantize.weight_only import matmul_nbits_quantizer


def block_quantize(weight: np.ndarray, setting: Setting) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """onnxruntime's MatMulNBits block quantization of ``weight [K, N]``: packed, scales, zero points.

    The zero points are None when symmetric (MatMulNBits then has no such input).
    """
    matmul_nbits_quantizer()  # first import: the root logger left as it is
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    assert setting.bits is not None
    quantizer = DefaultWeightOnlyQuantizer(
        DefaultWeightOnlyQuantConfig(
            block_size=setting.block_size,
            is_symmetric=setting.symmetric,
            quant_format=QuantFormat.QOperator,
            op_types_to_quantize=("MatMul",),
            bits=setting.bits,
        )
    )
    packed, scales, zero_points = quantizer.qbits_block_quant(np.ascontiguousarray(weight))
    return packed, scales, None if setting.symmetric else zero_points


def stored_bytes(k: int, n: int, bits: int, block_size: int, symmetric: bool) -> int:
    """The bytes :func:`block_quantize` stores for a ``[K, N]`` fp32 weight: K padded to whole
    blocks of ``bits``-bit values, a float scale per block, and packed zero points when asymmetric.
    A larger block is not always smaller: K = 80 takes one block of 256 (3.2x its values)."""
    blocks = -(-k // block_size)
    zero_points = 0 if symmetric else n * -(-blocks * bits // 8)
    return n * blocks * (block_size * bits // 8 + 4) + zero_points


def block_dequantize(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int, k: int
) -> np.ndarray:
    """What MatMulNBits multiplies by: the ``[K, N]`` weight its packed data, scales and zero points hold.

    ``packed [N, blocks, blob]`` holds ``8 // bits`` values per byte, the first in the low
    bits; zero points (``[N, ceil(blocks * bits / 8)]``, packed the same way) default to
    ``2 ** (bits - 1)``.
    """
    n, blocks, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, -1)
    else:
        q = packed.reshape(n, blocks, -1)
    if zero_points is None:
        zp = np.full((n, blocks), 2 ** (bits - 1), dtype=np.float32)
    elif bits == 4:
        zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        zp = zero_points.reshape(n, -1)[:, :blocks]
    scale = scales.reshape(n, blocks).astype(np.float32)
    values = (q.astype(np.float32) - zp.astype(np.float32)[:, :, None]) * scale[:, :, None]
    return values.reshape(n, -1)[:, :k].T


def _weighted_error(weight: np.ndarray, approx: np.ndarray, h: np.ndarray) -> float:
    """``sum_k h_k |W_k - Q_k|^2 / sum_k h_k |W_k|^2`` for ``weight`` and ``approx`` ``[K, n]`` (float32)."""
    diff = weight - approx
    error = np.einsum("kn,kn->k", diff, diff).astype(np.float64)
    norm = np.einsum("kn,kn->k", weight, weight).astype(np.float64)
    total = float(np.dot(norm, h))
    return float(np.dot(error, h)) / total if total > 0 else 0.0


SAMPLED_COLUMNS = 256
"""The sensitivity looks at this many columns of a weight (evenly spaced): block quantization
works column by column, so their error estimates the whole weight's."""


def _sampled_columns(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, SAMPLED_COLUMNS)).round().astype(np.int64))


class BlockCache:
    """Block-quantized weights kept as files in ``directory``, by a key naming the weight and
    its setting: the search builds several models from the same weights, and a weight it
    quantized once with a setting is read back (memory-mapped) instead of quantized again,
    and its fp32 values are not read at all. The files go with the directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _paths(self, key: str) -> tuple[str, str, str]:
        stem = os.path.join(self.directory, hashlib.sha256(key.encode()).hexdigest()[:32])
        return stem + ".packed.npy", stem + ".scales.npy", stem + ".zero_points.npy"

    def get(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The packed data, scales and zero points stored under ``key``, or None."""
        paths = self._paths(key)
        if not all(os.path.exists(path) for path in paths):
            return None
        packed, scales, zero_points = (np.load(path, mmap_mode="r") for path in paths)
        return packed, scales, zero_points

    def put(self, key: str, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> None:
        for path, array in zip(self._paths(key), (packed, scales, zero_points), strict=True):
            np.save(path, array, allow_pickle=False)


class MemoryBlockCache(BlockCache):
    """A :class:`BlockCache` held in memory: the one pass's second build reads the blocks its
    first build quantized (nothing is written until :meth:`spill`; the arrays go with the cache)."""

    def __init__(self) -> None:  # no directory
        self._held: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def get(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        return self._held.get(key)

    def put(self, key: str, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> None:
        self._held[key] = (packed, scales, zero_points)

    def spill(self, directory: str) -> BlockCache:
        """The blocks held, written to files in ``directory`` and let go here: the cache to use
        from now on (its blocks read back memory-mapped, so a build holds only those it takes)."""
        on_disk = BlockCache(directory)
        for key, (packed, scales, zero_points) in self._held.items():
            on_disk.put(key, packed, scales, zero_points)
        self._held.clear()
        return on_disk
