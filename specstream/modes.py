"""The engine modes as a small registry: where KV lives and how rounds are scheduled. Modes
differ only in schedule, never in output."""

from __future__ import annotations

from dataclasses import dataclass

from specstream.options import Drafting, History, Mode


@dataclass(frozen=True)
class ModeSpec:
    """What one engine mode does; modes differ only in schedule, never in output."""

    name: Mode
    # True: history past offload_after_tokens lives in the host tier.
    offload: bool
    # How host history reaches attention: not at all, whole layers restored (then attention;
    # the next layer prefetched meanwhile), or chunks attended as they land.
    history: History
    # Whether rounds verify draft tokens.
    speculative: bool
    # Devices the mode occupies (parallel-spec drafts on a second one).
    devices: int = 1
    # Where drafting runs: after verification, in the link's gaps (specstream), or on a
    # second device.
    drafting: Drafting = Drafting.SEQUENTIAL
    # True: the mode is defined by verifying drafts, so it refuses to run without a proposer
    # (without one it would silently be `offload` or `stream`).
    needs_drafts: bool = False

    @property
    def two_groups(self) -> bool:
        """Requests form two groups that alternate: one verifies while the other drafts (in
        the link's gaps, or on the second device)."""
        return self.drafting is not Drafting.SEQUENTIAL


MODES: dict[str, ModeSpec] = {
    m.name: m
    for m in (
        ModeSpec(Mode.RESIDENT, offload=False, history=History.NONE, speculative=True),
        ModeSpec(Mode.OFFLOAD, offload=True, history=History.RESTORE, speculative=False),
        ModeSpec(Mode.STREAM, offload=True, history=History.STREAM, speculative=False),
        ModeSpec(Mode.OFFLOAD_SPEC, offload=True, history=History.RESTORE, speculative=True,
                 needs_drafts=True),
        ModeSpec(Mode.SPECSTREAM, offload=True, history=History.STREAM, speculative=True,
                 drafting=Drafting.GAPS, needs_drafts=True),
        ModeSpec(Mode.PARALLEL_SPEC, offload=True, history=History.RESTORE, speculative=True,
                 devices=2, drafting=Drafting.PARALLEL, needs_drafts=True),
    )
}
