"""``planning/memory.get_activation_peak`` on a hand-made zero-bubble order, against its peak worked by
hand: stage 0's B does nothing (nothing waits for its input gradient; the runtime runs its whole
backward in W), so stage 0 holds its activations until its W and never holds what a W keeps; other
stages free at B and hold what their W keeps until W. The generated orders run stage 0's W right
after its B, where both readings agree; this order runs a forward between them.
"""

from __future__ import annotations

from megatron_ext.pipeline.actions import Action, PipelineOrder
from megatron_ext.pipeline.simulate import check_order
from megatron_ext.planning.memory import StageBytes, get_activation_peak


def _actions(text: str) -> tuple[Action, ...]:
    return tuple(Action(a[0], int(a[1]), int(a[3])) for a in text.split())


ORDER = PipelineOrder(
    "hand-made",
    2,
    1,
    4,
    "loop",
    (
        _actions("F0.0 F0.1 B0.0 F0.2 W0.0 B0.1 W0.1 F0.3 B0.2 W0.2 B0.3 W0.3"),
        _actions("F1.0 B1.0 W1.0 F1.1 F1.2 B1.1 W1.1 B1.2 F1.3 W1.2 B1.3 W1.3"),
    ),
)
# per micro-batch: saved (F to backward), held for W (B to W), extra while a backward runs
BYTES = StageBytes(saved=[10.0, 7.0], held_for_w=[4.0, 3.0], backward_extra=[1.5, 0.5])


def test_the_hand_made_order_is_valid():
    assert check_order(ORDER) == []


def test_stage_0_holds_its_activations_until_its_w():
    # F0.0 F0.1 -> 20; B0.0 frees nothing; F0.2 -> 30; W0.0 runs the backward on top: 31.5, then 20
    assert get_activation_peak(ORDER, 0, BYTES) == 31.5


def test_other_stages_free_at_b_and_hold_what_w_keeps():
    # F1.0 7; B1.0 at 7 + 0.5, then 3; W1.0 0; F1.1 F1.2 14; B1.1 at 14.5, then 10; W1.1 7;
    # B1.2 at 7.5, then 3; F1.3 10; W1.2 7; B1.3 at 7.5, then 3; W1.3 0
    assert get_activation_peak(ORDER, 1, BYTES) == 14.5
