"""Schedules as action lists: every generated order is valid (each F/B/W once on its stage's rank, per-stage
micro-batch order, no deadlock under the runtime's blocking receives), within 1F1B's memory, and its
simulated bubble is the one the literature derives for it; the checker catches each kind of broken order."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.pipeline.actions import BW, Action, B, F, PipelineOrder, W
from megatron_ext.pipeline.p2p import ACTIVATION, GRADIENT, build_p2p_plan, get_output_message
from megatron_ext.pipeline.schedules import GENERATORS, get_order
from megatron_ext.pipeline.schedules.zero_bubble import build_v_order, get_memory_limit
from megatron_ext.pipeline.simulate import (
    ScheduleDeadlock,
    StageCosts,
    check_order,
    get_in_flight_peak,
    simulate_order,
)

GRID = [(p, m) for p in (2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 8, 9, 12)] + [(8, 8), (8, 16), (8, 12)]
ZB = ("ZBH1", "InterleavedZeroBubble", "ZBVZeroBubble")


def _vps(name: str) -> tuple[int, ...]:
    return {"1F1B": (1,), "ZBH1": (1,), "ZBVZeroBubble": (2,)}.get(name, (2, 3))


def _cases():
    for name in GENERATORS:
        for p, m in GRID:
            for v in _vps(name):
                if v > 1 and m < p:  # interleaved and V schedules need m >= p (validate.py refuses less)
                    continue
                if name == "Interleaved1F1B" and m % p:  # megatron-core's rule for its own schedule
                    continue
                yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_every_generated_order_is_valid_and_within_its_memory(name, p, m, v):
    order = get_order(name, p, v, m)
    assert (order.pp, order.vp, order.num_microbatches) == (p, v, m)
    limit = get_memory_limit(p) if name in ZB else None
    assert check_order(order, limit) == []
    if name in ZB:  # never worse than 1F1B in the model
        costs, ref_costs = StageCosts.uniform(p * v, 1 / v, 1 / v, 1 / v, True), StageCosts.uniform(p, 1, 1, 1)
        ref = get_order("1F1B", p, 1, m)
        assert simulate_order(order, costs).makespan <= simulate_order(ref, ref_costs).makespan + 1e-9


def _bubble(name: str, p: int, v: int, m: int, t_w: float) -> float:
    order = get_order(name, p, v, m)
    costs = StageCosts.uniform(p * v, 1 / v, 1 / v, t_w / v, first_stage_backward_in_w=True)
    return simulate_order(order, costs).bubble(costs.ideal(order))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (2, 4), (8, 16)])
def test_bubbles_are_the_literature_s(p, m):
    # 1F1B and interleaved: (p-1)/(m v) of the ideal step; ZB-H1: (p-1)(t_F + t_B - t_W) of bubble
    # against m (t_F + t_B + t_W) of compute (Qi et al. 2024, section 3)
    assert _bubble("1F1B", p, 1, m, 1.0) == pytest.approx((p - 1) / m)
    assert _bubble("Interleaved1F1B", p, 2, m, 1.0) == pytest.approx((p - 1) / (2 * m))
    for t_w in (1.0, 0.5):
        assert _bubble("ZBH1", p, 1, m, t_w) == pytest.approx((p - 1) * (2 - t_w) / (m * (2 + t_w)))
    # the V order: better than the loop placement's and than ZB-H1's
    assert _bubble("ZBVZeroBubble", p, 2, m, 1.0) <= _bubble("InterleavedZeroBubble", p, 2, m, 1.0) + 1e-9
    assert _bubble("ZBVZeroBubble", p, 2, m, 1.0) < _bubble("ZBH1", p, 1, m, 1.0)


def test_zbv_bubble_at_the_target_configurations():
    # hop-0 bubbles of torch 2.13's ScheduleZBVZeroBubble order at PP 4 (computed with this model,
    # stage 0's backward in W): ours must be no larger
    torch_zbv = {(8, 1.0): 0.0625, (8, 0.5): 0.075, (16, 1.0): 0.03125, (16, 0.5): 0.0375}
    for (m, t_w), bubble in torch_zbv.items():
        assert _bubble("ZBVZeroBubble", 4, 2, m, t_w) <= bubble + 1e-9


def test_zb_orders_hold_1f1b_s_peak_and_1f1b_holds_p_minus_r():
    for r in range(4):
        assert get_in_flight_peak(get_order("1F1B", 4, 1, 8), r) == 4 - r
        for name, v in (("ZBH1", 1), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)):
            assert get_in_flight_peak(get_order(name, 4, v, 16), r) <= 4


def test_v_order_places_and_hands_over():
    order = build_v_order(4, 8)
    assert [order.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert order.ranks[0][0] == Action(F, 0, 0) and Action(F, 7, 0) in order.ranks[0]
    plan = build_p2p_plan(order, 3)
    assert plan.local == {(ACTIVATION, 4, mb) for mb in range(8)} | {(GRADIENT, 3, mb) for mb in range(8)}
    assert build_p2p_plan(order, 0).local == frozenset()


@pytest.mark.parametrize("name,v", [("ZBH1", 1), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("1F1B", 1)])
def test_p2p_channels_carry_each_message_once_in_the_sender_s_order(name, v):
    order = get_order(name, 4, v, 8)
    sent = {}
    for src, actions in enumerate(order.ranks):
        for a in actions:
            msg = get_output_message(order, a)
            if msg is not None:
                sent.setdefault((src, order.rank_of(msg[1])), []).append(msg)
    for dst in range(4):
        plan = build_p2p_plan(order, dst)
        for src, msgs in plan.incoming.items():
            assert list(msgs) == sent[(src, dst)]
            assert src in ((dst + 1) % 4, (dst - 1) % 4)  # megatron-core's next or previous rank


def test_forward_only_order_keeps_the_forwards_in_order():
    order = get_order("ZBVZeroBubble", 4, 2, 8)
    fwd = order.forward_only()
    assert all(a.kind == F for actions in fwd.ranks for a in actions)
    assert [a for a in order.ranks[1] if a.kind == F] == list(fwd.ranks[1])
    simulate_order(fwd, StageCosts.uniform(8, 1, 1, 1))  # no deadlock


# ---- the checker catches broken orders ----


def _edit(order: PipelineOrder, rank: int, actions: list[Action]) -> PipelineOrder:
    return dataclasses.replace(order, ranks=order.ranks[:rank] + (tuple(actions),) + order.ranks[rank + 1 :])


def test_checker_reports_missing_duplicate_and_misplaced_actions():
    order = get_order("ZBH1", 2, 1, 4)
    acts = list(order.ranks[1])
    assert any("needs F and BW, or F, B and W" in p for p in check_order(_edit(order, 1, acts[:-1])))
    assert any("appears twice" in p for p in check_order(_edit(order, 1, acts + [acts[0]])))
    assert any("belongs to rank 0" in p for p in check_order(_edit(order, 1, acts + [Action(F, 0, 0)])))
    assert any("not an action" in p for p in check_order(_edit(order, 1, acts + [Action(F, 1, 9)])))


def test_checker_reports_order_violations_and_deadlocks():
    order = get_order("ZBH1", 2, 1, 4)
    acts = list(order.ranks[1])  # the last stage: F0 B0 W0 F1 B1 ...
    swapped = [a for a in acts if a != Action(W, 1, 0)]
    swapped.insert(swapped.index(Action(B, 1, 0)), Action(W, 1, 0))  # W before its B
    assert any("comes before" in p for p in check_order(_edit(order, 1, swapped)))
    f = [a for a in acts if a.kind == F]
    out_of_order = [f[1] if a == f[0] else f[0] if a == f[1] else a for a in acts]
    assert any("out of micro-batch order" in p for p in check_order(_edit(order, 1, out_of_order)))
    # rank 0 waits for mb 0's backward before forwarding mb 1, rank 1 for mb 1's forward before
    # running mb 0's backward: each waits for the other
    cyclic = PipelineOrder(
        "cyclic",
        2,
        1,
        2,
        "loop",
        (
            (Action(F, 0, 0), Action(BW, 0, 0), Action(F, 0, 1), Action(BW, 0, 1)),
            (Action(F, 1, 0), Action(F, 1, 1), Action(BW, 1, 0), Action(BW, 1, 1)),
        ),
    )
    assert any("deadlock" in p for p in check_order(cyclic))
    with pytest.raises(ScheduleDeadlock):
        simulate_order(cyclic, StageCosts.uniform(2, 1, 1, 1))


def test_checker_reports_memory_over_the_limit():
    order = get_order("Interleaved1F1B", 4, 2, 8)
    assert check_order(order) == []
    assert any("in flight, limit 4" in p for p in check_order(order, memory_limit=4))


def test_costs_put_stage_0_s_backward_in_w_as_torch_does():
    c = StageCosts.uniform(4, 1.0, 1.0, 0.5, first_stage_backward_in_w=True)
    assert (c.cost(B, 0), c.cost(W, 0), c.cost(B, 1), c.cost(W, 1), c.cost(BW, 0)) == (0.0, 1.5, 1.0, 0.5, 1.5)
