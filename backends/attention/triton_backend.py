"""The `triton` attention backend: decode-only batches take the split-KV kernel (`triton_decode`), which writes the
new K/V itself; any batch with a prefill chunk the K/V write and the unified kernel (`triton_unified`)."""

from __future__ import annotations

import torch

from kiln.backends.attention.decode_plan import decode_config, decode_splits
from kiln.backends.attention.forward_context import AttentionMetadata
from kiln.backends.attention.op import AttentionBackend, register_backend
from kiln.backends.attention.triton_decode import split_kv_decode
from kiln.backends.attention.triton_unified import unified_attention, write_kv


@register_backend
class TritonAttentionBackend(AttentionBackend):
    """Decode-only batches take the split-KV path; anything with a prefill chunk the unified kernel."""

    name = "triton"
    sliding_window = True
    logit_softcap = True
    attention_sinks = True

    def __init__(self) -> None:
        self.num_sms = torch.cuda.get_device_properties().multi_processor_count if torch.cuda.is_available() else 8

    def decode_variant(
        self, num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, tuple[int, int, int]]:
        """The split count (the kernel is specialised on it) and the launch config."""
        splits = decode_splits(num_reqs, num_heads, num_kv_heads, head_dim, self.num_sms)
        return splits, decode_config(num_reqs * num_kv_heads * splits, num_reqs, head_dim=head_dim)

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
        if metadata.max_query_len == 1:
            num_reqs, (num_heads, head_dim) = metadata.seq_lens.shape[0], query.shape[1:]
            num_splits = decode_splits(num_reqs, num_heads, kv_cache.shape[-2], head_dim, self.num_sms)
            split_kv_decode(
                query,
                key,
                value,
                kv_cache,
                metadata,
                scale,
                output,
                num_splits,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )
        else:
            write_kv(kv_cache, key, value, metadata.slot_mapping[: metadata.num_actual_tokens])
            unified_attention(query, kv_cache, metadata, scale, output, window, softcap, sinks)
