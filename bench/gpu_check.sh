#!/usr/bin/env bash
# One-shot GPU check (issue 9): at most ~8 minutes on one H200 with the machine's own python3
# (torch + CUDA, Triton, transformers; no network, nothing installed). Writes
# bench/results/gpu-check.json (merged step by step, so a killed step keeps what came before)
# and bench/results/gpu-check.log, then prints a summary table.
#
#   bash bench/gpu_check.sh              # on the GPU machine
#   bash bench/gpu_check.sh --dry-run    # same steps on the CPU with tiny shapes (< 2 min)
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (default 470), GPU_CHECK_OUT,
# GPU_CHECK_WORK (random checkpoints, default /tmp/specstream-gpu-check).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo itself; nothing is installed
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BUDGET=${GPU_CHECK_BUDGET_S:-470}
WORK=${GPU_CHECK_WORK:-/tmp/specstream-gpu-check}
if [[ "${1:-}" == "--dry-run" ]]; then
  DEVICE=cpu; EXTRA=(--tiny); DIR=${GPU_CHECK_OUT:-$WORK/dry-run}
  BENCH_ARGS=(--device cpu --dtype float32 --modes resident,offload,specstream
              --num-requests 2 --context-len 512 --output-len 32)  # enough rounds for floors
  # Triton's interpreter is slow: the torch path for every mode, the kernel for one
  MECH_ARGS=(--attention-backend torch
             --modes specstream,resident,offload,specstream+triton,offload-spec,resident-ar,stream)
  export TRITON_INTERPRET=1  # the Triton kernel, where Triton is installed, on the CPU
else
  DEVICE=cuda; EXTRA=(); DIR=${GPU_CHECK_OUT:-bench/results}
  BENCH_ARGS=(--device cuda --dtype float32 --quick)
  MECH_ARGS=(--attention-backend triton)  # and specstream+torch for comparison (the default)
fi
if [[ ! -f specstream/assets/default-draft/config.json ]]; then  # until the pair ships a draft
  BENCH_ARGS+=(--draft-model specstream/assets/default-target)
fi
mkdir -p "$DIR" "$WORK"
OUT=$DIR/gpu-check.json
LOG=$DIR/gpu-check.log
rm -f "$OUT"
START=$(date +%s)
echo "gpu_check: $(date -u +%FT%TZ) device=$DEVICE budget=${BUDGET}s git=$(git rev-parse --short HEAD 2>/dev/null || echo none)" | tee "$LOG"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT_S ARGS...: one gpu_check.py step under `timeout`, never past the budget
step() {
  local name=$1 limit=$2; shift 2
  local remaining; remaining=$(( $(left) - 15 ))  # keep time for the summary
  (( limit > remaining )) && limit=$remaining
  if (( limit < 5 )); then
    echo "== $name: skipped (out of time)" | tee -a "$LOG"
    "$PY" bench/gpu_check.py mark "$name" --out "$OUT" --rc 124 >/dev/null 2>&1
    return
  fi
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$PY" bench/gpu_check.py "$name" --out "$OUT" \
    --device "$DEVICE" --work-dir "$WORK" "${EXTRA[@]}" "$@" >>"$LOG" 2>&1
  local rc=$?
  if (( rc == 124 || rc == 137 )); then
    "$PY" bench/gpu_check.py mark "$name" --out "$OUT" --rc "$rc" >>"$LOG" 2>&1
  fi
  tail -n 1 "$LOG"
}

step env 30
step bandwidth 45
step exactness 60

# pytests NAME CAP RESERVE FILES...: pytest on FILES under `timeout` (at most CAP seconds, and
# never into the last RESERVE seconds of the budget); skipped where pytest is missing
pytests() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local limit=$(( $(left) - reserve )); (( limit > cap )) && limit=$cap
  if (( limit < 10 )); then
    echo "== $name: skipped (out of time)" | tee -a "$LOG"
    return
  fi
  if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "== $name: pytest not installed, skipped" | tee -a "$LOG"
    return
  fi
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$PY" -m pytest -q -p no:cacheprovider "$@" \
    >"$DIR/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$DIR/$name.log" | tee -a "$LOG"
  printf '{"rc": %d, "summary": "%s"}\n' "$rc" "$(tail -n 1 "$DIR/$name.log" | tr -d '"')" \
    >"$DIR/$name.json"
  "$PY" bench/gpu_check.py attach "$name" --out "$OUT" --file "$DIR/$name.json" --rc "$rc" \
    >>"$LOG" 2>&1
}

# the CUDA-marked tests; on the dry run the same files on CPU (their CUDA tests skipped). The
# engine's own (every mode = resident on CUDA with both attention backends, decode rounds under
# the sync debug mode) apart, so a slow or hung one cannot cost the others their results.
pytests pytest 75 360 tests/test_cuda_backend.py tests/test_triton_partial.py \
  tests/test_triton_wave.py tests/test_transfer_backends.py
pytests pytest_engine 60 300 tests/test_cuda_engine.py

step modes 60

# `specstream bench` on this device with the embedded pair; the script goes on if it fails
limit=$(( $(left) - 240 )); (( limit > 90 )) && limit=90
if (( limit >= 10 )); then
  echo "== specstream bench (limit ${limit}s)" | tee -a "$LOG"
  rm -f "$DIR/bench.json"
  timeout --kill-after=5 "$limit" "$PY" -m specstream bench "${BENCH_ARGS[@]}" \
    --json "$DIR/bench.json" >>"$LOG" 2>&1
  rc=$?
  "$PY" bench/gpu_check.py attach bench --out "$OUT" --file "$DIR/bench.json" --rc "$rc" \
    >>"$LOG" 2>&1
  echo "specstream bench: rc=$rc" | tee -a "$LOG"
fi

# the 8B-shaped mechanics get what is left (the step itself stops adding modes in time)
mech=$(( $(left) - 25 ))
step mechanics "$mech" --budget-s $(( mech - 15 )) "${MECH_ARGS[@]}"

"$PY" bench/gpu_check.py summary --out "$OUT" 2>&1 | tee -a "$LOG"
echo "gpu_check: done in $(( $(date +%s) - START ))s; results in $OUT, log in $LOG" | tee -a "$LOG"
