#!/usr/bin/env bash
# Every benchmark in benchmarks/, from a fresh clone, with the options docs/performance.md quotes
# (docs/performance.md, "Running every benchmark").
# Usage: scripts/benchmarks.sh [--small] [--size parakeet|medium] [--only NAME]... [--skip NAME]...
#                              [--list] [--cache DIR] [--results DIR]
#   --small     only the benchmarks that build or fetch small models (bench_transpose,
#               bench_grouped, bench_auto, bench_cnn, bench_real, bench_registry, bench_coverage,
#               bench_repeat);
#               the others need the exports
#   --size      the exports' size: parakeet (default; the figures docs/performance.md quotes) or
#               medium (the same layers, a quarter of the width and depth, in DIR/medium: minutes
#               to make, every benchmark in well under an hour; the ratios are not the parakeet's)
#   --only      only this one (a name below, e.g. bench_rewrite); repeatable
#   --skip      all but this one; repeatable
#   --list      print the commands, run nothing
#   --cache     where fastconformer.py keeps the Parakeet-size exports (made on first use; about
#               10 GB, an hour on 2 cores) [default: ~/.cache/onnx-conv2matmul-bench]
#   --results   where each benchmark's printed table (and JSON, where it writes one) goes
#               [default: .bench/results/DATE]; run.txt there has the commit, the versions, the
#               CPU and each benchmark's load average at start and end, to quote with its figures
# The package is installed (as a user installs it, not editable) into .bench/venv with the
# `test` extra; torch and onnxscript too (BENCH_TORCH, default torch==2.13.0) when a benchmark
# needs the exports, since only fastconformer.py, which makes them, uses torch; Pillow for
# bench_real, which renders text lines. Each benchmark runs under
# nice -n 5, one after the other; one that fails is reported and the next one runs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
small=0
size=parakeet
list=0
only=()
skip=()
cache="$HOME/.cache/onnx-conv2matmul-bench"
results="$root/.bench/results/$(date -u +%Y%m%dT%H%M%SZ)"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --small) small=1 ;;
        --list) list=1 ;;
        --only) only+=("$2"); shift ;;
        --size) size="$2"; shift ;;
        --skip) skip+=("$2"); shift ;;
        --cache) cache="$2"; shift ;;
        --results) results="$2"; shift ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
    shift
done
case "$size" in
    parakeet) models="$cache" ;;
    medium) models="$cache/medium" ;;
    *) echo "unknown size: $size (parakeet or medium)" >&2; exit 2 ;;
esac
venv="$root/.bench/venv"
py="$venv/bin/python"

# name|needs the exports|command line (run in the clone's root; RESULTS is the results folder)
benchmarks=(
    "bench_transpose|0|benchmarks/bench_transpose.py --rounds 5"
    "bench_grouped|0|benchmarks/bench_grouped.py --runs 200 --json RESULTS/bench_grouped.json"
    "bench_grouped_2threads|0|benchmarks/bench_grouped.py --runs 200 --threads 2 --json RESULTS/bench_grouped_2threads.json"
    "bench_auto|0|benchmarks/bench_auto.py --rounds 2 --json RESULTS/bench_auto.json"
    "bench_cnn|0|benchmarks/bench_cnn.py --rounds 10 --json RESULTS/bench_cnn.json"
    "bench_real|0|benchmarks/bench_real.py"
    "bench_registry|0|benchmarks/bench_registry.py --json RESULTS/bench_registry.json"
    "bench_coverage|0|benchmarks/bench_coverage.py"
    "bench_repeat|0|benchmarks/bench_repeat.py --runs 3 --json RESULTS/bench_repeat.json"
    "bench_rewrite|1|benchmarks/bench_rewrite.py --cache CACHE --repeat 7 --latency-runs 30 --json RESULTS/bench_rewrite.json"
    "bench_fsync|1|benchmarks/bench_fsync.py --cache CACHE --rounds 9"
    "bench_quantize_phase|1|benchmarks/bench_quantize_phase.py --cache CACHE --rounds 3"
    "bench_check|1|benchmarks/bench_check.py --cache CACHE --json RESULTS/bench_check.json"
    "bench_speed|1|benchmarks/bench_speed.py --cache CACHE --json RESULTS/bench_speed.json"
    "bench_bundle|1|benchmarks/bench_bundle.py --cache CACHE --json RESULTS/bench_bundle.json"
    "bench_onepass|1|benchmarks/bench_onepass.py --model CACHE/encoder-dynamo-table/encoder-model.onnx --bundle CACHE/release --json RESULTS/bench_onepass.json"
    "bench_defaults|1|benchmarks/bench_defaults.py --encoder CACHE/encoder-dynamo-table/encoder-model.onnx --rounds 10 --json RESULTS/bench_defaults.json"
)

commands=()
names=()
for entry in "${benchmarks[@]}"; do
    IFS='|' read -r name full command <<<"$entry"
    if [[ "$small" == 1 && "$full" == 1 ]]; then
        continue
    fi
    if [[ ${#only[@]} -gt 0 && ! " ${only[*]} " =~ " $name " ]]; then
        continue
    fi
    if [[ ${#skip[@]} -gt 0 && " ${skip[*]} " =~ " $name " ]]; then
        continue
    fi
    needs_exports=$((${needs_exports:-0} | full))
    command="${command//RESULTS/$results}"
    names+=("$name")
    commands+=("${command//CACHE/$models}")
done
prepare="benchmarks/fastconformer.py cache --dir $cache --size $size"

if [[ "$list" == 1 ]]; then
    echo "# in $root, with $py"
    if [[ "${needs_exports:-0}" == 1 ]]; then echo "nice -n 5 $py $prepare"; fi
    for command in "${commands[@]}"; do
        echo "nice -n 5 $py $command"
    done
    exit 0
fi

if [[ ! -x "$py" ]]; then
    python3 -m venv "$venv"
    "$py" -m pip install --quiet --upgrade pip
fi
"$py" -m pip install --quiet "$root[test]"
if [[ " ${names[*]} " =~ " bench_real " ]]; then
    "$py" -m pip install --quiet pillow
fi
if [[ "${needs_exports:-0}" == 1 ]]; then
    "$py" -m pip install --quiet "${BENCH_TORCH:-torch==2.13.0}" onnxscript
fi

mkdir -p "$results"
cd "$root"
load() { cut -d' ' -f1-3 /proc/loadavg; }
{
    echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "started: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "python: $("$py" --version 2>&1)"
    "$py" -c 'import onnx, onnxruntime; print(f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}")'
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
} | tee "$results/run.txt"
if [[ "${needs_exports:-0}" == 1 ]]; then
    echo "== the $size-size exports ($models)"
    # shellcheck disable=SC2086
    nice -n 5 "$py" $prepare 2>&1 | tee "$results/fastconformer_cache.txt"
fi
failed=()
for i in "${!commands[@]}"; do
    echo "== ${names[$i]}: ${commands[$i]}"
    echo "${names[$i]}: load average (1, 5, 15 min) at start $(load)" >>"$results/run.txt"
    # shellcheck disable=SC2086
    if ! nice -n 5 "$py" ${commands[$i]} 2>&1 | tee "$results/${names[$i]}.txt"; then
        failed+=("${names[$i]}")
    fi
    echo "${names[$i]}: load average (1, 5, 15 min) at end $(load), $(date -u +%H:%M:%SZ)" >>"$results/run.txt"
done
echo "finished: $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$results/run.txt"
echo "results: $results"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
