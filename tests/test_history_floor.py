"""The history floor (``StepMeter.residency``): the least history a step must move given the
device budget, counted as the engine holds KV, in whole blocks, with the room the step's own
tokens are written to."""

from __future__ import annotations

from types import SimpleNamespace as NS

from specstream.engine.meter import StepMeter

BS, LAYERS, BLOCK_BYTES = 16, 2, 16 * 2 * 64  # bytes of one block, all layers


def _meter(device_blocks: int, held: dict[str, int]) -> StepMeter:
    kv = NS(seqs={rid: NS(num_tokens=n, first=0) for rid, n in held.items()},
            device=NS(num_blocks=device_blocks), shared=None,
            duplicate_blocks=lambda rids=None: 0)
    store = NS(block_size=BS, block_bytes=BLOCK_BYTES, cfg=NS(num_layers=LAYERS))
    return StepMeter(backend=None, store=store, kv=kv, host=None, stats=None, tracer=None)


def _seq(rid: str, start: int, new: int) -> NS:
    return NS(request_id=rid, start_pos=start, token_ids=(0,) * new, restore_chunks=(),
              host_blocks=(), host_layers=())


def _floor(meter: StepMeter, *seqs: NS) -> int:
    return meter.residency(NS(seqs=list(seqs), cache_copies=()))[0]


def test_part_filled_blocks_count_whole():
    # three requests of 40 tokens: 120 tokens fit in 8 blocks of 16 (128), but each takes 3
    # blocks: 9 do not fit in 8, and the one that does not is history
    meter = _meter(8, {"a": 40, "b": 40, "c": 40})
    assert _floor(meter, *(_seq(r, 40, 1) for r in "abc")) == BLOCK_BYTES
    # with room for all 9 blocks, nothing has to move
    assert _floor(_meter(9, {"a": 40, "b": 40, "c": 40}), *(_seq(r, 40, 1) for r in "abc")) == 0


def test_the_steps_new_tokens_take_room_first():
    # two decoding requests hold 6 blocks; a prompt's 48-token chunk (3 blocks, none held
    # yet) is written to the device this step: 9 blocks in 8, one block of history moves
    meter = _meter(8, {"a": 40, "b": 40, "p": 0})
    assert _floor(meter, _seq("a", 40, 1), _seq("b", 40, 1), _seq("p", 0, 48)) == BLOCK_BYTES
    # a round whose drafts spill into a new block: 3 x 4 blocks after the step in 10
    meter = _meter(10, {"a": 40, "b": 40, "c": 40})
    floor = _floor(meter, *(_seq(r, 40, 9) for r in "abc"))
    assert floor == 2 * BLOCK_BYTES  # 2 of the 9 blocks of history


def test_a_request_not_in_the_step_takes_its_share_of_what_does_not_fit():
    # 4 requests of 3 blocks in 10 blocks: 2 of 12 blocks of history leave, a sixth of each
    # request's; a step of 3 of them moves a sixth of their 9, a block and a half's bytes
    meter = _meter(10, {"a": 40, "b": 40, "c": 40, "d": 40})
    assert _floor(meter, *(_seq(r, 40, 1) for r in "abc")) == 3 * BLOCK_BYTES // 2
    assert _floor(meter, *(_seq(r, 40, 1) for r in "abcd")) == 2 * BLOCK_BYTES


def test_two_groups_floors_add_up_to_what_does_not_fit():
    # 4 requests of 3 blocks in 9: 3 blocks cannot be resident, and the two groups' rounds
    # of a period move them between them. Each round's floor is half of them, not rounded to
    # a whole block: rounded down, the two floors made 2, which no split of 3 reaches.
    meter = _meter(9, {"a": 40, "b": 40, "c": 40, "d": 40})
    halves = [_floor(meter, *(_seq(r, 40, 1) for r in group)) for group in ("ab", "cd")]
    assert halves == [3 * BLOCK_BYTES // 2] * 2 and sum(halves) == 3 * BLOCK_BYTES
