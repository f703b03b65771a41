"""The weight transposition the rewrite does once per converted weight, against numpy's.

``rewrite.transpose_2d`` copies blocks of rows so that each write fills whole cache lines;
``np.ascontiguousarray(array.T)`` writes one element per cache line in its inner loop. Both
are timed on the same arrays in alternating rounds; the table gives the median of the
per-round ratios (numpy time / ours), so a slow drift of the machine hits both alike.

    python benchmarks/bench_transpose.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from onnx_conv2matmul.rewrite.apply import transpose_2d

# [out_channels, in_channels] of pointwise-conv weights in a Parakeet-sized encoder, and a small one.
SHAPES = [(256, 256), (1024, 1024), (2048, 1024), (4096, 1024)]


def _best_of(func: object, array: np.ndarray, number: int = 3) -> float:
    best = float("inf")
    for _ in range(number):
        start = time.perf_counter()
        func(array)  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'shape':>12} {'dtype':>8} {'ours ms':>9} {'numpy ms':>9} {'numpy/ours':>11}")
    for dtype in (np.float32, np.float16):
        for shape in SHAPES:
            array = rng.standard_normal(shape).astype(dtype)
            assert np.array_equal(transpose_2d(array), array.T)
            ours, theirs, ratios = [], [], []
            for round_ in range(args.rounds):
                pair = [("ours", transpose_2d), ("numpy", lambda a: np.ascontiguousarray(a.T))]
                if round_ % 2:
                    pair.reverse()
                times = {name: _best_of(func, array) for name, func in pair}
                ours.append(times["ours"])
                theirs.append(times["numpy"])
                ratios.append(times["numpy"] / times["ours"])
            print(
                f"{'x'.join(map(str, shape)):>12} {np.dtype(dtype).name:>8}"
                f" {statistics.median(ours) * 1e3:9.2f} {statistics.median(theirs) * 1e3:9.2f}"
                f" {statistics.median(ratios):11.2f}"
            )


if __name__ == "__main__":
    main()
