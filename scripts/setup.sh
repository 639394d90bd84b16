#!/usr/bin/env bash
# Make the project's own virtual environment and install SpecStream into it.
#
#   bash scripts/setup.sh            # what the main job needs: .venv/bin/specstream generate ...
#   bash scripts/setup.sh dev        # + an extra (dev: the test tools; serve: the HTTP server)
#
# The environment is .venv in the repository (SPECSTREAM_VENV=DIR for another place), made
# from python3 (PYTHON=... for another), so a system Python that refuses `pip install`
# (PEP 668, "externally managed") is never written to. It does not see the system's packages.
#
# torch is installed first and pinned: on CPU machines torch==2.13.0 is the local CPU build, and
# an unpinned torch would pull a multi-GB CUDA build. A torch already in the environment is
# kept (2.4 or newer), so a GPU machine installs its CUDA build once, before or instead of the pin:
#   SPECSTREAM_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" \
#       bash scripts/setup.sh
# (or `python3 -m venv .venv && .venv/bin/pip install <your torch>`, then this script).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${SPECSTREAM_VENV:-.venv}"
python="${PYTHON:-python3}"
extras=$(IFS=,; echo "$*")

say() { echo "[setup] $*" >&2; }

if [ -e "$venv" ] && ! "$venv/bin/python" -c "" 2>/dev/null; then
    if [ -f "$venv/pyvenv.cfg" ]; then
        say "$venv is a broken virtual environment (its Python moved?): making it again"
        rm -rf "$venv"
    else
        say "$venv exists and is not a virtual environment: set SPECSTREAM_VENV=DIR"
        exit 1
    fi
fi
if [ ! -e "$venv" ]; then
    if ! "$python" -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
        say "$python is missing or older than 3.10: set PYTHON=/path/to/python3.10+"
        exit 1
    fi
    say "making the virtual environment $venv ($("$python" --version 2>&1))"
    if ! "$python" -m venv "$venv"; then
        rm -rf "$venv"
        say "$python -m venv failed; on Debian/Ubuntu: apt-get install python3-venv"
        exit 1
    fi
fi
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)

# a torch older than pyproject's floor would make pip resolve a new, unpinned one: pin instead
if ! "$venv/bin/python" -c "import sys, torch
sys.exit(tuple(int(x) for x in torch.__version__.split('.')[:2]) < (2, 4))" 2>/dev/null; then
    read -r -a torch_spec <<< "${SPECSTREAM_TORCH:-torch==2.13.0}"
    say "installing ${torch_spec[*]}"
    "${pip[@]}" install "${torch_spec[@]}"
fi
say "installing specstream (pip install -e .${extras:+[$extras]})"
"${pip[@]}" install -e ".${extras:+[$extras]}"
say "done: run $venv/bin/specstream, or activate the environment with: . $venv/bin/activate"
