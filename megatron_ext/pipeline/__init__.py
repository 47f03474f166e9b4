"""Pipeline schedules beyond megatron-core's: zero-bubble orders on megatron-core's model chunks.

The room's pieces, one job each:
- ``placement``: which (pipeline rank, local chunk) holds each pipeline stage ("loop": megatron-core's
  interleaved placement, stage = chunk x p + rank; "v": ZBV's, stages r and 2p-1-r on rank r).
- ``wgrad_queue``: the weight-gradient (W) work that a backward pass deferred, per (chunk,
  micro-batch), run later by the schedule.
- ``names``: the names ``--pipeline-schedule`` accepts; ``validate``: what each needs, by flag.
- ``actions``: a schedule as per-rank action lists (F, B, W, BW per stage and micro-batch);
  ``schedules/``: their generators by name (``greedy``: list scheduling under a memory limit).
- ``simulate``: the checker and the discrete-event model of any order (megatron-core's too).
- ``p2p``: the messages an order implies (from stage adjacency) and the channels carrying them.
- ``runtime``: runs one rank's list on megatron-core's chunks, the step's one entry point.
"""
