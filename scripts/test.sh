#!/usr/bin/env bash
# Set up, lint, run the test suite. Fails when pytest runs no test (exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check .
# type-check the engine core (scheduler, step contract, worker, round, KV manager, config,
# offline API) with the flags of --strict (pyproject.toml's [[tool.mypy.overrides]])
mypy specstream/engine specstream/kvcache specstream/config.py specstream/llm.py \
    specstream/registry.py
set +e
python3 -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
