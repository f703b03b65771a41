#!/usr/bin/env bash
# Mutation testing with mutmut (docs/mutation.md). Needs the `mutation` extra:
#   pip install -e '.[test,mutation]'
# Usage: scripts/mutation.sh [MUTMUT_RUN_ARGS...]   e.g. scripts/mutation.sh 'onnx_conv2matmul.cleanup*'
# Runs niced, with at most MUTATION_CHILDREN (default 2) workers, the hypothesis profile
# `mutation` (tests/conftest.py), then prints the score per module.
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-mutation}"
nice -n 19 mutmut run --max-children "${MUTATION_CHILDREN:-2}" "$@" || true
nice -n 19 python scripts/mutation_scores.py
