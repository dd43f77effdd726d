"""Attention backends against a float64 reference: mixed prefill chunks and decodes, random block tables."""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_paged_batch, reference_attention

from kiln.backends import get_attention_backend

CASES = [
    # (query_lens, context_lens): decodes (q=1), fresh prefills (ctx=0), chunks continuing a prefill
    ([1, 1, 1], [5, 17, 40]),
    ([7], [0]),
    ([1, 9, 1, 16, 3], [30, 0, 1, 21, 47]),
]


@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (8, 1, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_torch_backend_matches_reference(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size):
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu"
    )
    scale = head_dim**-0.5
    out = get_attention_backend("torch").forward(q, k, v, kv_cache, metadata, scale)
    torch.testing.assert_close(out.double(), reference_attention(q, history, query_lens, scale), atol=1e-5, rtol=1e-5)
    # the new K/V landed in the cache at their slots
    flat_k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[metadata.slot_mapping], k)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch"):
        get_attention_backend("flash")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_on_gpu(dtype):
    query_lens, context_lens = [1] * 30 + [64, 200], [700] * 30 + [0, 300]
    q, k, v, kv_cache, metadata, history = make_paged_batch(query_lens, context_lens, 32, 8, 128, 16, dtype, "cuda")
    out = get_attention_backend("torch").forward(q, k, v, kv_cache, metadata, 128**-0.5)
    ref = reference_attention(q, history, query_lens, 128**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
