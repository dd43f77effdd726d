"""Attention sinks (gpt-oss: a learned logit per head that joins each row's softmax denominator and attends to nothing)
in every attention path against the float64 reference: the torch backend, the Triton unified kernel (prefill chunks
and mixed batches, its lean loop and the general one, with and without a sliding window) and the split-KV decode,
whose merge of the partials must count each head's sink once."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.attention import AttentionMetadata, get_attention_backend
from kiln.backends.attention.triton_decode import split_kv_decode
from kiln.backends.attention.triton_unified import unified_attention, write_kv
from kiln.engine.config import ATTENTION_BACKENDS

from helpers.attention import make_paged_batch, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-3 if DEVICE == "cuda" else 1e-5


def sinks_of(num_heads: int, seed: int = 1) -> torch.Tensor:
    """Sinks from far below the scores (no effect) to far above them (the sink takes most of each row's weight)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_heads, generator=gen) * 2.0
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks.to(DEVICE)


def with_padded_request(q: torch.Tensor, m: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """The batch with one more request as the runner pads one: one token, no context (seq_len 0), its K/V bound
    for the scratch block 0's first slot."""
    qsl = torch.cat([m.query_start_loc_cpu, m.query_start_loc_cpu[-1:] + 1])
    seq_lens = torch.cat([m.seq_lens_cpu, torch.zeros(1, dtype=torch.int32)])
    table = torch.cat([m.block_table, torch.zeros_like(m.block_table[:1])])
    slots = torch.cat([m.slot_mapping, torch.zeros_like(m.slot_mapping[:1])])
    padded = AttentionMetadata(
        m.num_actual_tokens + 1,
        qsl.to(q.device),
        seq_lens.to(q.device),
        table,
        slots,
        m.max_query_len,
        m.max_seq_len,
        qsl,
        seq_lens,
    )
    return torch.cat([q, torch.randn_like(q[:1])]), padded


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("window", [0, 5, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 4, 80), (16, 2, 64)])
def test_sinks_against_the_reference(backend, window, num_heads, num_kv_heads, head_dim):
    """Decodes, fresh prefills and chunks continuing a prefill in one batch (the unified kernel), then decodes alone
    (the split-KV kernel): each head's sink in the denominator, the output far from the one without sinks."""
    query_lens, context_lens = [1, 9, 1, 40, 3], [30, 0, 1, 21, 47]
    sinks = sinks_of(num_heads)
    for lens in ((query_lens, context_lens), ([1, 1, 1], [3, 100, 300])):
        q, k, v, kv_cache, metadata, history = make_paged_batch(
            *lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, DEVICE
        )
        out = torch.zeros_like(q)
        scale = head_dim**-0.5
        get_attention_backend(backend).forward(q, k, v, kv_cache, metadata, scale, out, window, 0.0, sinks)
        ref = reference_attention(q, history, lens[0], scale, window, sinks=sinks)
        torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)
        without = reference_attention(q, history, lens[0], scale, window)
        assert (without - ref).abs().max() > 0.1


@pytest.mark.parametrize("num_splits,unsplit_tokens", [(1, 0), (4, 0), (8, 112), (8, 0)])
@pytest.mark.parametrize("window", [0, 64])
def test_split_kv_decode_counts_each_sink_once(num_splits, unsplit_tokens, window):
    """Contexts long enough for several partials a request: split 0 alone starts from the sink, so the merge adds it
    once (a sink counted in every partial would weigh num_splits times)."""
    query_lens, context_lens = [1, 1, 1, 1], [3, 100, 300, 17]
    q, k, v, kv_cache, metadata, history = make_paged_batch(
        query_lens, context_lens, 8, 2, 64, 16, torch.float32, DEVICE
    )
    sinks = sinks_of(8, seed=2) + 2.0  # (sinks that weigh about as much as the keys: a double count shows)
    out = torch.zeros_like(q)
    split_kv_decode(q, k, v, kv_cache, metadata, 0.125, out, num_splits, 16, None, unsplit_tokens, window, 0.0, sinks)
    ref = reference_attention(q, history, query_lens, 0.125, window, sinks=sinks)
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_unified_kernel_with_sinks_and_a_padded_request(head_dim):
    """16 query heads to a KV head (one query token a block) and a padded request after the real ones (one token, no
    context): the real rows match the reference, the padded row is finite; lean loop (64) and general (80)."""
    query_lens, context_lens = [9, 1, 14], [40, 70, 0]
    q, k, v, kv_cache, m, history = make_paged_batch(
        query_lens, context_lens, 16, 1, head_dim, 16, torch.float32, DEVICE
    )
    write_kv(kv_cache, k, v, m.slot_mapping)
    q_padded, padded = with_padded_request(q, m)
    sinks = sinks_of(16)
    out = torch.full_like(q_padded, float("nan"))
    unified_attention(q_padded, kv_cache, padded, head_dim**-0.5, out, 0, 0.0, sinks)
    ref = reference_attention(q, history, query_lens, head_dim**-0.5, sinks=sinks)
    torch.testing.assert_close(out[:-1].double().cpu(), ref, atol=TOL, rtol=TOL)
    assert torch.isfinite(out[-1]).all()
