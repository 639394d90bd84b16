#!/usr/bin/env bash
# Every CPU figure quoted in the README, regenerated into bench/results/ (about 45 minutes on
# the 2-core CI machine; run it on an otherwise idle machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
specstream bench --json "$out/bench-cpu.json" --trace "$out/trace-specstream.json" \
    | tee "$out/bench-cpu.txt"
# the same workload with four times the output: prefill's share of the wall time falls
specstream bench --modes offload-spec,specstream,parallel-spec --output-len 512 \
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
specstream bench --sweep --json "$out/sweep.json" | tee "$out/sweep.txt"
# the engine's own host work per round, at the counts of a GPU workload
python bench/host_overhead.py --json "$out/host-overhead.json" | tee "$out/host-overhead.txt"
