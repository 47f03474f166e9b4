"""Core attention for the local (torch) layer spec: fast and exact, packed (THD) or not.

Invariant: the output equals megatron-core's ``DotProductAttention`` (causal softmax attention)
for unpacked inputs, and each document attending only to itself, causally, for packed inputs
(``PackedSeqParams(qkv_format="thd")``: no token attends across a ``cu_seqlens`` boundary). No
kernel here asks the device for anything: what a kernel needs on the host (the boundaries, the
longest document) is computed once per micro-batch (``data/microbatch.Microbatch``) and arrives in
``PackedMicrobatchParams``.

Kernels (one notice line at start-up says which run, ``describe_attention_kernels``):

- unpacked causal: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` (flash,
  cuDNN or memory-efficient on GPUs, flash on the CPU) instead of megatron-core's [b, np, s, s]
  score matrix (measured on an H100, GPT-2 124M bf16: 224k-253k tokens/s vs 111k); anything else
  (an explicit mask, a window, a non-vanilla softmax) stays megatron-core's;
- packed on CUDA in bf16/fp16: the flash varlen kernel of torch's ``varlen_attn`` (torch >= 2.10),
  called directly (``varlen_causal_attention`` says why); grouped k/v go in as they are. It is
  FlashAttention (no fp32: seen on an H100, torch 2.11) without dropout here, so fp32 runs and
  ``--attention-dropout > 0`` take the per-document loop;
- packed elsewhere (the CPU) or with dropout: SDPA per document (4-D views, so torch's CPU flash
  kernel runs; ``bench/varlen.py``: 1.52x the useful tokens/CPU-s of one SDPA with a dense
  block-diagonal mask). flex_attention has no CPU backward, nested-jagged SDPA no CPU backend.
- Transformer Engine's attention replaces all of this when TE is installed and CUDA is used.

RoPE: on the local spec our core attention rotates q and k, not megatron-core's attention (the
model's rotary module yields nothing: ``CoreAttentionRotaryEmbedding``). megatron-core 0.16.1's
unfused THD rotary path calls ``cu_seqlens.tolist()`` and loops over documents in every layer; for
packed input the micro-batch's per-token frequencies are gathered once from its position ids
(``build_packed_rotary_freqs``). And its unfused rotation recomputes cos and sin of the frequency
table, scales and casts them, for q and again for k, in every layer, then copies the result once
more (a ``cat`` with the empty unrotated part): 12 kernels per tensor. Here cos and sin in the
activations' dtype are computed once per sequence length (``RotaryTable``) or packed micro-batch,
with rotate_half's sign moved into sin, and each rotation is ``t * cos + swap_halves(t) * signed_sin``:
4 kernels, bitwise megatron-core's values (``bench/rope.py`` counts the launches).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.context_parallel import attention as cp_attention

PER_DOCUMENT = "per-document SDPA loop"
VARLEN = "flash varlen (the kernel of torch's varlen_attn)"
MASKED = "one SDPA with a block-diagonal causal mask (static shapes)"


@dataclasses.dataclass
class PackedMicrobatchParams(PackedSeqParams):
    """megatron-core's THD parameters plus what our core attention needs, computed once per micro-batch:
    the boundaries on the host, the per-token rotary frequencies and, under CP, the plan (unpacked rows
    too: ``qkv_format="sbhd"``, which megatron-core hands to the core attention untouched)."""

    cu_seqlens_host: tuple[int, ...] | None = None
    rotary_freqs: torch.Tensor | None = None  # [t, 1, rot_dim] fp32 by position id ([s, b, 1, rot_dim]: rows)
    context_parallel: cp_attention.ContextParallelPlan | None = None
    # (dtype, interleaved) -> rotary_coefficients, made by the first layer that rotates
    rotary_coefficients: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


@dataclasses.dataclass
class StaticPackedParams(PackedSeqParams):
    """What layers receive for a packed micro-batch with static shapes (--torch-compile, CUDA graphs;
    ``prepare_static_packed_params``): tensors of a bounded set of shapes, ints from a bounded set, the
    kernel's name; nothing host-side (megatron-core's CUDA-graph argument check, ``_check_supported_type``,
    takes tensors, ints, strings and dataclasses of them; a tuple or a dict it refuses).

    ``cu_seqlens_q/kv`` [D + 1] int32, D = ``document_bound`` (the added documents zero-length);
    ``max_seqlen_q/kv`` bucketed (``bucket_max_seqlen``); ``document_ids`` [t] int64 (the masked
    kernel); ``rotary_cos/sin`` [t, 1, rot_dim] in the activations' dtype (None without RoPE)."""

    kernel: str = MASKED
    document_ids: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None


# ----------------------------------------------------------------------------- kernels


# looked up at call time, so a test can stand in for the CUDA-only kernel
flash_attention_forward = torch.ops.aten._flash_attention_forward


@functools.cache
def get_varlen_attn():
    """torch's varlen attention function, or None (torch < 2.10). Its presence says this torch
    runs packed attention on flash's varlen kernel (``varlen_causal_attention`` calls that kernel
    directly)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def flash_varlen_supported(device_index: int, head_dim: int) -> bool:
    """Whether flash's varlen kernel runs on this CUDA device: torch >= 2.10 (it has varlen_attn), an
    sm80+ GPU (FlashAttention 2 has no kernels for Volta/Turing) and a head dimension flash takes (a
    multiple of 8, at most 256). Host-side facts, asked once per device and head size."""
    if get_varlen_attn() is None or head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def select_packed_kernel(device_type: str, dropout_p: float, varlen_available: bool, dtype: torch.dtype) -> str:
    """Which kernel runs packed attention (pure; the notice line and the forward both use it).
    varlen_attn is FlashAttention: CUDA, bf16/fp16 only ("FlashAttention only support fp16 and
    bf16 data type" for fp32), no dropout."""
    if device_type == "cuda" and varlen_available and dropout_p == 0.0 and dtype in HALF_DTYPES:
        return VARLEN
    return PER_DOCUMENT


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """query [t, np, hn], key/value [t, ng, hn] (ng divides np: flash takes grouped k/v as they
    are) -> [t, np * hn], each document attending to itself, causally.

    The kernel of torch's ``varlen_attn`` (``aten._flash_attention_forward`` with ``cu_seqlens``),
    called directly so that aten's own C++ autograd node (FlashAttentionBackward0) runs the
    backward: ``varlen_attn`` wraps the same kernel in a Python custom op whose dispatch cost
    ~0.5 ms of host time per call, forward and backward again (H100 profile, torch 2.11, GPT-2
    124M packed: 12 ms per step of host time, 0.86x the unpacked tokens/s). Registered in
    compat.py."""
    out = flash_attention_forward(
        query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
    )[0]
    return out.reshape(out.shape[0], -1)


def document_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: tuple[int, ...] | list[int],
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [t, np, hn], key/value [t, ng, hn] (ng divides np) -> [t, np * hn]; SDPA per document."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        # 4-D views: torch's CPU flash kernel takes only [b, heads, n, hn]; 3-D views fall back
        # to the math kernel, which materialises n x n scores (measured 1.34x slower end to end)
        q = query[s:e].transpose(0, 1).unsqueeze(0)  # [1, np, n, hn]
        k = key[s:e].transpose(0, 1).unsqueeze(0)  # [1, ng, n, hn]
        v = value[s:e].transpose(0, 1).unsqueeze(0)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        outs.append(o.squeeze(0).transpose(0, 1))  # [n, np, hn]
    out = torch.cat(outs, dim=0)
    return out.reshape(out.shape[0], -1)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np * hn]; one causal SDPA."""
    s, b, np_, hn = query.shape
    groups = np_ // key.shape[2]
    q = query.permute(1, 2, 0, 3)  # [b, np, s, hn]
    k = key.permute(1, 2, 0, 3)
    v = value.permute(1, 2, 0, 3)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
    return o.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def block_diagonal_causal_mask(cu_seqlens: list[int], length: int) -> torch.Tensor:
    """[t, t] bool, True where attention is allowed: same document and not in the future."""
    doc = torch.zeros(length, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        doc[s:e] = i
    same = doc[:, None] == doc[None, :]
    return same & torch.ones(length, length, dtype=torch.bool).tril()


def check_boundaries(cu_seqlens: tuple[int, ...] | list[int], num_tokens: int) -> None:
    """ValueError unless 0 = c_0 < c_1 < ... < c_n = num_tokens (no empty document)."""
    if (
        not cu_seqlens
        or cu_seqlens[0] != 0
        or cu_seqlens[-1] != num_tokens
        or any(b <= a for a, b in zip(cu_seqlens, cu_seqlens[1:]))
    ):
        raise ValueError(
            f"packed sequences: document boundaries {list(cu_seqlens[:4])}...{list(cu_seqlens[-2:])} do "
            f"not describe {num_tokens} tokens (need 0 = c_0 < c_1 < ... < c_n = tokens)"
        )


# ----------------------------------------------------------------------------- RoPE


class CoreAttentionRotaryEmbedding(RotaryEmbedding):
    """megatron-core's RotaryEmbedding whose rotation our core attention applies: it yields nothing,
    so megatron-core's attention skips its own (its per-layer cos/sin, and for packed input its
    per-document loop with a host sync). Same state and frequencies as upstream's."""

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        return None


class RotaryTable:
    """cos and signed sin (``rotary_coefficients``) of a chunk's rotary frequencies in the
    activations' dtype, per sequence length, computed once and kept (a few KiB to MiB each). Linked to
    each core attention of the chunk; not a module: the frequencies are the rotary module's
    (``get_emb``, megatron-core's table)."""

    MAX_ENTRIES = 64  # negotiated padding gives at most seq_length / pad_to_multiple_of lengths

    def __init__(self, rotary: RotaryEmbedding):
        self.rotary = rotary
        self._cache: dict = {}

    @property
    def active(self) -> bool:
        """Whether our core attention rotates (megatron-core's does when the class is upstream's)."""
        return isinstance(self.rotary, CoreAttentionRotaryEmbedding)

    def coefficients(
        self, seq_len: int, dtype: torch.dtype, device: torch.device, interleaved: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([s, 1, 1, rot_dim], same) for positions 0..seq_len-1."""
        key = (seq_len, dtype, device, interleaved)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            freqs = self.rotary.get_emb(seq_len).to(device)
            hit = self._cache[key] = rotary_coefficients(freqs, dtype, interleaved)
        return hit


def rotary_coefficients(
    freqs: torch.Tensor, dtype: torch.dtype, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``cos_ = (cos(freqs) * mscale).to(dtype)`` (mscale 1: plain RoPE) and its
    ``sin_`` likewise, with the sign of rotate_half moved into it: negated where rotate_half negates
    (the first half, or the even positions when interleaved), so ``swap_halves(t) * signed_sin`` is
    bitwise ``rotate_half(t) * sin_`` (negation is exact). Plain tensors even when first asked for
    under ``torch.inference_mode`` (they are kept, and a training step after it saves them)."""
    with torch.inference_mode(False), torch.no_grad():
        freqs = freqs.clone() if freqs.is_inference() else freqs
        cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
        negated = sin[..., ::2] if interleaved else sin[..., : sin.shape[-1] // 2]
        negated.neg_()
        return cos, sin


def packed_coefficients(
    params: PackedMicrobatchParams, dtype: torch.dtype, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_coefficients`` of a packed micro-batch's per-token frequencies, made once per micro-batch."""
    key = (dtype, interleaved)
    hit = params.rotary_coefficients.get(key)
    if hit is None:
        hit = params.rotary_coefficients[key] = rotary_coefficients(params.rotary_freqs, dtype, interleaved)
    return hit


def rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``t`` [..., heads, hn] rotated by ``rotary_coefficients`` [..., 1, rot_dim] (broadcast over
    heads): megatron-core's ``_apply_rotary_pos_emb_bshd`` values, in 4 kernels (its 12 less the
    table's cos, sin, scales and casts, rotate_half's negation, and its copy when every dimension
    rotates)."""
    rot_dim = cos.shape[-1]
    if rot_dim == t.shape[-1]:
        return t * cos + swap_halves(t, interleaved) * signed_sin
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((t_rot * cos + swap_halves(t_rot, interleaved) * signed_sin, t_pass), dim=-1)


def swap_halves(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """megatron-core's ``_rotate_half`` without its negation: the two halves of the last dimension
    swapped (a roll), or each even/odd pair swapped when interleaved (a flip); any number of leading
    dimensions (upstream's interleaved branch indexes exactly four). One kernel forward and one
    backward (CUDA's roll copies a non-contiguous input first, as GQA's key is: one more); a ``cat``
    of the two halves would need four more in backward (each half's gradient zero-filled and copied)."""
    if interleaved:
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x.roll(x.shape[-1] // 2, dims=-1)


def apply_core_attention_rotary(model_chunk: torch.nn.Module) -> bool:
    """Make a GPTModel chunk's rotary module a ``CoreAttentionRotaryEmbedding`` (same state, same
    frequencies) and link its table to the chunk's core attentions; returns whether the chunk
    uses RoPE. Only megatron-core's plain RotaryEmbedding (YaRN and others stay upstream's)."""
    rotary = getattr(model_chunk, "rotary_pos_emb", None)
    if rotary is None or type(rotary) not in (RotaryEmbedding, CoreAttentionRotaryEmbedding):
        return False
    rotary.__class__ = CoreAttentionRotaryEmbedding
    table = RotaryTable(rotary)
    for module in model_chunk.modules():
        if isinstance(module, VarlenDotProductAttention):
            module.rotary_table = table
    return True


def build_packed_rotary_freqs(rotary: RotaryEmbedding, position_ids: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """[t, 1, rot_dim] frequencies of each token of a packed micro-batch: megatron-core's own table
    for positions 0..max_seqlen-1, gathered by position id (positions restart per document)."""
    table = rotary.get_emb(max_seqlen)  # [max_seqlen, 1, 1, rot_dim]
    return table[position_ids.reshape(-1).to(table.device)].squeeze(1)


# ----------------------------------------------------------------------------- the module


class VarlenDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention with SDPA for causal attention, the packed path and the CP path."""

    supports_packed_sequences = True
    rotary_table: RotaryTable | None = None  # set by apply_core_attention_rotary on RoPE models

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, cp_comm_type=None, **kwargs):
        """Under CP: built on a config copy with CP 1 (upstream asserts CP == 1; compat.py local-attention-cp-assert)."""
        if cp_comm_type not in (None, "all_gather"):
            raise ValueError(f"--cp-comm-type {cp_comm_type}: our core attention implements all_gather only")
        built_on = cp_attention.get_config_without_cp(config)
        super().__init__(built_on, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        self.config = config

    def _rotates(self) -> bool:
        table = self.rotary_table
        if table is None or not table.active:
            return False
        skip = self.config.no_rope_freq  # megatron-core's per-layer "no RoPE here" list
        return not (skip and skip[self.layer_number - 1])

    def _uses_sdpa(self, attention_mask, attn_mask_type, attention_bias) -> bool:
        c = self.config
        return (
            attention_mask is None
            and attention_bias is None
            and attn_mask_type in (None, AttnMaskType.causal)
            and self.attn_mask_type == AttnMaskType.causal
            and c.window_size is None
            and getattr(c, "softmax_type", "vanilla") == "vanilla"
            and not c.apply_query_key_layer_scaling
        )

    def _dropout_p(self) -> float:
        return self.attention_dropout.p if self.training else 0.0

    def _with_rng(self, fn):
        """Dropout draws from megatron-core's model-parallel RNG stream, as its own attention does."""
        if self._dropout_p() > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return fn()
        return fn()

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if self.config.context_parallel_size > 1:
            masks = (attention_mask, attn_mask_type, attention_bias)
            return self._cp_forward(query, key, value, *masks, packed_seq_params)
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, packed_seq_params)
        if self._rotates():
            if key.shape[0] != query.shape[0]:
                raise ValueError(
                    f"RoPE in the core attention: {query.shape[0]} queries against {key.shape[0]} keys "
                    f"(a KV cache?); only training and evaluation forwards are supported"
                )
            interleaved = self.config.rotary_interleaved
            cos, sin = self.rotary_table.coefficients(query.shape[0], query.dtype, query.device, interleaved)
            query, key = rotate(query, cos, sin, interleaved), rotate(key, cos, sin, interleaved)
        if not self._uses_sdpa(attention_mask, attn_mask_type, attention_bias):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        p = self._dropout_p()
        return self._with_rng(lambda: causal_attention(query, key, value, self.softmax_scale, p))

    def _packed_forward(self, query, key, value, params: PackedSeqParams):
        if isinstance(params, StaticPackedParams):
            return self._static_packed_forward(query, key, value, params)
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences: qkv_format {params.qkv_format!r} is not supported (use 'thd')")
        if params.cu_seqlens_kv is not params.cu_seqlens_q and not torch.equal(
            params.cu_seqlens_q, params.cu_seqlens_kv
        ):
            raise ValueError("packed sequences: cu_seqlens_q and cu_seqlens_kv must be equal for self-attention")
        host = getattr(params, "cu_seqlens_host", None)
        if host is None:  # megatron-core's own PackedSeqParams: one device-to-host copy
            host = tuple(params.cu_seqlens_q.tolist())
        check_boundaries(host, query.shape[0])
        query, key = self._rotate_by_params(query, key, params)
        p = self._dropout_p()
        on_cuda = query.device.type == "cuda"
        available = on_cuda and flash_varlen_supported(query.device.index or 0, query.shape[-1])
        kernel = select_packed_kernel(query.device.type, p, available, query.dtype)
        if kernel == VARLEN:
            max_seqlen = params.max_seqlen_q or max(b - a for a, b in zip(host, host[1:]))
            return varlen_causal_attention(query, key, value, params.cu_seqlens_q, max_seqlen, self.softmax_scale)
        return self._with_rng(lambda: document_causal_attention(query, key, value, host, self.softmax_scale, p))

    def _rotate_by_params(self, query, key, params: PackedSeqParams):
        """q and k rotated by the micro-batch's per-token frequencies (packed, or any input under CP)."""
        if not self._rotates():
            return query, key
        if getattr(params, "rotary_freqs", None) is None:
            raise ValueError(
                f"{params.qkv_format} input with RoPE: the parameters carry no rotary frequencies; build them "
                f"with megatron_ext.training.step.get_packed_seq_params(microbatch, model)"
            )
        interleaved = self.config.rotary_interleaved
        cos, sin = packed_coefficients(params, query.dtype, interleaved)
        return rotate(query, cos, sin, interleaved), rotate(key, cos, sin, interleaved)

    def _cp_forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias, params):
        """Local q/k/v, THD [t/c, heads, hn] or [s/c, b, heads, hn] -> [t/c, np hn] or [s/c, b, np hn]."""
        masks = (self.attn_mask_type, attention_mask, attn_mask_type, attention_bias)
        cp_attention.check_attention_under_cp(self.config, *masks, self._dropout_p(), params)
        query, key = self._rotate_by_params(query, key, params)
        group = self.pg_collection.cp
        return cp_attention.context_parallel_core_attention(query, key, value, params, group, self.softmax_scale)

    def _static_packed_forward(self, query, key, value, params: StaticPackedParams):
        """The packed path on tensors alone (``prepare_static_packed_params`` checked the boundaries
        and chose the kernel once per micro-batch): bucketed ``max_seqlen``, ``cu_seqlens`` padded with
        zero-length documents, or each token's document index for the masked kernel."""
        if self._rotates():
            if params.rotary_cos is None:
                raise ValueError(
                    "packed sequences with RoPE: the static THD parameters carry no rotary "
                    "coefficients; build them with megatron_ext.training.step.get_packed_seq_params"
                )
            cos, sin = params.rotary_cos, params.rotary_sin
            query = rotate(query, cos, sin, self.config.rotary_interleaved)
            key = rotate(key, cos, sin, self.config.rotary_interleaved)
        if params.kernel == VARLEN:
            return varlen_causal_attention(
                query, key, value, params.cu_seqlens_q, params.max_seqlen_q, self.softmax_scale
            )
        p = self._dropout_p()
        return self._with_rng(
            lambda: masked_document_attention(query, key, value, params.document_ids, self.softmax_scale, p)
        )


def masked_document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    document_ids: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [t, np, hn], key/value [t, ng, hn], document_ids [t] (non-decreasing) -> [t, np * hn]: one
    SDPA whose mask allows a token its own document's earlier tokens (itself included, so no row is
    empty and no softmax sees only -inf). Shapes depend on t alone: what static shapes need on the
    CPU, where flash's varlen kernel does not exist ([t, t] mask: ``bench/varlen.py`` measured it 1.14x
    slower than the per-document loop eager runs use)."""
    t, np_, hn = query.shape
    groups = np_ // key.shape[1]
    allowed = (document_ids[:, None] == document_ids[None, :]) & torch.ones(
        t, t, dtype=torch.bool, device=query.device
    ).tril()
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, t, hn]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, dropout_p=dropout_p)
    return o.squeeze(0).transpose(0, 1).reshape(t, np_ * hn)


def bucket_max_seqlen(max_seqlen: int, num_tokens: int) -> int:
    """The next power of two >= ``max_seqlen``, at most ``num_tokens``: a handful of values per run
    (flash's kernel and a compiled graph key on it; a longer bound only sizes its grid)."""
    return min(num_tokens, 1 << max(0, max_seqlen - 1).bit_length())


def document_bound(num_documents: int, minimum: int = 16) -> int:
    """Documents ``cu_seqlens`` is padded to: the next power of two >= ``num_documents`` (>= ``minimum``)."""
    return max(minimum, 1 << max(0, num_documents - 1).bit_length())


def pad_boundaries(cu_seqlens: torch.Tensor, documents: int) -> torch.Tensor:
    """[n + 1] boundaries -> [documents + 1], the added documents zero-length at the end (each
    repeats the total). A zero-length document holds no query row, so no kernel computes a softmax
    for it; the masked kernel never sees it (it reads ``document_ids``)."""
    extra = documents + 1 - cu_seqlens.numel()
    if extra < 0:
        raise ValueError(f"{cu_seqlens.numel() - 1} documents exceed the bound {documents}")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(extra)]) if extra else cu_seqlens


def prepare_static_packed_params(
    params: PackedMicrobatchParams,
    num_tokens: int,
    dtype: torch.dtype,
    interleaved: bool,
    kernel: str,
    fixed_documents: int | None = None,
) -> StaticPackedParams:
    """``params`` (with ``cu_seqlens_host``) as ``StaticPackedParams``, once per micro-batch, outside
    the layers: boundaries checked, ``kernel`` (VARLEN or MASKED) recorded, ``cu_seqlens`` padded to
    ``document_bound``, ``max_seqlen`` bucketed, each token's document index for MASKED, rotary
    coefficients in the activations' ``dtype``. No device-to-host copy.

    ``fixed_documents`` (CUDA graphs): one shape and one value for every micro-batch of the run, since
    megatron-core 0.16.1 replays a layer's training graphs in capture order and matches each call's
    arguments exactly (shapes, and the ints of a dataclass): ``cu_seqlens`` padded to exactly
    ``fixed_documents``, ``max_seqlen`` the micro-batch's length (it only sizes the kernel's grid)."""
    host = params.cu_seqlens_host
    check_boundaries(host, num_tokens)
    if fixed_documents is not None and len(host) - 1 > fixed_documents:
        raise ValueError(
            f"a packed micro-batch has {len(host) - 1} documents, more than the {fixed_documents} that "
            f"--cuda-graph-impl local pads every micro-batch to (its captured layers replay one shape): "
            f"raise --cuda-graph-max-documents to at least {document_bound(len(host) - 1)}"
        )
    cu = params.cu_seqlens_q
    document_ids = None
    if kernel == MASKED:
        positions = torch.arange(num_tokens, device=cu.device, dtype=cu.dtype)
        document_ids = torch.searchsorted(cu[1:], positions, right=True)
    if fixed_documents is not None:
        cu, longest = pad_boundaries(cu, fixed_documents), num_tokens
    else:
        cu = pad_boundaries(cu, document_bound(len(host) - 1))
        longest = bucket_max_seqlen(max(b - a for a, b in zip(host, host[1:])), num_tokens)
    cos = sin = None
    if params.rotary_freqs is not None:
        cos, sin = rotary_coefficients(params.rotary_freqs, dtype, interleaved)
    return StaticPackedParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        kernel=kernel,
        document_ids=document_ids,
        rotary_cos=cos,
        rotary_sin=sin,
    )


def describe_attention_kernels(
    device_type: str,
    attention_dropout: float,
    transformer_engine: bool,
    packed: bool,
    dtype: torch.dtype,
    head_dim: int,
) -> str:
    """The start-up notice: which kernels this run's attention uses."""
    if transformer_engine:
        return "> attention: Transformer Engine (unpacked and packed THD)"
    line = "> attention: unpacked causal -> torch SDPA (megatron-core's kernel for explicit masks)"
    if packed:
        available = device_type == "cuda" and flash_varlen_supported(torch.cuda.current_device(), head_dim)
        kernel = select_packed_kernel(device_type, attention_dropout, available, dtype)
        reason = ""
        if kernel == PER_DOCUMENT:
            if device_type != "cuda":
                reason = " (varlen_attn needs CUDA)"
            elif get_varlen_attn() is None:
                reason = f" (torch {torch.__version__} has no varlen_attn: torch >= 2.10 does)"
            elif not available:
                major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
                reason = (
                    f" (flash varlen needs an sm80+ GPU and a head dimension that is a multiple of 8,"
                    f" at most 256: sm{major}{minor}, head dimension {head_dim})"
                )
            elif dtype not in HALF_DTYPES:
                reason = " (varlen_attn is bf16/fp16 only: --bf16 uses it)"
            else:
                reason = f" (varlen_attn has no dropout: --attention-dropout {attention_dropout})"
        line += f" | packed THD -> {kernel}{reason}"
    return line
