"""Pipeline schedule names (``--pipeline-schedule``), matched case-insensitively as
torch.distributed.pipelining's ``get_schedule_class`` matches its own.

- ``1F1B`` and ``Interleaved1F1B``: megatron-core's schedules (without the flag, today's choice:
  interleaved with virtual stages, 1F1B without).
- ``ZBH1``: the zero-bubble H1 order of Qi et al. (2024) on one chunk per rank, at 1F1B's memory.
- ``InterleavedZeroBubble``: ZB-H1's idea with virtual stages (loop placement), as torch names it.
- ``ZBVZeroBubble`` and ``DualPipeV``: two chunks per rank in the V placement.
"""

from __future__ import annotations

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBH1", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MEGATRON_CORE_SCHEDULES = ("1F1B", "Interleaved1F1B")
V_PLACEMENT_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def canonical_schedule_name(name: str) -> str | None:
    """The spelling of ``SCHEDULES`` that ``name`` matches case-insensitively (dashes and
    underscores ignored), or None."""
    key = name.replace("-", "").replace("_", "").lower()
    return next((s for s in SCHEDULES if s.lower() == key), None)


def get_schedule_placement(name: str) -> str:
    """ "v" for the V-shaped schedules, "loop" otherwise (``placement.py``)."""
    return "v" if canonical_schedule_name(name) in V_PLACEMENT_SCHEDULES else "loop"


def splits_backward(name: str) -> bool:
    """The schedule runs the weight gradient (W) apart from the input gradient (B)."""
    return canonical_schedule_name(name) not in (None, *MEGATRON_CORE_SCHEDULES)
