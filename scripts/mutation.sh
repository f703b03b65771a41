#!/usr/bin/env bash
# Mutation testing with mutmut (docs/mutation.md). Needs the `mutation` extra:
#   pip install -e '.[test,mutation]'
# Usage: scripts/mutation.sh [MUTANT_NAME_OR_GLOB...]
#   scripts/mutation.sh                                  every mutant not yet run
#   scripts/mutation.sh 'onnx_conv2matmul.rewrite.cleanup.*'     (re)run those mutants
# Runs niced, with at most MUTATION_CHILDREN (default 2) workers and the hypothesis
# profile `mutation` (tests/conftest.py), then prints the score per module
# (scripts/mutation_scores.py; add --survivors there to list what was not killed).
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-mutation}"
status=0
nice -n 19 mutmut run --max-children "${MUTATION_CHILDREN:-2}" "$@" || status=$?
nice -n 19 python scripts/mutation_scores.py
exit "$status"
