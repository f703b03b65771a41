"""A host program that uses the library as a script would: run by tests/test_process_state.py in
a fresh interpreter (no test runner's logging handlers, nothing imported yet).

``python tests/host_program.py WORKDIR {main,worker} {bare,configured}`` imports the package,
calls every public function once on tiny models (in the main thread or in a worker thread) and
prints, as the last line of stdout, a JSON object with the process state seen before and after:
the root logger's handlers and level, every signal's handler, ``sys.stdout``/``sys.stderr``, the
umask (read from ``/proc``, never set), the warnings filters, the switch interval, the working
directory and the environment. ``configured``: the host installs its own root handler first.

The host imports numpy and sympy before it looks: the warnings filters they add on import are
theirs (onnxruntime imports sympy), not the package's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DATA = Path(__file__).resolve().parent / "data"


def _umask() -> str:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return line.split()[1]
    raise AssertionError("no Umask line in /proc/self/status")


def _signals() -> dict[str, str]:
    handlers = {}
    for signum in sorted(signal.valid_signals()):
        try:
            handlers[str(int(signum))] = repr(signal.getsignal(signum))
        except (OSError, ValueError):
            continue
    return handlers


def state() -> dict[str, Any]:
    root = logging.getLogger()
    return {
        "root_handlers": [f"{type(h).__name__}@{id(h):x}" for h in root.handlers],
        "root_level": root.level,
        "signals": _signals(),
        "stdout": f"{type(sys.stdout).__name__}@{id(sys.stdout):x}",
        "stderr": f"{type(sys.stderr).__name__}@{id(sys.stderr):x}",
        "umask": _umask(),
        "warnings": [repr(f) for f in warnings.filters],
        "switch_interval": sys.getswitchinterval(),
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
    }


def every_public_function(work: Path) -> list[str]:
    """Each public function of the package once; the report types' names, in call order."""
    import numpy as np
    import onnx
    import onnx_ir as ir

    import onnx_conv2matmul as lib
    from helpers import stack_model

    model = work / "m.onnx"
    onnx.save(stack_model(layers=2, channels=64), model)
    feeds = work / "feeds.npz"
    np.savez(feeds, x=np.random.default_rng(0).standard_normal((1, 5, 64)).astype(np.float32))
    out = work / "out"
    out.mkdir()
    check = lib.VerifyOptions(lengths=(3, 5))
    timing = lib.TimingOptions(lengths=(4,), rounds=3, warmup=0, threads=1)
    in_memory, converted = lib.convert(onnx.load(model))
    lib.ConvToMatMulPass()(ir.serde.deserialize_model(in_memory))
    reports: list[object] = [
        converted,
        lib.convert_file(model, out / "c.onnx", verify=check),
        lib.verify_files(model, out / "c.onnx", lib.VerifyOptions(feeds=tuple(lib.load_inputs([feeds])))),
        lib.quantize_file(model, out / "q.onnx", lib.QuantizeOptions(block_size=32), verify=check),
        lib.quantize_file(model, out / "i8.onnx", int8_dynamic=True, verify=check),
        lib.quantize_file(model, out / "a.onnx", auto=lib.AutoOptions(max_evaluations=2), verify=check),
        lib.quantize_file(
            model,
            out / "s.onnx",
            lib.QuantizeOptions(block_size=32),
            verify=check,
            speed=lib.SpeedOptions(timing=timing, levels=(0, 4), block_sizes=(32,)),
        ),
        lib.inspect_file(model),
        lib.check_bundle(out, manifest=True),
        lib.bench_models([model, out / "q.onnx"], (4,), options=timing),
    ]
    source = work / "release"
    shutil.copytree(DATA / "parakeet_small", source)
    reports.append(lib.build_bundle(source, work / "bundle"))
    return [type(r).__name__ for r in reports]


def main() -> None:
    work, where, host = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if host == "configured":
        handler = logging.StreamHandler(sys.stderr)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.WARNING)
    import numpy  # noqa: F401
    import sympy  # noqa: F401

    before = state()
    import onnx_conv2matmul  # noqa: F401

    if where == "main":
        reports = every_public_function(work)
    else:
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["reports"] = every_public_function(work)
            except BaseException as err:  # reported by the main thread
                result["error"] = err

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        reports = result["reports"]
    after = state()
    sys.stdout.write(json.dumps({"reports": reports, "before": before, "after": after}) + "\n")


if __name__ == "__main__":
    main()
