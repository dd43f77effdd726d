"""A float64 reference for paged attention over a mixed batch, written without the paged layout."""

from __future__ import annotations

import random

import torch

from kiln.backends.attention import AttentionMetadata


def make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Random K/V history per request, scattered into random non-contiguous blocks of a paged cache.

    Returns (query, key, value, kv_cache, metadata, history) where `history[i]` holds request i's full
    contiguous K and V (context then the new tokens) for the reference.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(seq_lens), max_blocks + 2, dtype=torch.int32)
    queries, keys, values, slots, history = [], [], [], [], []
    for i, (q_len, ctx, s) in enumerate(zip(query_lens, context_lens, seq_lens)):
        ids = [free.pop() for _ in range(blocks_per_req[i])]
        block_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):  # the context is already in the cache
            kv_cache[0, ids[pos // block_size], pos % block_size] = k[pos]
            kv_cache[1, ids[pos // block_size], pos % block_size] = v[pos]
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx, s)]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        history.append((k, v))
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    qsl = torch.tensor(starts, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens_t,
    )
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return cat(queries), cat(keys), cat(values), kv_cache.to(device), metadata, history


def reference_attention(
    query, history, query_lens, scale, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Per request, in float64: softmax(q k^T * scale) v with a causal mask aligned to the end (and with a
    `window`, a query at position p sees the keys after p - window only; with a `softcap`, each score s is
    softcap * tanh(s / softcap); with `sinks` [heads], head h's sink one more logit of each row's softmax, its
    weight dropped)."""
    outs, start = [], 0
    for (k, v), q_len in zip(history, query_lens):
        q = query[start : start + q_len].double().cpu()
        start += q_len
        k, v = k.double(), v.double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_positions = (s - q_len + torch.arange(q_len))[:, None]
        allowed = torch.arange(s)[None, :] <= query_positions
        if window:
            allowed &= torch.arange(s)[None, :] > query_positions - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu().view(-1, 1, 1).expand(-1, q_len, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, v))
    return torch.cat(outs)
