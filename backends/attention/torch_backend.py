"""Reference attention backend in plain torch: correct on CPU and GPU, not fast.

Decodes (one query per request) are batched into one padded SDPA call; prefill chunks run one SDPA
call each with a bottom-right-aligned causal mask; a sliding window masks the keys before it; a soft-cap or
attention sinks write the softmax out. It reads
`_cpu` metadata, so it syncs with the host and cannot live inside a CUDA graph; the Triton backend is the
one for graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.backends.attention.forward_context import AttentionMetadata
from kiln.backends.attention.op import AttentionBackend, register_backend

FP8_MAX = 448.0


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """K and V into their slots; an FP8 cache (scale 1.0) holds them rounded to e4m3, saturated at +-448."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if kv_cache.dtype == torch.float8_e4m3fn:
        key, value = key.clamp(-FP8_MAX, FP8_MAX), value.clamp(-FP8_MAX, FP8_MAX)
    cache = _indexable(kv_cache)
    cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = _indexable(key.to(kv_cache.dtype))
    cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = _indexable(value.to(kv_cache.dtype))


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes (torch's indexing and index_put lack float8 kernels on some devices and versions)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `seq_len` positions of one request, in `dtype`: [seq_len, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_ids[:num_blocks].long()
    k = _indexable(kv_cache)[0, blocks].view(kv_cache.dtype).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = _indexable(kv_cache)[1, blocks].view(kv_cache.dtype).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return k.to(dtype), v.to(dtype)


@register_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    cudagraph_safe = False
    sliding_window = True
    logit_softcap = True
    attention_sinks = True

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        metadata: AttentionMetadata,
        scale: float,
        output,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        num_tokens = metadata.num_actual_tokens
        write_kv(kv_cache, key[:num_tokens], value[:num_tokens], metadata.slot_mapping[:num_tokens])
        starts = metadata.query_start_loc_cpu
        query_lens = (starts[1:] - starts[:-1]).tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        decode_rows = [i for i, q_len in enumerate(query_lens) if q_len == 1]
        if decode_rows:
            self._decode(query, kv_cache, metadata, decode_rows, scale, output, window, softcap, sinks)
        for i, q_len in enumerate(query_lens):
            if q_len > 1:
                start = int(starts[i])
                k, v = gather_kv(kv_cache, metadata.block_table[i], seq_lens[i], query.dtype)
                q = query[start : start + q_len]
                output[start : start + q_len] = _attend(q, k, v, seq_lens[i], scale, window, softcap, sinks)

    def _decode(
        self, query, kv_cache, metadata, rows: list[int], scale: float, output, window: int, softcap: float, sinks
    ):
        """All single-query requests at once: gather their blocks padded to the longest context."""
        device = query.device
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        block_size = kv_cache.shape[2]
        rows_t = torch.tensor(rows, device=device)
        seq_lens = metadata.seq_lens_cpu[rows].to(device)
        max_len = int(metadata.seq_lens_cpu[rows].max())
        num_blocks = -(-max_len // block_size)
        blocks = metadata.block_table[rows_t, :num_blocks].long()  # [B, nb]
        k = kv_cache[0, blocks].reshape(len(rows), -1, num_kv_heads, head_dim)[:, :max_len].to(query.dtype)
        v = kv_cache[1, blocks].reshape(len(rows), -1, num_kv_heads, head_dim)[:, :max_len].to(query.dtype)
        token_index = metadata.query_start_loc_cpu[rows].to(device).long()
        q = query[token_index].unsqueeze(2)  # [B, H, 1, D]
        positions = torch.arange(max_len, device=device)[None, :]
        mask = positions < seq_lens[:, None]  # [B, L]
        if window:  # the query sits at seq_len - 1
            mask &= positions > seq_lens[:, None] - 1 - window
        out = _sdpa(q, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale, softcap, sinks)
        output[token_index] = out.squeeze(2)


def _attend(q, k, v, seq_len: int, scale: float, window: int, softcap: float, sinks=None) -> torch.Tensor:
    """Causal attention of q_len queries that are the last q_len of seq_len positions (within `window`)."""
    q_len = q.shape[0]
    plain = not softcap and sinks is None
    if q_len == seq_len and (not window or window >= seq_len) and plain:  # SDPA may pick a flash kernel
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)
    positions = torch.arange(seq_len, device=q.device)
    query_positions = (seq_len - q_len + torch.arange(q_len, device=q.device))[:, None]
    mask = positions[None, :] <= query_positions
    if window:
        mask &= positions[None, :] > query_positions - window
    out = _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap, sinks)
    return out.transpose(0, 1)


def _sdpa(q, k, v, mask: torch.Tensor, scale: float, softcap: float, sinks=None) -> torch.Tensor:
    """SDPA ([.., H, L, D], grouped kv heads) under a boolean mask; with a `softcap` or `sinks`, written out in
    float32: the scores capped by softcap * tanh(s / softcap) (as Hugging Face's Gemma 2 does), then each head's sink
    as one more column of the softmax, dropped after it (as Hugging Face's gpt-oss does)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # ([H] against [.., H, Lq, 1])
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)
