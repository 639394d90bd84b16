"""Round floors are a property of the work, not of the schedule, and they can be missed."""

from __future__ import annotations

import pytest

from specstream.bench.floors import ComputeModel, add_floors

# seconds: 1 ms a round, 0.1 ms a request, 10 us a query token, 1 us a context token, 10 ns a
# query-key pair, 20 us a prefill token; 0.5 ms a drafting request, 0.2 ms a draft token
TRUE = dict(one=1e-3, num_seqs=1e-4, query_tokens=1e-5, context_tokens=1e-6,
            attention_pairs=1e-8, prefill_tokens=2e-5, draft_seqs=5e-4, draft_tokens=2e-4)


def _round(seqs: int, ctx: int, drafts: int, prefill: int = 0, link_floor: float = 0.0,
           wall: float | None = None) -> dict[str, float]:
    r = dict(num_seqs=seqs, query_tokens=seqs * 5 + prefill, context_tokens=ctx,
             attention_pairs=5 * ctx + prefill * (prefill + 100), prefill_tokens=prefill,
             draft_seqs=seqs if drafts else 0, draft_tokens=drafts, link_floor_s=link_floor)
    work = TRUE["one"] + sum(TRUE[k] * r[k] for k in TRUE if k != "one")
    r["wall_s"] = work if wall is None else wall
    return r


def _resident_rounds() -> list[dict[str, float]]:
    return [_round(s, c, d, p) for s in (1, 2, 3) for c in (500, 2000, 6000) for d in (0, 4, 12)
            for p in (0, 256)]


def test_fit_recovers_the_cost_of_the_work() -> None:
    model = ComputeModel.fit(_resident_rounds())
    assert model.fit_error < 1e-6
    r = _round(4, 9000, 16)  # outside the fitted range: linear extrapolation
    verify, draft = model.parts(r)
    assert verify + draft == pytest.approx(r["wall_s"], rel=1e-6)
    assert draft == pytest.approx(4 * 5e-4 + 16 * 2e-4, rel=1e-6)


def test_the_floor_does_not_depend_on_the_schedule() -> None:
    """Two rounds of the same work, one with link and compute serial (a restore-then-verify
    schedule), one overlapped: same floor, and only the serial one misses it."""
    model = ComputeModel.fit(_resident_rounds())
    link = 0.05
    work = _round(2, 4000, 8)["wall_s"]
    serial = _round(2, 4000, 8, link_floor=link, wall=link + work)
    overlapped = _round(2, 4000, 8, link_floor=link, wall=max(link, work) * 1.01)
    results = {"serial": {"rounds": [serial]}, "overlapped": {"rounds": [overlapped]}}
    add_floors(results, model)
    assert results["serial"]["floor_s"] == pytest.approx(results["overlapped"]["floor_s"])
    assert results["serial"]["round_time_over_floor"] == pytest.approx((link + work) / link)
    assert results["overlapped"]["round_time_over_floor"] == pytest.approx(1.01)


def test_drafting_on_a_second_device_overlaps_in_the_floor() -> None:
    model = ComputeModel.fit(_resident_rounds())
    r = _round(2, 4000, 40)
    verify, draft = model.parts(r)
    one = {"a": {"rounds": [dict(r)]}, "b": {"rounds": [dict(r)], "drafting": "parallel"}}
    add_floors(one, model)
    assert one["a"]["floor_s"] == pytest.approx(verify + draft)
    assert one["b"]["floor_s"] == pytest.approx(max(verify, draft))


def test_too_few_resident_rounds_is_an_error() -> None:
    with pytest.raises(ValueError, match="too few"):
        ComputeModel.fit(_resident_rounds()[:3])
