"""The pipeline room's pure pieces: stage placement and the deferred weight-gradient queue."""

import pytest
import torch

from megatron_ext.pipeline.placement import get_rank_stages, get_stage_index, get_stage_location
from megatron_ext.pipeline.wgrad_queue import WeightGradQueue


@pytest.mark.parametrize("placement,pp,vp", [("loop", 4, 1), ("loop", 4, 2), ("loop", 2, 3), ("v", 4, 2), ("v", 2, 2)])
def test_every_stage_has_one_place_and_back(placement, pp, vp):
    places = [get_stage_location(s, pp, vp, placement) for s in range(pp * vp)]
    assert len(set(places)) == pp * vp
    for s, (rank, chunk) in enumerate(places):
        assert get_stage_index(rank, chunk, pp, vp, placement) == s


def test_v_placement_puts_first_and_last_stage_on_rank_0():
    assert get_rank_stages(0, 4, 2, "v") == [0, 7]
    assert get_rank_stages(3, 4, 2, "v") == [3, 4]  # the turn is local to the last rank
    assert get_rank_stages(1, 4, 2, "loop") == [1, 5]  # megatron-core's interleaving


def test_v_placement_needs_two_chunks():
    with pytest.raises(ValueError, match="exactly 2"):
        get_stage_location(0, 4, 3, "v")


def test_deferred_weight_gradient_equals_the_direct_one():
    """A W deferred through the queue gives the gradient a direct backward gives, and only after
    ``run``."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 3), torch.randn(4, 3)
    grad_out = torch.randn(5, 4)
    direct = grad_out.t() @ x
    main_grad = torch.zeros_like(w)
    queue = WeightGradQueue()

    def backward_of_linear():  # what a layer does in its backward
        def wgrad():
            main_grad.add_(grad_out.t() @ x)

        if not queue.defer(wgrad):
            wgrad()

    with queue.capture(("chunk0", 0)):
        backward_of_linear()
    assert queue.pending() == 1 and main_grad.abs().sum() == 0
    assert queue.run(("chunk0", 0)) == 1
    assert torch.equal(main_grad, direct) and queue.pending() == 0
    backward_of_linear()  # outside a capture: runs at once
    assert torch.equal(main_grad, 2 * direct)


def test_queue_refuses_misuse():
    queue = WeightGradQueue()
    with queue.capture("a"):
        with pytest.raises(RuntimeError, match="inside the capture"):
            with queue.capture("b"):
                pass
        with pytest.raises(RuntimeError, match="inside its own capture"):
            queue.run("a")
    with pytest.raises(RuntimeError, match="captured twice"):
        with queue.capture("a"):
            pass
    with pytest.raises(RuntimeError, match="no W captured"):
        queue.run("zzz")
    order = []
    with queue.capture("c"):
        queue.defer(lambda: order.append(1))
        queue.defer(lambda: order.append(2))
    queue.run("a"), queue.run("c")
    assert order == [1, 2] and queue.pending() == 0


def test_schedule_names_match_case_insensitively():
    from megatron_ext.pipeline.names import canonical_schedule_name, get_schedule_placement, splits_backward

    assert canonical_schedule_name("zbvzerobubble") == "ZBVZeroBubble"
    assert canonical_schedule_name("interleaved-1f1b") == "Interleaved1F1B"
    assert canonical_schedule_name("gpipe") is None
    assert get_schedule_placement("ZBVZeroBubble") == "v" and get_schedule_placement("zbh1") == "loop"
    assert splits_backward("ZBH1") and not splits_backward("1F1B")
