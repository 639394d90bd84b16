"""What the engine's options default to where not given, and the machine facts they resolve
against (the device, the host's spare cores)."""

from __future__ import annotations

import os

GiB = 1 << 30
# Draft tokens per round when a proposer is given without a number (the reference
# implementation's middle choice of {1, 2, 4, 6, 8}).
DEFAULT_SPECULATIVE_TOKENS = 4
# Most nodes of one request's token tree per round (Sequoia and SpecExec size trees for
# offloaded inference up to a few hundred at batch 1; batched, 64 query positions a request is
# already far past what a round's verification compute hides behind the link).
MAX_TREE_NODES = 64
# speculative_policy auto without explicit limits: chains up to AUTO_MAX_DEPTH deep and, with a
# draft model, trees of up to DEFAULT_TREE_TOPK children per node and DEFAULT_TREE_NODES nodes
# (the link-bound ladder's tree step; the policy picks per round, chains and no speculation
# included, so limits only bound the choice).
AUTO_MAX_DEPTH = 8
DEFAULT_TREE_TOPK = 4
DEFAULT_TREE_NODES = 32
# The device KV budget on the cpu backend without device_kv_bytes: an emulated device the size
# of one long request's share of a GPU's KV memory on the embedded pair (about 5,400 tokens of
# the embedded target in fp32; staging takes at most half), so the main job offloads and stays
# small in memory.
CPU_DEVICE_KV_BYTES = 32 << 20


def default_offload_after(max_model_len: int) -> int:
    """The offload threshold for a model whose context is ``max_model_len`` tokens: the
    reference implementation offloads past 8192 tokens, set for 32K contexts (a quarter of
    them); a model with a shorter context offloads past a quarter of its own, so its long
    requests still exercise offloading (2048 tokens for the embedded 8K-context pair)."""
    return max(1, min(8192, max_model_len // 4))


def spare_host_cores(device: str = "cpu") -> int:
    """Cores of this process the engine's own threads leave free while a round waits on the
    link: the link's copy thread always, and on a CUDA device the driver thread that launches
    the round. On the cpu backend the compute threads emulate the device and sit idle while
    the round waits on the link (the emulated transfer): those waits are what host attention
    fills, so they do not count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(0, cores - (2 if device == "cuda" else 1))


def detect_device() -> str:
    """``device="auto"``: "cuda" when this torch sees a CUDA device, else "cpu"."""
    import torch  # here, not at import: the scheduler and its tests stay torch-free

    return "cuda" if torch.cuda.is_available() else "cpu"
