#!/usr/bin/env bash
# Every CPU figure quoted in the README, regenerated into bench/results/ (about 90 minutes on
# the 2-core CI machine; run it on an otherwise idle machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
specstream bench --json "$out/bench-cpu.json" --trace "$out/trace-specstream.json" \
    | tee "$out/bench-cpu.txt"
# the same workload with four times the output: prefill's share of the wall time falls
# (residency tail: every mode streams all history past its tail, the streaming pipeline itself)
specstream bench --modes offload-spec,specstream,parallel-spec --output-len 512 --residency tail \
    --json "$out/bench-cpu-out512.json" | tee "$out/bench-cpu-out512.txt"
for gbps in 0.5 2; do
    specstream bench --quick --link-gbps "$gbps" --json "$out/bench-quick-$gbps.json" \
        | tee "$out/bench-quick-$gbps.txt"
    specstream simulate --calibrate "$out/bench-quick-$gbps.json" \
        | tee "$out/calibrate-quick-$gbps.txt" || true
done
specstream simulate --calibrate "$out/bench-cpu.json" | tee "$out/calibrate-cpu.txt" || true
python bench/acceptance_by_context.py --update-card | tee "$out/acceptance-by-context.txt"
python bench/stream_memory.py --json "$out/stream-memory.json" | tee "$out/stream-memory.txt"
python bench/attention_micro.py --json "$out/attention-micro.json" | tee "$out/attention-micro.txt"
# link bandwidth x context with residency tail (at fill the sweep's small workloads would sit
# on the device whole and nothing would stream)
specstream bench --sweep --residency tail --json "$out/sweep.json" | tee "$out/sweep.txt"
# residency fill vs tail over the device budget, on the bench workload, link-bound (0.25 GB/s)
specstream bench --sweep-residency --link-gbps 0.25 --context-len 4096 --num-requests 8 \
    --output-len 128 --json "$out/residency-sweep.json" | tee "$out/residency-sweep.txt"
# the engine's own host work per round, at the counts of a GPU workload
python bench/host_overhead.py --json "$out/host-overhead.json" | tee "$out/host-overhead.txt"
# the ablation ladder, link-bound; speculative_policy auto against fixed chains
specstream bench --preset link-bound --ladder --json "$out/ladder-link-bound.json" \
    | tee "$out/ladder-link-bound.txt"
{
    python bench/auto_vs_fixed.py resident --repeat 3
    for args in "specstream --link-gbps 0.25 --residency tail" \
            "offload-spec --link-gbps 0.25 --residency tail" "specstream --link-gbps 1.0" \
            "offload-spec --link-gbps 1.0" "specstream --link-gbps 4.0" "offload-spec --link-gbps 4.0"; do
        # shellcheck disable=SC2086
        python bench/auto_vs_fixed.py $args
    done
} | tee "$out/auto-vs-fixed.txt"
# multi-turn chat with and without the prefix cache (auto; then fixed, for acceptance)
specstream bench --workload multiturn --json "$out/multiturn.json" | tee "$out/multiturn.txt"
specstream bench --workload multiturn --modes resident,specstream --speculative-policy fixed \
    --json "$out/multiturn-fixed.json" | tee "$out/multiturn-fixed.txt"
specstream bench --workload multiturn --modes resident --device-kv-fraction 1.0 \
    --json "$out/multiturn-resident-fits.json" | tee "$out/multiturn-resident-fits.txt"
