"""The host attention table of docs/simulator.md (``specstream simulate --host-attention-table``).

One server (H200, PCIe 5, Qwen3-8B + Qwen3-0.6B, 32K contexts) with 1, 2, 4 and 8 GPUs behind
one host, the ladder's adaptive-chain and tree steps (shape chosen together with the split,
``ladder.run_step``), with host attention off and auto: tokens/s and the split. Roofline only;
the host figures are the assumptions of ``hardware.DDR5_HOST``, untested on a GPU server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specstream.sim.api import Scenario
from specstream.sim.hardware import GB, TB, HardwareProfile, get_hardware
from specstream.sim.host import flop_per_byte
from specstream.sim.ladder import LADDER, LadderStep, ladder_concurrency, run_step, shape_label

STEPS: tuple[LadderStep, ...] = (LADDER[3], LADDER[4])  # adaptive chain, trees (both auto)


def host_rows(hw: HardwareProfile, target: str = "Qwen3-8B", draft: str = "Qwen3-0.6B",
              context: int = 32768, alpha: float = 0.75, gpus: Sequence[int] = (1, 2, 4, 8),
              limit: int = 32) -> list[str]:
    """Markdown rows: per GPUs per host, per step, host attention off then auto."""
    rows = []
    for g in gpus:
        base = Scenario.from_names(replace(hw, gpus_per_host=g), target, draft, (context,),
                                   limit, alpha)
        n = ladder_concurrency(base, limit)
        contexts = [float(context)] * n
        for step in STEPS:
            off_rate = 0.0
            for host in ("off", "auto"):
                sc = replace(base, policy=replace(base.policy, host_attention=host))
                r = run_step(sc, step, contexts, alpha)
                x = r.result
                off_rate = off_rate or x.tokens_per_s
                kind = "trees" if step.topk > 1 else "chains"
                rate = f"{x.host_rate / GB:.0f}" if x.host_share else "-"
                rows.append(
                    f"| {g} | {kind} | {host} | {shape_label(r.shape)} | {n} | {rate} "
                    f"| {x.host_share:.2f} | {x.period_s * 1e3:.1f} | {x.link_s * 1e3:.1f} "
                    f"| {x.host_s * 1e3:.1f} | {x.tokens_per_s:.0f} "
                    f"| {x.tokens_per_s / off_rate:.2f}x |")
    return rows


def host_table(isa: str = "avx512", context: int = 32768) -> str:
    """The table, the host's assumptions first."""
    hw = get_hardware("H200", 5, host_isa=isa)
    sc = Scenario.from_names(hw, "Qwen3-8B", "Qwen3-0.6B", (context,))
    fpb = flop_per_byte(sc.costs)
    head = (
        f"H200 PCIe 5 ({hw.link_bw / GB:.0f} GB/s link per GPU), Qwen3-8B + Qwen3-0.6B, "
        f"{context} tokens, alpha 0.75, residency {sc.policy.residency}; roofline, untested "
        "on a GPU server.\n"
        f"Host (assumed): {hw.host_bytes_per_s / GB:.0f} GB/s sustained memory bandwidth "
        f"(2 x 8 channels DDR5-4800), {hw.host_flops / TB:.0f} TFLOP/s attention with {isa} "
        f"(AVX-512 {hw.host_avx512_flops / TB:.0f}, AMX {hw.host_amx_flops / TB:.0f}); "
        "bandwidth and cores shared equally by the GPUs of the host, each GPU's DMA reads "
        f"drawn from the same bandwidth; {fpb:.0f} FLOP per KV byte per query position "
        "(GQA 32:8, bf16 KV).\n"
        "host rate per GPU = min(host bw / GPUs - link, host FLOP/s / GPUs / "
        f"({fpb:.0f} x query positions)); share = host / (link + host).\n\n"
        "| GPUs/host | shapes | host | shape chosen | requests | host GB/s | host share "
        "| round ms | link ms | host ms | tok/s | vs off |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *host_rows(hw, context=context)])
