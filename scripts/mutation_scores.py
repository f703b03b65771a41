"""Print mutmut's score per module from mutants/*.meta (scripts/mutation.sh, docs/mutation.md).

Usage: python scripts/mutation_scores.py [--survivors]

``score`` is killed / total; ``non-eq`` is killed / (total - the equivalent mutants listed
in EQUIVALENT below that the run did not kill). ``--survivors`` lists every mutant not
killed, marked ``equivalent`` when it is in EQUIVALENT.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

MODULES = ["analysis", "rewrite", "gemm", "_fused", "cleanup", "_layout", "verify"]
# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1 and 3 killed, 37 caught by mypy.
KILLED = {1, 3, 37}
STATUS = {0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout", None: "not checked"}

_ASTYPE = "astype(None) is astype(float64)"
_STRICT = "zip(strict=...): the lengths were checked equal just before"
_INT64 = "np.array of Python ints is int64 (64-bit Linux and macOS, numpy 2)"
_BLOCK = "the rows copied per block: any whole step gives the same array (speed only)"
_AUTO_PAD = "auto_pad with a pads attribute is skipped before: pads are the default 0s"
_PART = "the per-tensor row: only .passed and .note are read, which do not depend on this"
# Mutants that cannot change behaviour, with the reason (docs/mutation.md). Where every
# mutant of a line is equivalent, the line has a "# pragma: no mutate" instead.
EQUIVALENT = {
    "verify.x__exact_tally__mutmut_3": "np.asarray(ref != out, dtype=None): ref != out is already bool",
    "verify.x__exact_tally__mutmut_5": "np.asarray(ref != out): ref != out is already bool",
    "verify.x__exact_tally__mutmut_9": _ASTYPE,
    "verify.x__exact_tally__mutmut_13": _ASTYPE,
    "verify.x__exact_tally__mutmut_14": _ASTYPE,
    "verify.x__float_tally__mutmut_2": _ASTYPE,
    "verify.x__float_tally__mutmut_4": _ASTYPE,
    "verify.x__float_tally__mutmut_26": "exact=None: _Tally.exact is only tested for truth",
    "verify.x_compare_sequences__mutmut_24": _STRICT,
    "verify.x_compare_sequences__mutmut_27": _STRICT,
    "verify.x_compare_sequences__mutmut_28": _STRICT,
    "verify.x_compare_sequences__mutmut_62": _STRICT,
    "verify.x_compare_sequences__mutmut_65": _STRICT,
    "verify.x_compare_sequences__mutmut_66": _STRICT,
    "verify.x_compare_sequences__mutmut_77": _PART,
    "verify.x_compare_sequences__mutmut_78": _PART,
    "verify.x_compare_sequences__mutmut_79": _PART,
    "verify.x_compare_sequences__mutmut_80": _PART,
    "verify.x_compare_sequences__mutmut_94": "the row's dtype only sets .passed and .note, overwritten next",
    "verify.x_element_scales__mutmut_13": "max(initial=1.0) under max(1.0, ...)",
    "verify.x_element_scales__mutmut_35": "max(initial=1.0) under np.maximum(1.0, ...)",
    "analysis.x__check_shapes__mutmut_50": "a bias's value shape is its constant's when both are known",
    "analysis.x__plan__mutmut_8": 'onnx_ir turns the domain "ai.onnx" into ""',
    "analysis.x__plan__mutmut_9": 'onnx_ir turns the domain "ai.onnx" into ""',
    "analysis.x__plan__mutmut_261": _AUTO_PAD,
    "analysis.x__plan__mutmut_269": _AUTO_PAD,
    "cleanup.x_sink_transposes__mutmut_3": "_ours(every=None): every is only tested for truth",
    "analysis.x_constant_tensor__mutmut_1": "onnx_ir sets const_value on initializers only",
    "analysis.x_constant_tensor__mutmut_13": 'onnx_ir turns the domain "ai.onnx" into ""',
    "rewrite.x_transpose_2d__mutmut_12": _BLOCK,
    "rewrite.x_transpose_2d__mutmut_14": _BLOCK,
    "rewrite.x_transpose_2d__mutmut_19": _BLOCK,
    "rewrite.x_transpose_2d__mutmut_25": _BLOCK,
    "rewrite.x__transposed_weight__mutmut_12": "the materialized tensor's name: never read",
    "rewrite.xǁRewriterǁ_const_node__mutmut_9": _INT64,
    "rewrite.xǁRewriterǁ_const_node__mutmut_11": _INT64,
    "rewrite.xǁRewriterǁapply__mutmut_175": "ir.node(attributes=None) is ir.node(attributes={})",
    "rewrite.xǁRewriterǁapply__mutmut_196": "ir.node(attributes=None) is ir.node(attributes={})",
    "rewrite.xǁRewriterǁapply__mutmut_214": "ir.node(attributes=None) is ir.node(attributes={})",
    "rewrite.xǁRewriterǁapply__mutmut_239": "the last value's name: it takes the conv output's name",
    "rewrite.xǁRewriterǁapply__mutmut_240": "the last value's name: it takes the conv output's name",
    "cleanup.x__collapse__mutmut_11": "graph.remove(safe=None): safe only adds checks, which pass",
    "cleanup.x__collapse__mutmut_13": "graph.remove() without safe: safe only adds checks, which pass",
    "_layout.x__readers_leaving__mutmut_12": "Link.ours of a converted reader: never read there",
    "_layout.x__readers_leaving__mutmut_18": "Link.ours of a converted reader: never read there",
    "_layout.x__input_side__mutmut_4": "unreachable: the analysis plans no conv without input",
    "_layout.x__input_side__mutmut_49": "not through: readers is None or does not start with this conv",
    "_layout.x__input_side__mutmut_50": "through implies start and top not None; else as 49",
    "_layout.x__output_side__mutmut_18": "Link.node of the conv's own link: never read",
    "_layout.x_walk_up__mutmut_15": "Link.node of a converted producer: never read",
    "_layout.x_outcome__mutmut_24": "through with a Transpose kept: _collapse returns before reading top, "
    "which keeps a reader; _readers_leaving wants (0, True)",
    "_layout.x_as_link__mutmut_7": "Link.ours None for False: only tested for truth",
    "_layout.x_is_sinkable__mutmut_9": 'onnx_ir turns the domain "ai.onnx" into ""',
    "_layout.x_is_sinkable__mutmut_10": 'onnx_ir turns the domain "ai.onnx" into ""',
    "_layout.x_is_transpose__mutmut_10": 'onnx_ir turns the domain "ai.onnx" into ""',
    "_layout.x_is_transpose__mutmut_11": 'onnx_ir turns the domain "ai.onnx" into ""',
}


def main() -> int:
    root = Path("mutants/src/onnx_conv2matmul")
    show = "--survivors" in sys.argv
    print(f"{'module':<10} {'killed':>7} {'total':>6} {'score':>7} {'equiv':>6} {'non-eq':>7}  other")
    for module in MODULES:
        meta = root / f"{module}.py.meta"
        if not meta.exists():
            print(f"{module:<10} (not run)")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        killed = sum(code in KILLED for code in codes.values())
        equivalent = [
            key for key, code in codes.items() if code not in KILLED and key.partition(".")[2] in EQUIVALENT
        ]
        other = Counter(STATUS.get(code, "suspicious") for code in codes.values() if code not in KILLED)
        rest = ", ".join(f"{n} {what}" for what, n in sorted(other.items()))
        score = 100 * killed / len(codes) if codes else 0.0
        relevant = len(codes) - len(equivalent)
        non_eq = 100 * killed / relevant if relevant else 100.0
        counts = f"{killed:>7} {len(codes):>6} {score:>6.1f}% {len(equivalent):>6} {non_eq:>6.1f}%"
        print(f"{module:<10} {counts}  {rest}")
        if show:
            for key, code in sorted(codes.items()):
                if code not in KILLED:
                    mark = "equivalent" if key in equivalent else STATUS.get(code, "suspicious")
                    print(f"    {mark:<12} {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
