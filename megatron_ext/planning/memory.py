"""The memory model: bytes one GPU of a layout holds at its peak, from exact counts and measured
coefficients; pure (no process group, nothing allocated).

Per rank of pipeline rank r:

- **State** (exact, from the parameter counts of ``model/param_count.py``): weights in the training
  dtype; megatron-core's DDP gradient buffers (``main_grad``: fp32, bf16 with --grad-reduce-in-bf16);
  optimizer state (Adam's m and v in fp32, plus fp32 main parameters under bf16/fp16), divided over
  DP with --use-distributed-optimizer. bf16 Adam: 18 bytes a parameter, 6 + 12/DP distributed.
- **Activations saved for the backward** (calibrated): per token and TP rank, a layer saves
  ``sum_k c_k x_k`` bytes, with x the features of ``layer_features`` (hidden / (TP if sequence
  parallel), hidden / TP, K and V width / TP, MLP width / TP, heads x sequence / TP, megatron-core's
  query copy, ...: the tensors the family's layers save, docs/planning.md) and c the
  coefficients ``tools/calibrate_memory.py`` fitted to measurements of the real megatron-core layers
  (``calibration.json``), one set per family (GPT with and without dropout, Llama: SwiGLU, GQA, RoPE),
  precision and recompute; the embedding and the head (final norm, output layer, loss) likewise.
  A (stage, micro-batch) holds its bytes from its forward until its backward (BW); with a
  zero-bubble B/W split, its B frees them but leaves each linear's input and output gradient for its
  W (``get_wgrad_held_per_token``), and stage 0 (whose B does nothing) holds all until its W. The
  peak walks the schedule's own action list (``pipeline/schedules``), so 1F1B's rank r holds p - r
  micro-batches and interleaved / zero-bubble orders what their lists say. Full recompute keeps
  each checkpointed group's input per micro-batch in flight; the group rebuilt in a backward (its
  layers without recompute, its input counted once) exists during that backward only, after the
  backward has freed the head's saves on the last stage.
- **--qk-layernorm** (Qwen3's per-head q/k norms, not in the calibration): a layer adds what the norms
  keep (``get_qk_norm_per_token``; measured exactly, tests/distributed/test_qk_norm_memory.py).
- **Context parallelism** (c ranks splitting each micro-batch): every per-token figure counts a
  rank's T / c tokens; a layer without recompute keeps the gathered keys and values instead of the
  local attention's (``get_cp_layer_delta_per_token``) and a stage one gather index
  (``get_cp_index_per_token``); recomputed layers keep 1/c of CP 1's; the distributed optimizer
  shards over DP x CP. Measured exactly at c = 1, 2, 4 (tests/distributed/test_cp_memory.py).
- **Temporaries outside autograd** (stated, not measured): the fp32 logits and the cross-entropy's
  fp32 temporaries on the last stage (2 x 4 bytes x vocabulary / TP per token), the sequence-parallel
  buffers (2 x hidden x dtype per token: the gather buffer all SP linears share, and one full-sequence
  tensor beside it, e.g. a column-parallel backward's input gradient before its reduce-scatter),
  and the received P2P buffers of one micro-batch (hidden / SP x dtype per token, twice).
- **Margin** (stated): ``MARGIN_FIXED_GIB`` for the CUDA context, NCCL's buffers and the DDP
  communication buckets, plus ``MARGIN_FRACTION`` of the rest for allocator fragmentation.

What the calibration validates (tests/distributed/test_memory_model.py): the saved-for-backward
bytes and the state bytes per rank on CPU runs, within 5%; not the temporaries (but the SP buffers:
test_memory_terms.py, which also runs stage 0's W after a later forward), nor the margin.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from megatron_ext.config import JobConfig
from megatron_ext.derived import get_ffn_hidden_size, get_kv_channels, get_num_query_groups
from megatron_ext.pipeline.actions import BW, B, F, PipelineOrder, W

CALIBRATION_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
GIB = 1024**3
MARGIN_FIXED_GIB = 1.0
MARGIN_FRACTION = 0.10

LAYER_FEATURES = (
    "seq_hidden",
    "hidden",
    "kv",
    "ffn",
    "heads_seq",
    "heads",
    "head_dim_per_sample",
    "one_seq",
    "query_copy",
    "unrepeated_kv",
    "per_micro_batch",
)
# The layer features each family's fit uses: the tensors its layers can save (docs/planning.md,
# "what a layer saves"), no two always proportional (GPT's K and V are 2 x hidden: no kv column), so
# least squares has one answer and the coefficients are bytes per element of the saved tensors.
LAYER_FEATURES_BY_FAMILY = {
    "gpt": ("seq_hidden", "hidden", "ffn", "heads_seq", "heads", "one_seq", "per_micro_batch"),
    "gpt-nodropout": ("seq_hidden", "hidden", "ffn", "heads", "one_seq", "per_micro_batch"),
    "llama": (
        "seq_hidden",
        "hidden",
        "kv",
        "ffn",
        "heads",
        "head_dim_per_sample",
        "one_seq",
        "query_copy",
        "unrepeated_kv",
        "per_micro_batch",
    ),
}
EMBEDDING_FEATURES = ("seq_hidden", "one_seq", "one", "tp_split")
HEAD_FEATURES = ("seq_hidden", "hidden", "vocab", "one_seq", "one", "tp_split")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the activation bytes depend on."""

    hidden: int
    heads: int
    query_groups: int
    ffn: int
    seq_length: int
    micro_batch: int
    padded_vocab: int
    tp: int
    sequence_parallel: bool
    swiglu: bool
    head_dim: int = 0  # --kv-channels; 0: hidden / heads
    cp: int = 1  # context parallelism: a rank holds 1/cp of each micro-batch's tokens

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (of a CP group: 1/cp of them)."""
        return self.seq_length * self.micro_batch // self.cp

    @property
    def kv_width(self) -> int:
        """K and V elements per token on one TP rank: 2 x query groups / TP x head dim (fewer groups
        than TP ranks: one, replicated)."""
        return 2 * max(self.query_groups // self.tp, 1) * (self.head_dim or self.hidden // self.heads)

    @property
    def query_width(self) -> int:
        """heads x head dimension: the width of q, the attention output and (repeated) k and v."""
        return self.heads * (self.head_dim or self.hidden // self.heads)


def _common(s: Shape) -> dict[str, float]:
    sp = s.tp if s.sequence_parallel else 1
    return {
        "seq_hidden": s.hidden / sp,
        "hidden": s.hidden / s.tp,
        "one_seq": 1 / sp,
        "one": 1.0,
        "tp_split": float(s.tp > 1),  # the vocabulary-parallel embedding's out-of-range mask
    }


def layer_features(s: Shape) -> list[float]:
    """Per-token feature values of one layer on one TP rank (``LAYER_FEATURES``' order).

    Two are conditional, as megatron-core's attention is: ``query_copy`` (hidden / TP) where its
    ``query.reshape`` of the split QKV output copies (1 < query groups per rank < heads per rank),
    a copy selective recompute's checkpoint keeps as its input; ``unrepeated_kv`` (K and V width
    / TP) where there is no GQA repeat (a group per head): V reaches the attention as a view of the
    QKV output, which is then kept whole instead of a repeated V. ``per_micro_batch`` is 1 / tokens
    (the checkpoint's 4-byte mask-type tensor, a CPU tensor even on a GPU). The ``hidden`` feature
    is the attention's tensors (q, repeated k and v, their output): the query width / TP."""
    head_dim = s.query_width // s.heads
    heads_local = s.heads // s.tp
    groups_local = max(s.query_groups // s.tp, 1)  # fewer groups than TP ranks: one, replicated
    kv = 2 * groups_local * head_dim
    x = _common(s) | {
        "hidden": s.query_width / s.tp,
        "kv": kv,
        "ffn": s.ffn / s.tp,
        "heads_seq": s.heads * s.seq_length / s.tp,
        "heads": s.heads / s.tp,
        "head_dim_per_sample": head_dim / s.micro_batch,  # a table per sequence position, shared by the batch
        "query_copy": s.query_width / s.tp if 1 < groups_local < heads_local else 0.0,
        "unrepeated_kv": kv if groups_local == heads_local else 0.0,
        "per_micro_batch": 1 / s.tokens,
    }
    return [x[k] for k in LAYER_FEATURES]


def embedding_features(s: Shape) -> list[float]:
    x = _common(s)
    return [x[k] for k in EMBEDDING_FEATURES]


def head_features(s: Shape) -> list[float]:
    x = _common(s) | {"vocab": s.padded_vocab / s.tp}
    return [x[k] for k in HEAD_FEATURES]


@functools.cache
def load_calibration(path: str = CALIBRATION_PATH) -> dict:
    with open(path) as f:
        return json.load(f)["buckets"]


def get_family(cfg: JobConfig) -> str:
    m = cfg.model
    if m.swiglu:
        return "llama"
    return "gpt" if (m.hidden_dropout or m.attention_dropout) else "gpt-nodropout"


def get_recompute_kind(cfg: JobConfig) -> str:
    m = cfg.model
    granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
    return granularity or "none"


def get_shape(cfg: JobConfig, padded_vocab: int) -> Shape:
    m, p = cfg.model, cfg.parallel
    return Shape(
        hidden=m.hidden_size,
        heads=m.num_attention_heads,
        query_groups=get_num_query_groups(m),
        ffn=get_ffn_hidden_size(m),
        seq_length=m.seq_length,
        micro_batch=cfg.training.micro_batch_size,
        padded_vocab=padded_vocab,
        tp=p.tensor_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        swiglu=m.swiglu,
        head_dim=get_kv_channels(m),
        cp=p.context_parallel_size,
    )


@dataclasses.dataclass(frozen=True)
class PerToken:
    """Bytes saved per token of one micro-batch on one TP rank."""

    layer: float
    embedding: float
    head: float


def get_saved_per_token(
    family: str, precision: str, recompute: str, shape: Shape, path: str = CALIBRATION_PATH
) -> PerToken:
    entry = load_calibration(path)[f"{family}/{precision}/{recompute}"]

    def dot(part: str, names: tuple[str, ...], x: list[float]) -> float:
        return sum(entry[part].get(n, 0.0) * v for n, v in zip(names, x))  # a feature not fitted: 0

    return PerToken(
        layer=dot("layer", LAYER_FEATURES, layer_features(shape)),
        embedding=dot("embedding", EMBEDDING_FEATURES, embedding_features(shape)),
        head=dot("head", HEAD_FEATURES, head_features(shape)),
    )


# ----------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """One rank's model state: weights, DDP gradient buffer, optimizer state (its DP shard with the
    distributed optimizer). Bucket padding is left out (at most a bucket's alignment per bucket)."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def get_state_bytes(cfg: JobConfig, num_params: int, shards: int) -> StateBytes:
    """Bytes of ``num_params`` parameters held by one rank, as megatron-core keeps them: weights in
    the training dtype; gradients in fp32 buffers (bf16 with --grad-reduce-in-bf16); Adam's two
    moments (SGD's momentum) in fp32, plus fp32 main parameters under bf16/fp16, sharded with
    --use-distributed-optimizer over ``shards`` ranks: DP x CP (megatron-core's distributed optimizer
    shards over the DP x CP group, whose ranks hold the same parameters). bf16 Adam: 18 bytes a
    parameter, 6 + 12/(DP x CP) distributed (Megatron-LM's ``theoretical_memory_usage`` figures)."""
    t, p = cfg.training, cfg.parallel
    mixed = t.bf16 or t.fp16
    weight = 2 if mixed else 4
    grad = 2 if p.grad_reduce_in_bf16 else 4
    optimizer = (8 if t.optimizer == "adam" else 4) + (4 if mixed else 0)
    shard = -(-num_params // shards) if p.use_distributed_optimizer else num_params
    return StateBytes(num_params * weight, num_params * grad, shard * optimizer)


# ----------------------------------------------------------------------------- activations over a schedule


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """How full recompute applies to a chunk of ``n`` layers: ``groups`` checkpointed inputs kept
    per micro-batch, ``plain`` layers without recompute, ``transient`` layers rebuilt at once."""

    kind: str  # none | selective | full
    method: str | None = None  # uniform | block
    num_layers: int = 1

    def split(self, n: int) -> tuple[float, int, int]:
        """(checkpointed layer inputs, layers saving everything, layers rebuilt at once in backward)."""
        if self.kind != "full":
            return 0.0, n, 0
        if self.method == "block":
            k = min(self.num_layers, n)
            return float(k), n - k, 1 if k else 0
        return n / self.num_layers, 0, self.num_layers


def get_stage_bytes(
    layers_per_stage: list[int],
    tokens: int,
    saved: PerToken,
    full_input: float,
    plan: RecomputePlan,
    shared: float = 0.0,
) -> list[float]:
    """Bytes one micro-batch leaves on each stage until its backward. ``saved`` is the per-token
    figure of the job's recompute kind; under full recompute ``full_input`` (the per-token bytes
    of a checkpointed layer: its input) and ``saved.layer`` the bytes of a plain layer; ``shared``
    per-token bytes a stage keeps once if it has a plain layer (CP's gather index)."""
    last = len(layers_per_stage) - 1
    out = []
    for s, n in enumerate(layers_per_stage):
        kept, plain, _ = plan.split(n)
        per_token = kept * full_input + plain * saved.layer + (shared if plain else 0.0)
        per_token += (saved.embedding if s == 0 else 0) + (saved.head if s == last else 0)
        out.append(per_token * tokens)
    return out


def get_wgrad_held_per_token(shape: Shape, dtype_bytes: int) -> PerToken:
    """Bytes per token a zero-bubble B leaves for its W (``model/wgrad_deferral.WeightGradWork``: each
    linear's saved input and its output gradient, until W runs). Per layer: the QKV and fc1 inputs
    (norm outputs, [s / SP, b, h]), the proj input [s, b, q / TP] (q: the query width), the fc2 input
    [s, b, ffn / TP]; the output gradients of QKV [s, b, (q + K + V) / TP], proj and fc2 [s, b, h] (row-parallel:
    whole), fc1 [s, b, (2 with SwiGLU) ffn / TP]. The head: the output layer's input [s / SP, b, h]
    and the logits' gradient [s, b, vocabulary / TP]. The embedding has no deferred W."""
    h, tp = shape.hidden, shape.tp
    sp = tp if shape.sequence_parallel else 1
    q = shape.query_width
    kv = 2 * shape.query_groups * (q // shape.heads)
    inputs = 2 * h / sp + q / tp + shape.ffn / tp
    grads = (q + kv) / tp + 2 * h + (2 if shape.swiglu else 1) * shape.ffn / tp
    head = h / sp + shape.padded_vocab / tp
    return PerToken(layer=(inputs + grads) * dtype_bytes, embedding=0.0, head=head * dtype_bytes)


def get_gathered_kv_per_token(shape: Shape, dtype_bytes: int, repacked: bool = True) -> float:
    """Bytes per local token of one layer's gathered keys and values under context parallelism
    (``context_parallel/attention.py``: K and V all-gathered over the CP group, each local query piece
    attending to its document's keys up to its end). On CUDA (``repacked``, what the planner prices)
    the flash varlen call keeps each piece's keys, repacked: a rank's two chunks of every span of n
    tokens attend to (r + 1) and (2c - r) of its 2c chunks, (2c + 1) / (2c) x n keys whatever r, so
    (2c + 1) / (2c) x T x 2 ng / TP x hn x bytes for a micro-batch of T tokens; per local token (T / c
    of them) (2c + 1) / 2 x 2 ng / TP x hn x bytes. The CPU kernel keeps the gathered buffer in
    global order: T x 2 ng / TP x hn x bytes, c x ... per local token. Saved for the backward when
    core attention is not recomputed; one layer's at a time (in its forward, and again in its
    recompute) when it is. 0 without CP."""
    c = shape.cp
    if c <= 1:
        return 0.0
    keys = (2 * c + 1) / (2 * c) if repacked else 1.0
    return keys * c * shape.kv_width * dtype_bytes


def get_cp_layer_delta_per_token(shape: Shape, dtype_bytes: int, rotary: bool, repacked: bool = True) -> float:
    """What a layer without recompute saves per local token under CP beyond the calibrated CP 1 figure
    (measured exactly at c = 2 and 4, tests/distributed/test_cp_memory.py): plus the gathered K/V
    (``get_gathered_kv_per_token``); less the local attention's own keys and values, which the CP
    attention (saving q, the gathered [K; V], its output and the logsumexp) does not keep. With RoPE
    the local attention keeps its rotated q and, with GQA, k and v repeated to the query width (2 x
    query width / TP), or without GQA the rotated k (query width / TP) and the whole QKV output (a
    view of it, v, is saved: query width + K and V width, ``unrepeated_kv``); under CP only q stays,
    a fresh tensor. Without RoPE q is a view of the QKV output, which the CP attention then keeps as
    the local attention did: nothing less. 0 without CP."""
    if shape.cp <= 1:
        return 0.0
    local = 0.0
    if rotary:
        groups_local = max(shape.query_groups // shape.tp, 1)
        unrepeated = shape.kv_width if groups_local == shape.heads // shape.tp else 0
        local = (2 * shape.query_width / shape.tp + unrepeated) * dtype_bytes
    return get_gathered_kv_per_token(shape, dtype_bytes, repacked) - local


def get_qk_norm_per_token(
    shape: Shape, family: str, dtype_bytes: int, recompute: str, rms: bool = True, rotary: bool = True
) -> float:
    """What ``--qk-layernorm``'s norms (``model/norm.HeadNorm``: over each head's [hn] of the queries
    and keys on this TP rank, the whole sequence even under SP) add to a layer's saved bytes per token
    beyond the calibrated figure, which is of layers without them (measured exactly:
    tests/distributed/test_qk_norm_memory.py). Per token on one TP rank, with q the query width / TP,
    k the key width / TP (groups x hn), n = q + k normed elements and r = (heads + groups) / TP rows:

    - the norms' own saves: torch's CPU RMSNorm (its composite kernel) an fp32 rstd per row and the
      fp32 normalized x x rstd, under bf16 also the fp32 upcast of its input (8 bytes an element), in
      fp32 its input itself; LayerNorm its input and a mean and rstd per row in the input's dtype;
    - their inputs, where the norm keeps them: megatron-core's query copy (``query_copy``, else q is a
      view) and the QKV output (k is a view of it), kept whole [q + K + V] unless V, a view of it,
      already keeps it (no GQA repeat; always under selective recompute; and not SDPA's CPU math path
      with attention dropout, which upcasts v, in bf16);
    - the normed q and k where something keeps them instead of the inputs: selective recompute's
      checkpoint (whose query copy the norm then keeps or, in a bf16 RMSNorm, nothing does), or SDPA
      without RoPE (with RoPE the rotation makes fresh tensors from them, as before without the norms);
      not SDPA's math path (attention dropout), which scales them first.

    Full recompute: 0 (a checkpointed layer keeps its input; the rebuilt layer is priced as ``none``).
    CUDA's fused RMSNorm keeps only its input and the rstd: this CPU figure is an upper bound of it
    (as the calibrated layer norms are: the calibration is the CPU's)."""
    if recompute == "full":
        return 0.0
    heads, groups = shape.heads // shape.tp, max(shape.query_groups // shape.tp, 1)
    head_dim = shape.query_width // shape.heads
    q, k = heads * head_dim, groups * head_dim
    n, rows = q + k, heads + groups
    fp32 = dtype_bytes == 4
    math_path = family == "gpt"  # SDPA with attention dropout: torch's CPU math path
    selective = recompute == "selective"
    if rms:
        keeps_input, own = fp32, 4 * rows + (4 if fp32 else 8) * n
    else:
        keeps_input, own = True, 2 * dtype_bytes * rows
    qkv_kept = selective or (groups == heads and not (math_path and not fp32))
    normed_kept = selective or not (rotary or math_path)
    copy = q if 1 < groups < heads else 0  # megatron-core's query reshape copies
    out = own + (n if normed_kept else 0) * dtype_bytes
    out += (q + 2 * k) * dtype_bytes if keeps_input and not qkv_kept else 0
    # without the norms the copy is kept by what now keeps the normed q (the checkpoint, SDPA)
    return out + copy * dtype_bytes * (int(keeps_input) - int(normed_kept))


def get_cp_index_per_token(shape: Shape, repacked: bool = True) -> float:
    """Bytes per local token of the int64 index that puts the gathered K/V in order, saved once per
    micro-batch by a stage's layers without recompute (they share it): the repacking index of
    (2c + 1) / (2c) x T keys on CUDA, the [T] order on the CPU. 0 without CP."""
    c = shape.cp
    if c <= 1:
        return 0.0
    return 8 * c * ((2 * c + 1) / (2 * c) if repacked else 1.0)


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """What one micro-batch costs each stage (lists by stage): ``saved`` from its F to its backward;
    ``held_for_w`` from a split B to its W (what B leaves for W); ``backward_extra`` on top of the
    bytes in flight while its backward runs (full recompute's rebuilt layers, less what that
    backward freed before rebuilding them: the head's saves on the last stage)."""

    saved: list[float]
    held_for_w: list[float]
    backward_extra: list[float]


def get_activation_peak(order: PipelineOrder | None, pp_rank: int, stages: StageBytes) -> float:
    """Peak bytes pipeline rank ``pp_rank`` holds walking its action list: a (stage, micro-batch)
    adds ``saved`` at its F; a BW frees it; a B (input gradient) frees it but keeps ``held_for_w``
    until its W. Stage 0's B does nothing (nothing waits for its input gradient: the runtime runs its
    whole backward in W), so stage 0 holds ``saved`` until W. While a backward runs (BW, B, stage
    0's W) ``backward_extra`` comes on top. No order (no pipelining): one micro-batch."""
    if order is None:
        return stages.saved[0] + max(0.0, stages.backward_extra[0])
    live = peak = 0.0
    for a in order.ranks[pp_rank]:
        s = a.stage
        if a.kind == F:
            live += stages.saved[s]
            peak = max(peak, live)
        elif a.kind == BW or (a.kind == B and s != 0) or (a.kind == W and s == 0):
            peak = max(peak, live + stages.backward_extra[s])
            live -= stages.saved[s]
            if a.kind == B:
                live += stages.held_for_w[s]
                peak = max(peak, live)
        elif a.kind == W:
            live -= stages.held_for_w[s]
    return peak


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One GPU's predicted bytes by kind (``total`` adds the margin)."""

    state: StateBytes
    activations: float  # saved for backward, at the schedule's peak (the recompute transient included)
    temporaries: float  # outside autograd (module docstring)
    recompute_transient: float = 0.0  # the layers full recompute rebuilds at once in a backward (at most)

    @property
    def margin(self) -> float:
        return MARGIN_FIXED_GIB * GIB + MARGIN_FRACTION * (self.state.total + self.activations + self.temporaries)

    @property
    def total(self) -> float:
        return self.state.total + self.activations + self.temporaries + self.margin


def get_temporaries(
    shape: Shape, dtype_bytes: int, last_stage: bool, pipelined: bool, kv_transient: bool = False
) -> float:
    """Stated bytes outside autograd (module docstring) for one micro-batch on one rank;
    ``kv_transient``: core attention recomputed under CP, so one layer's gathered K and V
    (``get_gathered_kv_per_token``) exist at a time, outside what the backward keeps."""
    t = shape.tokens
    sp = shape.tp if shape.sequence_parallel else 1
    out = 2 * 4 * shape.padded_vocab / shape.tp * t if last_stage else 0.0
    if shape.sequence_parallel:
        out += 2 * shape.hidden * dtype_bytes * t
    if pipelined:
        out += 2 * shape.hidden / sp * dtype_bytes * t
    if kv_transient:
        out += get_gathered_kv_per_token(shape, dtype_bytes) * t
    return out
