"""The CP token layout (context_parallel/layout.py) against brute force: who holds which token, the
keys each local query attends to, the gather order and the per-document balance."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_ext.context_parallel.layout import (
    build_document_layout,
    build_layout,
    build_row_layout,
    head_tail_chunks,
    slice_local,
)


def te_partitioned_indices(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Transformer Engine's ``thd_get_partitioned_indices`` as its kernel computes it
    (``thd_partition_indices_kernel``): per sequence, the rank's chunk r then chunk 2c-1-r."""
    out = []
    for s, e in zip(cu_seqlens, cu_seqlens[1:]):
        k = (e - s) // (2 * cp_size)
        out += list(range(s + cp_rank * k, s + (cp_rank + 1) * k))
        out += list(range(s + (2 * cp_size - 1 - cp_rank) * k, s + (2 * cp_size - cp_rank) * k))
    return out


def random_documents(rng: random.Random, count: int, multiple: int) -> list[int]:
    lengths = [multiple * rng.randint(1, 6) for _ in range(count)]
    return [0] + list(np.cumsum(lengths).tolist())


def allowed_keys(layout, attention_bounds: list[int]) -> list[set[int]]:
    """Per local query, the global keys its pieces let it see."""
    out = []
    for ls, le, ks, ke in layout.pieces:
        for j in range(le - ls):
            pos = ke - (le - ls) + j
            assert layout.local_index[ls + j].item() == pos
            out.append(set(range(ks, pos + 1)))
    return out


def brute_force_keys(positions: list[int], bounds: list[int]) -> list[set[int]]:
    out = []
    for pos in positions:
        doc = max(i for i, b in enumerate(bounds[:-1]) if b <= pos)
        out.append(set(range(bounds[doc], pos + 1)))
    return out


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_per_document_layout_is_transformer_engines(cp_size, seed):
    cu = random_documents(random.Random(seed), 5 + seed, 2 * cp_size)
    for r in range(cp_size):
        layout = build_document_layout(cu, cp_size, r)
        assert layout.local_index.tolist() == te_partitioned_indices(cu, cp_size, r)
        assert brute_force_keys(layout.local_index.tolist(), cu) == allowed_keys(layout, cu)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_every_token_once_and_the_gather_order_restores_positions(cp_size):
    cu = random_documents(random.Random(7), 9, 2 * cp_size)
    layouts = [build_document_layout(cu, cp_size, r) for r in range(cp_size)]
    gathered = torch.cat([x.local_index for x in layouts])  # what an all-gather of local positions gives
    assert sorted(gathered.tolist()) == list(range(cu[-1]))
    assert all(x.num_local_tokens == cu[-1] // cp_size for x in layouts)
    for x in layouts:  # every rank computes the same gather order
        assert torch.equal(gathered[x.gather_index], torch.arange(cu[-1]))


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_per_document_attention_work_is_equal_on_every_rank(cp_size):
    cu = random_documents(random.Random(cp_size), 11, 2 * cp_size)
    work = [build_document_layout(cu, cp_size, r).attention_pairs() for r in range(cp_size)]
    assert len(set(work)) == 1
    total = sum((e - s) * (e - s + 1) // 2 for s, e in zip(cu, cu[1:]))
    assert sum(work) == total  # every causal pair of every document, once


def test_row_layout_cuts_pieces_at_documents():
    # two windows of 16 tokens, documents crossing the chunk boundaries (GPTDataset windows)
    docs = [0, 3, 11, 16, 21, 32]
    for cp_size in (2, 4):
        layouts = [build_row_layout(16, 2, cp_size, r, docs) for r in range(cp_size)]
        for x in layouts:
            assert brute_force_keys(x.local_index.tolist(), docs) == allowed_keys(x, docs)
            assert all(ks <= ke - (le - ls) for ls, le, ks, ke in x.pieces)
        assert sum(x.attention_pairs() for x in layouts) == sum(
            (e - s) * (e - s + 1) // 2 for s, e in zip(docs, docs[1:])
        )
    # without documents: one row, the rows' chunks
    assert build_row_layout(8, 1, 2, 0).local_index.tolist() == [0, 1, 6, 7]
    assert build_row_layout(8, 1, 2, 0).pieces == ((0, 2, 0, 2), (2, 4, 0, 8))
    assert build_row_layout(8, 1, 2, 1).pieces == ((0, 4, 0, 6),)  # chunks 1 and 2 touch: one piece


def test_head_tail_chunks():
    assert head_tail_chunks(10, 16, 2, 0) == ((10, 14), (22, 26))
    assert head_tail_chunks(10, 16, 2, 1) == ((14, 18), (18, 22))


def test_slice_local_takes_the_positions_in_local_order():
    layout = build_document_layout([0, 8, 12], 2, 1)
    tokens = torch.arange(100, 112).unsqueeze(0)  # [1, T]
    assert slice_local(tokens, layout).tolist() == [[102, 103, 104, 105, 109, 110]]


@pytest.mark.parametrize(
    ("split", "docs", "match"),
    [
        ([0, 6, 12], [0, 6, 12], "span of 6 tokens"),  # not a multiple of 2c = 4
        ([0, 8, 16], [0, 8, 15], "do not tile 16"),
        ([0, 8, 8, 16], [0, 16], "do not tile 16"),  # an empty span
    ],
)
def test_bad_boundaries_are_one_clear_error(split, docs, match):
    with pytest.raises(ValueError, match=match):
        build_layout(split, docs, 2, 0)
