"""The step contract: what the scheduler hands the worker, and what the worker hands back.

Plain data only (ids, counts, block numbers, sampling parameters). Everything with device state
(tensors, generators, draft probabilities, draft caches) stays on the worker's side, keyed by
request id; the scheduler never touches a tensor and the worker never touches a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from specstream.kvcache.manager import BlockCopy
from specstream.sampling_params import SamplingParams
from specstream.spec.token_tree import DraftTree


@dataclass(frozen=True)
class SeqWork:
    """One request's share of the target forward pass of a step."""

    request_id: str
    # Input tokens: a prefill chunk, or the last sampled token followed by the drafts.
    token_ids: tuple[int, ...]
    # Absolute position of token_ids[0] (= tokens already in the cache).
    start_pos: int
    # Trailing draft tokens among token_ids (verified this step).
    num_drafts: int
    # True when token_ids are prompt tokens (a prefill chunk; a one-token prompt included).
    prefill: bool
    # Whether the step ends at the newest known token, so logits are sampled.
    sample: bool
    # Tokens read from the host tier (a multiple of the block size: everything before the
    # device window) and the device blocks of the window (the rest, new tokens included).
    # Under `fill` with prefix sharing the oldest blocks may be a shared run's device copies
    # (kvcache/shared_device.py): they lead device_blocks and host_tokens leaves them out.
    host_tokens: int
    device_blocks: tuple[int, ...]
    # The host-read history that crosses the link, as restore chunks of host block ids, oldest
    # first (the newest part of it when some is attended on the host).
    restore_chunks: tuple[tuple[int, ...], ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    # `fill`: device blocks for the newest len(promote) host-read blocks; the step copies those
    # blocks there as they pass (restored or streamed), and they join the window after it.
    promote: tuple[int, ...] = ()
    # The drafts as a token tree: the parent of each draft (-1 = the last sampled token, the
    # root), parents before children (``spec.tree.DraftTree``); empty = a chain. A tree's
    # drafts take the KV slots after the root in draft order; their positions are the root's
    # plus their depth.
    parents: tuple[int, ...] = ()
    # The oldest host-read blocks, attended on the host CPU instead of crossing the link
    # (host_attention); restore_chunks then hold only the rest.
    host_blocks: tuple[int, ...] = ()
    # Per layer, how many of host_blocks that layer attends on the host (empty: all of them
    # in every layer); a layer's others cross the link before restore_chunks (layer_chunks).
    host_layers: tuple[int, ...] = ()
    # The leading restore_chunks that other requests of the step read too (a shared prefix,
    # cut the same for all of them: sched/host_split.py); layer_chunks keeps them as they are.
    shared_chunks: int = 0
    # Logits processing (SamplingParams.processes_logits; sampling.process_logits): tokens
    # generated before the step's first sampled position, and, with a penalty, the prompt and
    # those tokens (empty otherwise).
    output_len: int = 0
    history: tuple[int, ...] = ()
    # SamplingParams.prompt_logprobs: the prompt tokens the chunk's inputs predict (input i
    # predicts the one after it), empty otherwise.
    prompt_targets: tuple[int, ...] = ()

    def layer_host_blocks(self, layer: int) -> tuple[int, ...]:
        """The blocks ``layer`` attends on the host."""
        return self.host_blocks[: self.host_layers[layer]] if self.host_layers else (
            self.host_blocks)

    def layer_link_blocks(self, layer: int) -> tuple[int, ...]:
        """The blocks of ``layer`` that cross the link, oldest first."""
        spilled = self.host_blocks[self.host_layers[layer] :] if self.host_layers else ()
        return spilled + tuple(b for c in self.restore_chunks for b in c)

    def layer_chunks(self, layer: int, per_chunk: int) -> tuple[tuple[int, ...], ...]:
        """The blocks of ``layer`` that cross the link, in chunks of ``per_chunk`` blocks
        (every chunk full but the last, as restore_chunks; a shared run's chunks first, as
        cut)."""
        if not self.host_layers or self.host_layers[layer] == len(self.host_blocks):
            return self.restore_chunks
        # a shared run's chunks as cut (the same blocks for every sharer), then the blocks this
        # layer spills from the host's share and the rest, re-cut
        k = self.shared_chunks
        rest = self.host_blocks[self.host_layers[layer] :] + tuple(
            b for c in self.restore_chunks[k:] for b in c)
        return self.restore_chunks[:k] + tuple(rest[i : i + per_chunk]
                                               for i in range(0, len(rest), per_chunk))

    @property
    def max_link_blocks(self) -> int:
        """The most blocks any one layer moves over the link."""
        extra = (len(self.host_blocks) - min(self.host_layers)) if self.host_layers else 0
        return extra + sum(len(c) for c in self.restore_chunks)

    def host_bytes(self, block_bytes: int, num_layers: int) -> int:
        """Bytes of KV the host attends for this request over all layers (``block_bytes``: a
        block of every layer)."""
        if not self.host_layers:
            return len(self.host_blocks) * block_bytes
        return sum(self.host_layers) * block_bytes // num_layers

    @property
    def is_tree(self) -> bool:
        """The drafts branch (a tree given as a chain is verified as one)."""
        return any(p != i - 1 for i, p in enumerate(self.parents))

    @property
    def tree(self) -> DraftTree:
        """The drafts as a token tree (a chain: one branch)."""
        nodes = self.token_ids[len(self.token_ids) - self.num_drafts :]
        return DraftTree(nodes, self.parents) if self.parents else DraftTree.chain(nodes)

    def positions(self) -> list[int]:
        """Absolute position of each input token: consecutive, except a tree's nodes, which
        sit at the root's position plus their depth (siblings share one)."""
        if not self.is_tree:
            return list(range(self.start_pos, self.start_pos + len(self.token_ids)))
        root = self.start_pos + len(self.token_ids) - self.num_drafts - 1
        return (list(range(self.start_pos, root + 1))
                + [root + d for d in self.tree.depths])


@dataclass(frozen=True)
class DraftWork:
    """Drafts to make for one request in this step."""

    request_id: str
    # Every token of the request known at scheduling time (prompt + output).
    token_ids: tuple[int, ...]
    # Draft tokens wanted (the request's q); with token trees, the tree's depth.
    num_tokens: int
    # Tokens the request may still generate after token_ids (max_tokens and the context
    # both counted); drafts never run past it.
    room: int
    params: SamplingParams
    # True: the request is verified in this same step, and its drafts are made right after,
    # from the tokens the verification emitted (appended to token_ids). False: it is not
    # verified in this step, and its drafts are made while the step verifies others.
    after_verify: bool
    # Token trees: children per expanded node (1 = a chain) and the tree's nodes at most
    # (None = a chain of ``count`` drafts).
    topk: int = 1
    max_nodes: int | None = None
    # Tokens of token_ids a draft model has not seen and feeds before drafting (the
    # scheduler's count; the round-shape policy reads it as part of the draft's cost).
    unseen: int = 0
    # Tokens of token_ids that are the prompt (a grammar constrains the others).
    prompt_len: int = 0

    def count(self, num_new: int) -> int:
        """Drafts to make once ``num_new`` more tokens are known (a bonus token always follows
        the drafts, so they stop one short of the room); a tree's depth at most."""
        return max(0, min(self.num_tokens, self.room - num_new - 1))


@dataclass(frozen=True)
class StepPlan:
    """Everything the worker does in one step."""

    # Target forward work: prefill chunks and verifications.
    seqs: tuple[SeqWork, ...]
    # Draft work: for requests verified in this step (after_verify) or not (while it runs).
    drafts: tuple[DraftWork, ...] = ()
    # Requests finished since the last plan: the worker drops their state (draft caches,
    # generators, draft probabilities).
    finished: tuple[str, ...] = ()
    # `restore` modes: device pool blocks lent to the step to hold two layers of its history
    # (every layer plane of each block is a slot); returned by the update.
    restore_blocks: tuple[int, ...] = ()
    # Tail blocks to copy to the host tier during the step, at low priority, as
    # (request id, ((device block, host block), ...)): planned when a decode round pushed the
    # tail past its budget; still the head of the request's device tail (attended there) until
    # the update sees them landed.
    writebacks: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    # Prefix-cache hits of requests admitted for this step: block copies (kind, source block,
    # destination block) made before anything else of the step.
    cache_copies: tuple[BlockCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Every request the step works on (forward pass or drafts), each once."""
        return tuple(dict.fromkeys([s.request_id for s in self.seqs]
                                   + [d.request_id for d in self.drafts]
                                   + [rid for rid, _ in self.writebacks]))


class TokenLogprobs(NamedTuple):
    """The target's raw log-probabilities at one position: the emitted (or prompt) token's
    and the most likely tokens' (SamplingParams.logprobs of them)."""

    token: int
    logprob: float
    rank: int  # 1 = the most likely
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


@dataclass
class StepOutput:
    """What the worker hands back for one plan."""

    # request id -> tokens the step emitted (accepted drafts + the recovered or bonus token).
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request id -> draft tokens made in this step, for its next verification.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # request id -> the parents of its drafts, where they form a token tree (see SeqWork).
    draft_parents: dict[str, list[int]] = field(default_factory=dict)
    # request id -> for each node its verified tree walk reached (the root first): how many
    # children the node had and which of them (by rank, the draft's order) the target took,
    # None for none; what the round-shape policy learns acceptance by rank from.
    tree_ranks: dict[str, list[tuple[int, int | None]]] = field(default_factory=dict)
    # request id -> why its work failed (a transfer, its drafting, the whole step).
    errors: dict[str, str] = field(default_factory=dict)
    # SamplingParams.logprobs: request id -> one entry per token of new_tokens.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: request id -> one entry per SeqWork.prompt_targets.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Timings (perf_counter seconds): step start, wall time, time blocked on the link, drafting.
    start: float = 0.0
    wall_s: float = 0.0
    wait_s: float = 0.0
    draft_s: float = 0.0
    # The round ran in this many halves a layer apart (host attention over two buckets or
    # more; see exec/round.py).
    halves: int = 1

    @classmethod
    def failed(cls, plan: StepPlan, message: str, request_id: str | None = None) -> StepOutput:
        """The output of a step that broke: every request of the plan fails (or only
        ``request_id`` when the failure belongs to it)."""
        rids = (request_id,) if request_id in plan.request_ids else plan.request_ids
        return cls(errors={rid: message for rid in rids})

    def draft_levels(self) -> int:
        """The draft forwards the step's drafts took: the deepest chain's length or tree's
        depth (one forward a level, all requests together)."""
        return max((DraftTree(tuple(d), tuple(self.draft_parents[rid])).depth
                    if rid in self.draft_parents else len(d)
                    for rid, d in self.drafts.items() if d), default=0)


Writebacks = dict[str, list[tuple[int, int]]]  # request id -> (device block, host block) pairs


def is_decode_step(plan: StepPlan, output: StepOutput) -> bool:
    """A step that verifies or drafts anything (one that only drafts, while its group has no
    drafts to verify, included); a step that only prefills is not."""
    return bool(output.drafts) or any(s.sample and not s.prefill for s in plan.seqs)


@dataclass(frozen=True)
class StepMeasures:
    """What one step measured, as the engine (or the simulator's replay) saw it: the input of
    ``policy.feedback.RoundFeedback`` and of the round records. Seconds and bytes."""

    wall_s: float  # the whole step
    wait_s: float  # blocked on the link (history not yet landed)
    draft_s: float  # drafting inside the step
    link_busy_s: float  # the link busy (both directions, overlaps merged)
    link_bytes: int  # bytes it moved
    history_bytes: int  # host-to-device bytes of history (restored or streamed)
    prefill_tokens: int  # prompt tokens the step prefilled
    decode: bool  # ``is_decode_step``
    host_attends: bool = False  # host attention is on for this engine
    host_bytes: int = 0  # cold history the host attended (all layers)
    host_busy_s: float = 0.0  # the host workers' time on it
    host_wait_s: float = 0.0  # time the round waited for the host's partials
    host_serial_s: float = 0.0  # device time of the round while the host had no job
    # each host job: (query positions per request, seconds, KV bytes)
    host_jobs: tuple[tuple[int, float, int], ...] = ()
    halves: int = 1  # StepOutput.halves

    @property
    def compute_s(self) -> float:
        """The step's time not blocked on the link."""
        return self.wall_s - self.wait_s
