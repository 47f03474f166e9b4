"""Pipeline schedules beyond megatron-core's: zero-bubble orders on megatron-core's model chunks.

The room's pieces, one job each:
- ``placement``: which (pipeline rank, local chunk) holds each pipeline stage ("loop": megatron-core's
  interleaved placement, stage = chunk x p + rank; "v": ZBV's, stages r and 2p-1-r on rank r).
- ``wgrad_queue``: the weight-gradient (W) work that a backward pass deferred, per (chunk,
  micro-batch), run later by the schedule.
"""
