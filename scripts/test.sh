#!/usr/bin/env bash
# Set up (the project's virtual environment with the dev extra), lint, type-check, run the test
# suite in that environment. Fails when pytest runs no test (exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
venv="${SPECSTREAM_VENV:-.venv}"
set +u  # activate reads unset variables
# shellcheck disable=SC1091
. "$venv/bin/activate"
set -u
ruff check .
# type-check the engine (all of it), the KV manager, speculation, the config and its options
# and the offline API with the flags of --strict (pyproject.toml's [[tool.mypy.overrides]])
mypy specstream/engine specstream/kvcache specstream/spec specstream/config.py \
    specstream/options.py specstream/defaults.py specstream/modes.py specstream/llm.py \
    specstream/registry.py specstream/structured
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
