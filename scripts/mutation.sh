#!/usr/bin/env bash
# Mutation testing with mutmut (docs/mutation.md), in an environment of its own.
# Usage: scripts/mutation.sh [MUTANT_NAME_OR_GLOB...]
#   scripts/mutation.sh                                          every mutant not yet run
#   scripts/mutation.sh 'onnx_conv2matmul.files.publish.*'       (re)run those mutants
#
# Isolation, so that a run tests this checkout and nothing else:
# - the files git tracks (as they are in the working tree) are copied to .mutation/tree/, where
#   mutmut writes its mutants/ and results; a later run copies them again and mutmut keeps the
#   results of the functions that did not change (delete .mutation/tree/mutants to start over);
# - .mutation/venv/ is a virtual environment made for it from pyproject.toml (the `test` and
#   `mutation` extras), with this package itself uninstalled again: no installed copy, editable
#   or not, of this or another checkout can be imported instead of the mutated one;
# - PYTHONPATH is .mutation/tree/mutants/src only, so the tests that run the tool in a
#   subprocess import the copy under test too; user site-packages are off.
# MUTATION_TESTS="tests/test_a.py tests/test_b.py" narrows the tests to those files, for this run
# (the copy's pyproject.toml is changed, not yours): quicker, and a mutant that survives them may
# still be killed by the whole selection, so its scores are lower bounds.
# MUTATION_DIR moves .mutation/; MUTATION_CHILDREN (default 2) caps mutmut's workers;
# MUTATION_REINSTALL=1 remakes the environment (as a change to pyproject.toml does); MUTATION_NICE (default 19) is the niceness the run
# adds (10 lets it through on a machine busy with other niced work). Runs niced with the hypothesis
# profile `mutation` (tests/conftest.py), then prints the score per module
# (scripts/mutation_scores.py; add --survivors there to list what was not killed).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${MUTATION_DIR:-$root/.mutation}"
venv="$work/venv"
tree="$work/tree"
python="${PYTHON:-python3}"

# The environment is remade when pyproject.toml changed since it was made (a new dependency).
stamp="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [[ "${MUTATION_REINSTALL:-0}" == 1 || "$(cat "$venv/.pyproject-sha256" 2>/dev/null)" != "$stamp" ]]; then
    rm -rf "$venv"
fi
if [[ ! -x "$venv/bin/mutmut" ]]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "$root[test,mutation]"
    "$venv/bin/python" -m pip uninstall --quiet --yes onnx-conv2matmul
    echo "$stamp" > "$venv/.pyproject-sha256"
fi

# The tracked files as they are now, their mtimes kept: mutmut regenerates the mutants of a
# source file only when it is newer than its mutated copy, and keeps the results of the
# functions whose code did not change.
mkdir -p "$tree"
(cd "$tree" && find . -mindepth 1 -maxdepth 1 ! -name mutants -exec rm -rf {} +)
(cd "$root" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    if [[ -e "$f" ]]; then printf '%s\0' "$f"; fi
done | xargs -0 cp -p --parents -t "$tree")

cd "$tree"
if [[ -n "${MUTATION_TESTS:-}" ]]; then
    MUTATION_TESTS="$MUTATION_TESTS" "$venv/bin/python" - <<'PY'
import os
import re
from pathlib import Path

path = Path("pyproject.toml")
files = ", ".join(f'"{name}"' for name in os.environ["MUTATION_TESTS"].split())
text, count = re.subn(
    r"pytest_add_cli_args_test_selection = \[.*?\]",
    f"pytest_add_cli_args_test_selection = [{files}]",
    path.read_text(),
    flags=re.S,
)
assert count == 1, "no pytest_add_cli_args_test_selection in pyproject.toml"
path.write_text(text)
PY
fi
# Made before Python starts: a PYTHONPATH entry that does not exist yet at the first import is
# remembered as "no finder" and never looked in again, mutmut's own sys.path entry included.
mkdir -p mutants/src
status=0
env -u PYTHONHOME \
    PATH="$venv/bin:$PATH" \
    PYTHONPATH="$tree/mutants/src" \
    PYTHONNOUSERSITE=1 \
    HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-mutation}" \
    nice -n "${MUTATION_NICE:-19}" "$venv/bin/mutmut" run --max-children "${MUTATION_CHILDREN:-2}" "$@" || status=$?
nice -n "${MUTATION_NICE:-19}" "$venv/bin/python" scripts/mutation_scores.py
exit "$status"
