"""The local spec's layer norms, with Megatron sequence parallelism.

megatron-core 0.16.1's local spec (no Transformer Engine) builds its norms with ``WrappedTorchNorm``
(always for RMSNorm; for LayerNorm too when Apex is absent), which refuses
``config.sequence_parallel`` ("sequence parallel not supported by torch LayerNorm"): so without TE,
``--sequence-parallel`` could not run at all, on GPUs or CPUs. A norm needs nothing special under
sequence parallelism except that its weight and bias gradients, computed on a slice of the sequence
on each tensor-parallel rank, are summed over those ranks: megatron-core's ``finalize_model_grads``
does that for every parameter marked ``sequence_parallel`` (as its Apex ``FusedLayerNorm`` and
TE's norms mark theirs). ``TorchNorm`` is upstream's torch module, marked the same way.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """torch's LayerNorm or RMSNorm (``config.normalization``) for megatron-core's ``build_module``
    (the signature of ``WrappedTorchNorm``), its parameters marked for the sequence-parallel
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
            name
            for name in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm")
            if getattr(config, name, False)
        ]
        if unsupported:
            raise ValueError(f"the local spec's torch norm does not support {', '.join(unsupported)}")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"--normalization {config.normalization}: the local spec supports LayerNorm and RMSNorm")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
