#!/usr/bin/env bash
# Install SpecStream and its test tools into the active Python environment.
# torch is pinned first: on CPU machines 2.13.0 is the local CPU build; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine install your CUDA build of torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
    python3 -m pip install -q "torch==2.13.0"
fi
python3 -m pip install -q -e ".[dev]"
