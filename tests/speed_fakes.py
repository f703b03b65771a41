"""A fake clock and fake sessions for the speed tests: a run costs what the test says, so no test
depends on how fast anything runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from onnx_conv2matmul.quantize.nbits import quantize_matmul_nbits
from onnx_conv2matmul.quantize.options import QuantizeOptions


class FakeClock:
    """Seconds that pass only when a fake run says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


@dataclasses.dataclass
class FakeInput:
    name: str
    type: str
    shape: list[Any]


ENCODER_INPUTS = [
    FakeInput("audio_signal", "tensor(float)", ["batch", 4, "time"]),
    FakeInput("length", "tensor(int64)", ["batch"]),
]

Cost = Callable[[str, int], float]
"""Milliseconds a run of the model at a path costs at a length."""


class Sessions:
    """A session factory whose sessions advance ``clock`` by ``cost(path, length)`` per run.

    Records every run as (path, length), every session opened as (path, threads), and the
    largest number of sessions alive at once."""

    def __init__(
        self,
        clock: FakeClock,
        cost: Cost,
        inputs: Mapping[str, Sequence[FakeInput]] | None = None,
        real: bool = False,
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.inputs = inputs or {}
        self.real = real
        self.runs: list[tuple[str, int]] = []
        self.opened: list[tuple[str, int]] = []
        self.feeds: list[tuple[str, dict[str, np.ndarray]]] = []
        self.alive = 0
        self.most_alive = 0
        self.fail_open: set[str] = set()
        self.fail_run: set[str] = set()

    def __call__(self, path: str, threads: int) -> Any:
        if path in self.fail_open:
            raise RuntimeError(f"cannot open {path}\nsecond line")
        self.opened.append((path, threads))
        return _FakeSession(self, path)


class _FakeSession:
    def __init__(self, owner: Sessions, path: str) -> None:
        self.owner = owner
        self.path = path
        self.inner: Any = None
        if owner.real:
            import onnxruntime as ort

            self.inner = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        owner.alive += 1
        owner.most_alive = max(owner.most_alive, owner.alive)

    def __del__(self) -> None:
        self.owner.alive -= 1

    def get_inputs(self) -> Sequence[Any]:
        if self.inner is not None:
            return self.inner.get_inputs()  # type: ignore[no-any-return]
        return self.owner.inputs.get(self.path, ENCODER_INPUTS)

    def run(self, names: Any, feeds: Mapping[str, np.ndarray]) -> Any:
        if self.path in self.owner.fail_run:
            raise RuntimeError("shape mismatch")
        length = max(max(a.shape, default=1) for a in feeds.values()) if feeds else 0
        first = next(iter(feeds.values()))
        length = first.shape[-1] if first.ndim else length
        self.owner.runs.append((self.path, int(length)))
        self.owner.feeds.append((self.path, dict(feeds)))
        self.owner.clock.now += self.owner.cost(self.path, int(length)) / 1000
        return self.inner.run(names, feeds) if self.inner is not None else None


def sequence_matmul_model(k: int = 64, n: int = 48, seed: int = 0) -> onnx.ModelProto:
    """x [B, T, K] -> MatMul(W [K, N]) -> Relu -> MatMul(V [N, N]): a small model to quantize."""
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "V"], ["y"], name="mm2"),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "time", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "time", n])],
        [
            numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "V"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def quantized(model: onnx.ModelProto, accuracy_level: int = 0) -> onnx.ModelProto:
    """``model`` with every MatMul as MatMulNBits (4 bits, block 16), by the tool's quantizer."""
    ir_model = ir.serde.deserialize_model(model)
    quantize_matmul_nbits(ir_model, QuantizeOptions(block_size=16, accuracy_level=accuracy_level))
    return ir.serde.serialize_model(ir_model)


KernelCost = Callable[[str, int, int, int], float]
"""Milliseconds a kernel (its key: ``float``, ``int4-b64-l0``...) costs at K, N and rows."""


class KernelMachine:
    """A session factory for :class:`onnx_conv2matmul.speed.costs.KernelCosts`: each run of a
    kernel model advances ``clock`` by ``cost(kernel key, k, n, rows)``, read from the model's
    file name and the feed. Records every session opened (its file name)."""

    def __init__(self, clock: FakeClock, cost: KernelCost) -> None:
        self.clock = clock
        self.cost = cost
        self.opened: list[str] = []
        self.runs: list[tuple[str, int]] = []

    def __call__(self, path: str, threads: int) -> Any:
        import os
        import re

        name = os.path.basename(path)
        self.opened.append(name)
        found = re.fullmatch(r"(.+)-(\d+)x(\d+)\.onnx", name)
        assert found is not None, name
        key, k, n = found.group(1), int(found.group(2)), int(found.group(3))
        machine = self

        class _Session:
            def get_inputs(self) -> list[FakeInput]:
                return [FakeInput("x", "tensor(float)", ["rows", k])]

            def run(self, names: Any, feeds: Mapping[str, np.ndarray]) -> None:
                rows = int(next(iter(feeds.values())).shape[0])
                machine.runs.append((key, rows))
                machine.clock.now += machine.cost(key, k, n, rows) / 1000

        return _Session()


def int8_machine(int8_factor: float, int4_factor: float = 0.5) -> KernelCost:
    """A CPU where a 4-bit kernel costs ``int4_factor`` and an 8-bit one ``int8_factor`` times the
    float MatMul (level 4 a little cheaper than level 0, larger blocks a little cheaper)."""

    def cost(key: str, k: int, n: int, rows: int) -> float:
        base = k * n * rows / 1e6
        if key == "float":
            return base
        bits, block, level = key.split("-")
        factor = int8_factor if bits == "int8" else int4_factor
        factor *= 0.9 if level == "l4" else 1.0
        factor *= 1.0 - int(block[1:]) / 2048
        return base * factor

    return cost
