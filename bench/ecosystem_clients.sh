#!/usr/bin/env bash
# SGLang's bench_serving.py (from the sglang wheel) against specstream serve on the embedded
# pair, completions and chat, next to the server's own /metrics. Writes
# bench/results/ecosystem-clients.{json,md}; flags go to bench/ecosystem_clients.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
exec "${SPECSTREAM_VENV:-.venv}/bin/python" bench/ecosystem_clients.py "$@"
