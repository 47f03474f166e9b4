"""Pipeline stages on ranks: pure functions, no process group.

A pipeline of ``p`` ranks with ``v`` model chunks per rank has ``p x v`` stages, run in order
0 .. pv-1 by every micro-batch's forward (and in reverse by its backward). Two placements:

- ``loop`` (megatron-core's, 1F1B and interleaved): stage ``s`` sits on rank ``s % p`` as local
  chunk ``s // p``; the first stage and the last are on ranks 0 and p-1.
- ``v`` (ZBV, DualPipeV; v = 2 only): rank ``r`` holds stage ``r`` as chunk 0 and stage ``2p-1-r`` as
  chunk 1, so the activations go down the ranks and back up; the first and the last stage are both
  on rank 0, and the hand-over from stage p-1 to stage p stays on rank p-1.

Invariant: every stage has exactly one (rank, chunk), every (rank, chunk) exactly one stage, and a
stage's global layer numbers depend only on its index (so checkpoint keys do not depend on the
placement).
"""

from __future__ import annotations

PLACEMENTS = ("loop", "v")


def _check(placement: str, pp: int, vp: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown stage placement {placement!r}: one of {', '.join(PLACEMENTS)}")
    if pp < 1 or vp < 1:
        raise ValueError(f"pipeline size {pp} and chunks per rank {vp} must be positive")
    if placement == "v" and vp != 2:
        raise ValueError(f"the V placement needs exactly 2 model chunks per pipeline rank, not {vp}")


def get_stage_location(stage: int, pp: int, vp: int, placement: str = "loop") -> tuple[int, int]:
    """(pipeline rank, local chunk index) of ``stage``."""
    _check(placement, pp, vp)
    if not 0 <= stage < pp * vp:
        raise ValueError(f"stage {stage} outside 0..{pp * vp - 1}")
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def get_stage_index(pp_rank: int, chunk: int, pp: int, vp: int, placement: str = "loop") -> int:
    """The stage that ``pp_rank`` runs as its local ``chunk``."""
    _check(placement, pp, vp)
    if not (0 <= pp_rank < pp and 0 <= chunk < vp):
        raise ValueError(f"rank {pp_rank} / chunk {chunk} outside a pipeline of {pp} ranks x {vp} chunks")
    if placement == "v":
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def get_rank_stages(pp_rank: int, pp: int, vp: int, placement: str = "loop") -> list[int]:
    """The stages of ``pp_rank``, by local chunk index."""
    return [get_stage_index(pp_rank, c, pp, vp, placement) for c in range(vp)]
