"""The messages of a pipeline order, derived from stage adjacency (pure), and the channels that carry
them (megatron-core's ``P2PCommunicator``).

Every F of stage s < S-1 makes the input of stage s+1 ("activation" message), every B / BW of stage
s > 0 the output gradient of stage s-1 ("gradient" message). A message between two stages of one
rank is a local hand-over (the V placement's turn at rank p-1); any other goes to the ring-adjacent
rank (loop: s+1 is on rank r+1 mod p; V: on rank r+1 or r-1), so every message is a send to
megatron-core's next or previous pipeline rank.

Matching: P2P messages between two ranks are matched in the order they were posted (NCCL always,
gloo for one tag), so each receiver posts its receives on a channel (sender, receiver) in the order
the sender produces them, which it knows: every rank derives the whole order. Sends are
non-blocking and posted as soon as their producer ends; a receive is posted ahead (the runtime's
look-ahead) and waited for by its consumer. Sends never wait for receives, so a valid order
(``simulate.check_order``) cannot deadlock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_ext.pipeline.actions import BW, Action, B, F, PipelineOrder

ACTIVATION, GRADIENT = "activation", "gradient"


class Message(tuple):
    """(kind, destination stage, micro-batch): the input a consumer action waits for."""

    def __new__(cls, kind: str, stage: int, mb: int) -> Message:
        return super().__new__(cls, (kind, stage, mb))


def get_output_message(order: PipelineOrder, action: Action) -> Message | None:
    """The message ``action`` produces (None: nothing, e.g. the last stage's forward)."""
    if action.kind == F and action.stage < order.num_stages - 1:
        return Message(ACTIVATION, action.stage + 1, action.mb)
    if action.kind in (B, BW) and action.stage > 0:
        return Message(GRADIENT, action.stage - 1, action.mb)
    return None


def get_input_message(order: PipelineOrder, action: Action) -> Message | None:
    """The message ``action`` consumes (None: it needs none)."""
    if action.kind == F and action.stage > 0:
        return Message(ACTIVATION, action.stage, action.mb)
    if action.kind in (B, BW) and action.stage < order.num_stages - 1:
        return Message(GRADIENT, action.stage, action.mb)
    return None


def get_message_source(order: PipelineOrder, msg: Message) -> int:
    kind, stage, _ = msg
    return order.rank_of(stage - 1 if kind == ACTIVATION else stage + 1)


@dataclasses.dataclass(frozen=True)
class P2PPlan:
    """One rank's view of the messages of an order.

    ``incoming[src]``: the messages ``src`` sends this rank, in the order ``src`` produces them (the
    order this rank posts its receives in); ``local``: the messages this rank hands to itself."""

    pp_rank: int
    incoming: dict[int, tuple[Message, ...]]
    local: frozenset
    position: dict[Message, tuple[int, int]] = dataclasses.field(default_factory=dict)  # msg -> (src, index)

    def __post_init__(self) -> None:
        for src, msgs in self.incoming.items():
            self.position.update({msg: (src, i) for i, msg in enumerate(msgs)})

    def channel_of(self, msg: Message) -> tuple[int, int]:
        """(source rank, position on that channel)."""
        if msg not in self.position:
            raise KeyError(f"rank {self.pp_rank} receives no {msg}")
        return self.position[msg]


def build_p2p_plan(order: PipelineOrder, pp_rank: int) -> P2PPlan:
    incoming: dict[int, list[Message]] = {}
    local = set()
    for src, actions in enumerate(order.ranks):
        for action in actions:
            msg = get_output_message(order, action)
            if msg is None:
                continue
            dst = order.rank_of(msg[1])
            if dst == pp_rank == src:
                local.add(msg)
            elif dst == pp_rank:
                incoming.setdefault(src, []).append(msg)
    return P2PPlan(pp_rank, {src: tuple(msgs) for src, msgs in incoming.items()}, frozenset(local))


class P2PChannels:
    """Non-blocking sends and in-order, look-ahead receives of one rank over megatron-core's
    ``P2PCommunicator`` (its ``send_forward_recv_forward`` / ``send_backward_recv_backward`` with
    ``overlap_p2p_comm=True``: an isend or irecv to the next or previous pipeline rank that returns
    its handle). Receive buffers are [s, b, h] tensors of ``config.pipeline_dtype`` that require
    grad (megatron-core's), one per posted receive.

    Invariant: receives on a channel are posted in the sender's production order; every send is
    waited for (``finish``) before the step ends."""

    def __init__(self, communicator: Any, plan: P2PPlan, tensor_shape: list[int], next_rank: int, prev_rank: int):
        self.comm = communicator
        self.plan = plan
        self.shape = tensor_shape
        self.next_rank, self.prev_rank = next_rank, prev_rank  # pipeline-group ranks
        self.posted: dict[Message, tuple[torch.Tensor, Any]] = {}
        self.num_posted = dict.fromkeys(plan.incoming, 0)
        self.sends: list[tuple[Any, torch.Tensor]] = []

    def send(self, msg: Message, dst: int, tensor: torch.Tensor) -> None:
        """isend ``tensor`` (a detached alias: the caller may deallocate its own) to ``dst``."""
        alias = tensor.detach()
        if dst == self.next_rank:
            _, handles = self.comm.send_forward_recv_forward(
                alias, recv_prev=False, tensor_shape=None, overlap_p2p_comm=True
            )
        elif dst == self.prev_rank:
            _, handles = self.comm.send_backward_recv_backward(
                alias, recv_next=False, tensor_shape=None, overlap_p2p_comm=True
            )
        else:
            raise AssertionError(f"{msg} to rank {dst}, which is not a pipeline neighbour")
        self.sends += [(h, alias) for h in handles.values()]
        self.sends = [(h, t) for h, t in self.sends if not h.is_completed()]

    def post_until(self, msg: Message) -> None:
        """Post the receives of ``msg``'s channel up to and including ``msg``."""
        src, index = self.plan.channel_of(msg)
        while self.num_posted[src] <= index:
            pending = self.plan.incoming[src][self.num_posted[src]]
            if src == self.prev_rank:
                buf, handles = self.comm.send_forward_recv_forward(
                    None, recv_prev=True, tensor_shape=self.shape, overlap_p2p_comm=True
                )
                handle = handles["recv_prev"]
            else:
                buf, handles = self.comm.send_backward_recv_backward(
                    None, recv_next=True, tensor_shape=self.shape, overlap_p2p_comm=True
                )
                handle = handles["recv_next"]
            self.posted[pending] = (buf, handle)
            self.num_posted[src] += 1

    def receive(self, msg: Message) -> torch.Tensor:
        """The tensor of ``msg`` (posting what must come first), once it arrived."""
        if msg not in self.posted:
            self.post_until(msg)
        buf, handle = self.posted.pop(msg)
        handle.wait()
        return buf

    def finish(self) -> None:
        """Wait for every send; a receive still posted here is a bug of ours (asserted)."""
        for handle, _ in self.sends:
            handle.wait()
        self.sends.clear()
        assert not self.posted, f"rank {self.plan.pp_rank}: received but never used: {sorted(self.posted)}"
