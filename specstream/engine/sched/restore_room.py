"""The `restore` modes' room: pool blocks a step borrows to hold its restored history.

Every layer plane of a lent pool block is a slot for one block of one layer's history, so two
layers of ``n`` blocks of history (the layer attended and the next one, prefetched) take
``ceil(2n / layers)`` pool blocks. That is what a step borrows where the pool can spare it;
where it cannot, the step borrows less and restores each layer in pieces (exec/restore.py),
down to the budget's guaranteed room (``RuntimeLayout.restore_room_blocks``: the pool blocks a
staging ring would take on the same budget, at least one). Admission reserves the history's
two layers, shared among the admitted requests, but never more than that guaranteed room: a
request a streaming mode admits on the budget is admitted here too.

Only history that crosses the link needs room: blocks the host attends (a fixed
``host_attention_fraction``; under ``auto`` the share varies, so the step's own split counts)
do not. Pure Python, as the rest of the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RestoreRoom:
    # The target's layers (slots per lent pool block).
    layers: int
    # Pool blocks the budget guarantees the step's restores (pieces fit in it).
    guaranteed: int
    # The host's fixed share of every request's cold blocks (0: none, or varying under auto).
    host_fraction: float = 0.0

    def link_blocks(self, cold: int) -> int:
        """Of ``cold`` cold blocks of a request, the most one layer moves over the link (the
        host's fixed share taken off as ``host_split.by_layer`` spreads it: every layer takes
        at least its floor)."""
        return cold - math.floor(self.host_fraction * cold)

    def whole(self, history: int) -> int:
        """Pool blocks that hold two layers of ``history`` link-carried blocks."""
        return -(-2 * history // self.layers)

    def reserved(self, wanted: int) -> int:
        """What admission holds for restores that want ``wanted`` pool blocks in all: as many,
        up to the guaranteed room (beyond it, layers come in pieces)."""
        return min(wanted, self.guaranteed)

    def lend(self, history: int, spare: int) -> int:
        """Pool blocks a step with ``history`` link-carried blocks per layer borrows: two whole
        layers where ``spare`` blocks hold them, else what is spare, never less than the
        guaranteed room (admission kept it free)."""
        want = self.whole(history)
        return min(want, max(spare, self.guaranteed)) if history else 0
