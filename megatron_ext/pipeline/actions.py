"""A pipeline schedule as data: per pipeline rank, the ordered compute actions it runs in one step.

An action is ``F`` (forward), ``B`` (input gradient), ``W`` (weight gradient) or ``BW`` (the whole
backward, for schedules that do not split it) of one (stage, micro-batch). Communication is not in
the lists: every F of a stage that is not the last sends its output to stage s+1, every B / BW of a
stage that is not the first sends its input gradient to stage s-1, and whether that is a P2P message
or a local hand-over follows from the placement (``placement.py``). The runtime derives the messages
(``p2p.py``), so a new schedule is only its compute order and no schedule can get its sends wrong.

Invariants of a valid order (``simulate.check_order``): every (stage, micro-batch) has one F and
either one BW or one B and one W, all on the stage's rank; per stage, F, B / BW and W each run in
micro-batch order (the data iterators are sequential, and gradients then accumulate in 1F1B's order).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megatron_ext.pipeline.placement import get_stage_index, get_stage_location

F, B, W, BW = "F", "B", "W", "BW"
KINDS = (F, B, W, BW)


class Action(NamedTuple):
    """One compute action: ``kind`` of micro-batch ``mb`` on global stage ``stage``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclasses.dataclass(frozen=True)
class PipelineOrder:
    """A schedule for one step: ``ranks[r]`` is pipeline rank r's action list.

    ``pp`` ranks x ``vp`` chunks per rank = ``num_stages`` stages, placed by ``placement`` ("loop" or
    "v"); ``num_microbatches`` micro-batches; ``name`` is the schedule that generated it."""

    name: str
    pp: int
    vp: int
    num_microbatches: int
    placement: str
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    @property
    def splits_backward(self) -> bool:
        return any(a.kind == W for actions in self.ranks for a in actions)

    def rank_of(self, stage: int) -> int:
        return get_stage_location(stage, self.pp, self.vp, self.placement)[0]

    def chunk_of(self, stage: int) -> int:
        return get_stage_location(stage, self.pp, self.vp, self.placement)[1]

    def stage_of(self, pp_rank: int, chunk: int) -> int:
        return get_stage_index(pp_rank, chunk, self.pp, self.vp, self.placement)

    def forward_only(self) -> PipelineOrder:
        """The same order with the backward actions dropped (evaluation). Deadlock-free whenever the
        full order is: a forward waits only for forwards, in an order the full one already keeps."""
        ranks = tuple(tuple(a for a in actions if a.kind == F) for actions in self.ranks)
        return dataclasses.replace(self, name=f"{self.name} (forward only)", ranks=ranks)

    def format(self) -> str:
        """One line per rank, e.g. ``rank 0: F0.0 F0.1 B0.0 W0.0 ...`` (for error messages)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks))
