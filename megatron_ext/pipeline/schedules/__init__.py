"""Schedule generators by name (``names.py``): each turns (p, v, m) into a ``PipelineOrder``.

A new schedule is one generator registered here. ``get_order`` caches: an order is a pure function
of its arguments, computed once per process (the greedy ones take tens of milliseconds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron_ext.pipeline.actions import PipelineOrder
from megatron_ext.pipeline.names import canonical_schedule_name
from megatron_ext.pipeline.schedules.one_f_one_b import build_1f1b, build_interleaved_1f1b
from megatron_ext.pipeline.schedules.zero_bubble import build_interleaved_zero_bubble, build_zbh1, build_zbv
from megatron_ext.pipeline.simulate import StageCosts

GENERATORS: dict[str, Callable[..., PipelineOrder]] = {
    "1F1B": build_1f1b,
    "Interleaved1F1B": build_interleaved_1f1b,
    "ZBH1": build_zbh1,
    "InterleavedZeroBubble": build_interleaved_zero_bubble,
    "ZBVZeroBubble": build_zbv,
}


@functools.lru_cache(maxsize=64)
def get_order(name: str, pp: int, vp: int, num_microbatches: int, costs: StageCosts | None = None) -> PipelineOrder:
    """The order of schedule ``name`` for ``pp`` ranks x ``vp`` chunks and ``num_microbatches``."""
    canonical = canonical_schedule_name(name)
    if canonical not in GENERATORS:
        raise ValueError(f"no order generator for pipeline schedule {name!r}: one of {', '.join(GENERATORS)}")
    return GENERATORS[canonical](pp, vp, num_microbatches, costs=costs)
