"""Print mutmut's score per module from mutants/*.meta (scripts/mutation.sh, docs/mutation.md).

Usage: python scripts/mutation_scores.py [--survivors]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

MODULES = ["analysis", "rewrite", "cleanup", "_layout", "verify"]
# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code)
KILLED = {1, 3, 37}
STATUS = {0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout", None: "not checked"}


def main() -> int:
    root = Path("mutants/src/onnx_conv2matmul")
    show = "--survivors" in sys.argv
    print(f"{'module':<10} {'killed':>7} {'total':>6} {'score':>7}  other")
    for module in MODULES:
        meta = root / f"{module}.py.meta"
        if not meta.exists():
            print(f"{module:<10} (not run)")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        killed = sum(code in KILLED for code in codes.values())
        other = Counter(STATUS.get(code, "suspicious") for code in codes.values() if code not in KILLED)
        rest = ", ".join(f"{n} {what}" for what, n in sorted(other.items()))
        score = 100 * killed / len(codes) if codes else 0.0
        print(f"{module:<10} {killed:>7} {len(codes):>6} {score:>6.1f}%  {rest}")
        if show:
            for key, code in sorted(codes.items()):
                if code not in KILLED:
                    print(f"    {STATUS.get(code, 'suspicious'):<12} {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
