"""The local spec's layer norms, with Megatron sequence parallelism.

megatron-core 0.16.1's local spec (no Transformer Engine) builds its norms with ``WrappedTorchNorm``
(always for RMSNorm; for LayerNorm too when Apex is absent), which refuses
``config.sequence_parallel`` ("sequence parallel not supported by torch LayerNorm"): so without TE,
``--sequence-parallel`` could not run at all, on GPUs or CPUs. A norm needs nothing special under
sequence parallelism except that its weight and bias gradients, computed on a slice of the sequence
on each tensor-parallel rank, are summed over those ranks: megatron-core's ``finalize_model_grads``
does that for every parameter marked ``sequence_parallel`` (as its Apex ``FusedLayerNorm`` and
TE's norms mark theirs). ``TorchNorm`` is upstream's torch module, marked the same way.

``--apply-layernorm-1p`` (megatron-core's ``layernorm_zero_centered_gamma``, which its torch norm
refuses): the norm scales by ``1 + weight`` and its weight starts at 0 (Apex's and TE's norms do
the same), so a weight decayed towards 0 pulls the scale towards 1, not 0, and the stored values are
small where bf16 has most precision. The model equals a plain norm whose weight is ``1 + ours``:
``tools/convert_checkpoint.py`` adds the 1 on the way to Hugging Face and subtracts it on the way back.

``--qk-layernorm`` (Qwen3): ``HeadNorm``, the same norms over each head's ``kv_channels`` of the
queries and keys (``[s, b, heads / TP, d]``, before RoPE). Its input is the whole sequence, even
under sequence parallelism (``linear_qkv`` gathers it), but only this TP rank's heads: its gradient
is a partial sum over heads, which megatron-core's ``finalize_model_grads`` sums over TP because
``TransformerConfig.qk_layernorm`` is set (it matches ``q_layernorm``/``k_layernorm`` in the name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerNorm1P(torch.nn.LayerNorm):
    """LayerNorm scaled by ``1 + weight`` (zero-centred gamma), weight initialised to 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (in the weight's dtype, as Apex's FusedLayerNorm adds its 1)
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(torch.nn.RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (zero-centred gamma), weight initialised to 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class TorchNorm:
    """torch's LayerNorm or RMSNorm (``config.normalization``) for megatron-core's ``build_module``
    (the signature of ``WrappedTorchNorm``), their (1 + gamma) forms under
    ``config.layernorm_zero_centered_gamma``, its parameters marked for the sequence-parallel
    gradient all-reduce when ``config.sequence_parallel``."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        unsupported = [
            name for name in ("persist_layer_norm", "memory_efficient_layer_norm") if getattr(config, name, False)
        ]
        if unsupported:
            raise ValueError(f"the local spec's torch norm does not support {', '.join(unsupported)}")
        if config.layernorm_zero_centered_gamma:
            kinds = {"LayerNorm": LayerNorm1P, "RMSNorm": RMSNorm1P}
        else:
            kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"--normalization {config.normalization}: the local spec supports LayerNorm and RMSNorm")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class HeadNorm:
    """The per-head query/key norm of ``--qk-layernorm`` for megatron-core's ``build_module``
    (``SelfAttention`` passes ``hidden_size=kv_channels``): ``TorchNorm``, its parameters not marked
    ``sequence_parallel`` (it sees the whole sequence; its TP sum is over heads, and comes from
    ``config.qk_layernorm`` alone)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        norm = TorchNorm(config, hidden_size, eps)
        for param in norm.parameters():
            param.sequence_parallel = False
        return norm
