"""What ``planning/calibration.json`` claims physically, at GPU sizes no CPU test measures: selective
recompute (megatron-core checkpoints the core attention, keeping its inputs instead of what SDPA
saves) never predicts more activations a layer than no recompute, for every family and precision;
and each layer coefficient is whole bytes per element (the features count elements of saved 2- or
4-byte tensors, each storage once), which an ill-conditioned fit breaks (it once had Llama bf16
selective's ``one`` at -82.06 bytes a token, and predicted more with selective than without)."""

from __future__ import annotations

import pytest

from megatron_ext.planning.memory import Shape, get_saved_per_token, load_calibration

# Llama-style shapes: bench/gpu_memory.py's (hidden 2048, 16 heads in 4 groups, seq 4096), Llama 3
# 70B's at TP 8 with SP, and without GQA; GPT families take a group per head.
SHAPES = [
    Shape(2048, 16, 4, 5632, 4096, 1, 50304, 1, False, True),
    Shape(8192, 64, 8, 28672, 8192, 1, 128256, 8, True, True),
    Shape(4096, 32, 32, 11008, 4096, 2, 32000, 2, False, True),
]


@pytest.mark.parametrize("family", ["gpt", "gpt-nodropout", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_selective_recompute_saves_no_more_than_none(family, precision):
    for s in SHAPES:
        if family != "llama":
            s = Shape(
                s.hidden,
                s.heads,
                s.heads,
                s.ffn,
                s.seq_length,
                s.micro_batch,
                s.padded_vocab,
                s.tp,
                s.sequence_parallel,
                False,
            )
        none = get_saved_per_token(family, precision, "none", s).layer
        selective = get_saved_per_token(family, precision, "selective", s).layer
        assert 0 < selective <= none, (s, selective, none)


def test_layer_coefficients_are_whole_bytes():
    for bucket, entry in load_calibration().items():
        for name, c in entry["layer"].items():
            assert abs(c - round(c)) < 1e-6, f"{bucket} layer {name}: {c}"
