"""How much of a round's cold history the host attends (``host_attention="auto"``).

Two paths read a round's cold history at once: the link streams its share to the device, and
the host's workers attend the rest where it lives. The round takes the longer of the two:

    link:  (cold bytes - host bytes) / link rate
    host:  serial + sum over requests of host bytes x seconds per byte (query positions)

``serial`` is the device time of the round during which the host can have nothing to do (a
layer's queries come only after its projection; the layer's MLP waits for the host's
partials), and the host's time per byte grows with a request's query positions (a decode
round's few positions read memory; a prefill chunk's or a large tree's compute). The best
split makes both paths finish together; the host takes the cheapest bytes first (the requests
with the fewest query positions). Pure Python: the scheduler calls ``split_for_host`` for
every step, the round-shape cost model ``policy.round_shape.transfer_s`` for every candidate
shape, so the tree size and the split are chosen together.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_for_host(blocks: Sequence[int], seconds_per_byte: Sequence[float], block_bytes: int,
                   link_bps: float, serial_s: float) -> list[float]:
    """Per request, how many of its ``blocks`` cold blocks the host attends (the oldest; a
    fraction of a block: the layers take whole blocks in turn, ``by_layer``), so that the
    link and the host finish together. ``seconds_per_byte``: the host's cost for each
    request's query positions."""
    counts = [0.0] * len(blocks)
    link_s = sum(blocks) * block_bytes / link_bps
    host_s = serial_s
    for i in sorted(range(len(blocks)), key=lambda i: seconds_per_byte[i]):
        # moving one block to the host: the host takes its time, the link saves its own
        per_block = block_bytes * (seconds_per_byte[i] + 1 / link_bps)
        k = min(blocks[i], max(0.0, (link_s - host_s) / per_block))
        counts[i] = k
        link_s -= k * block_bytes / link_bps
        host_s += k * block_bytes * seconds_per_byte[i]
        if k < blocks[i]:
            break
    return counts


def by_layer(blocks: float, num_layers: int) -> tuple[int, ...]:
    """Whole blocks per layer that add up to ``blocks`` x ``num_layers`` (rounded): a share
    between two block counts alternates between them from layer to layer."""
    return tuple(round((layer + 1) * blocks) - round(layer * blocks)
                 for layer in range(num_layers))
