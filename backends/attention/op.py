"""The `kiln::unified_attention` custom op and the attention-backend registry.

Every layer's attention is one call of this op. To Dynamo it is opaque (a registered custom op with a
fake implementation), which is where the compiled graph is split into pieces; at run time it hands
the layer's query/key/value to the selected backend together with the step's forward context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable

import torch

from kiln.backends.attention.forward_context import AttentionMetadata, get_forward_context


class AttentionBackend(ABC):
    """Paged attention over a mixed batch of prefill chunks and decodes.

    Contract for `forward`:
      1. write `key`/`value` of the first `metadata.num_actual_tokens` tokens into `kv_cache` at
         `metadata.slot_mapping` (slot = block_id * block_size + offset);
      2. for each request i, let its queries be rows `query_start_loc[i]:query_start_loc[i+1]` and its
         context `seq_lens[i]` tokens read through `block_table[i]`; query j of a request with q_len
         queries sits at position `seq_lens[i] - q_len + j` and attends causally to positions <= it;
      3. write the result into `output` `[T, num_heads, head_dim]`; rows past `num_actual_tokens` are
         padding and may hold anything;
      4. with a `window` (a backend whose `sliding_window` is True), a query at position p sees only the keys at
         positions > p - window;
      5. with a `softcap` (a backend whose `logit_softcap` is True), each score s (q.k * scale) is
         softcap * tanh(s / softcap) before the softmax (Gemma 2);
      6. with `sinks` (a backend whose `attention_sinks` is True; [num_heads] float32, this rank's heads), head h's
         sink is one more logit in each of its rows' softmax denominators, attending to nothing (gpt-oss):
         out = sum_j e^(s_j) v_j / (e^(sinks[h]) + sum_j e^(s_j)).
    Writing before reading is what makes a request's own chunk, and blocks another request of the same
    batch just cached, visible to attention.
    """

    name: str
    cudagraph_safe: bool = True  # no host sync and no data-dependent launch shapes: may run inside a CUDA graph
    sliding_window: bool = False  # reads `window`: with False a windowed model is capped at its window
    logit_softcap: bool = False  # reads `softcap`: with False a soft-capped model is refused at start
    attention_sinks: bool = False  # reads `sinks`: with False a model with sinks is refused at its first step

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,  # [T, num_heads, head_dim], written in place
        window: int = 0,  # a query at position p sees keys after p - window only (0: all of them)
        softcap: float = 0.0,  # scores softcap * tanh(s / softcap) (0: as they are)
        sinks: torch.Tensor | None = None,  # [num_heads] float32: a logit per head joining each row's denominator
    ) -> None: ...

    def decode_variant(self, num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int) -> Hashable:
        """What a decode-only batch of `num_reqs` requests runs as (kernel variant, launch config) with this many
        query and kv heads (on this GPU) of `head_dim`: batches of one variant need one warm-up between them before
        any is captured or served. One variant unless overridden."""
        return None


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name; an unknown name is a readable error listing the choices."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    return _BACKENDS[name]()


def default_backend_name(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


# NOTE: the op writes into an `output` the caller allocated. Under piecewise CUDA graphs that buffer is
# allocated inside the captured piece before it, so every tensor crossing a piece boundary has a fixed
# address from replay to replay; a returned tensor would be a fresh eager allocation each step.
# `sinks`, unlike a window or a soft-cap, is a weight of the model (a learned logit per head), so it is an argument:
# a parameter keeps its address, as a CUDA graph needs.
@torch.library.custom_op("kiln::unified_attention", mutates_args=("output",))
def unified_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_index: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> None:
    attend(query, key, value, output, layer_index, scale, sinks)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_index: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> None:
    """The op's body: the step's backend on this layer's KV cache. Where no tracer looks (eager layers, and
    the split graph's attention pieces once compiled), it is called directly: a `custom_op` call through the
    dispatcher costs tens of microseconds of Python more, once a layer every step."""
    context = get_forward_context()
    kv_cache = context.kv_caches[layer_index]
    window = context.windows[layer_index] if context.windows else 0
    softcap = context.softcaps[layer_index] if context.softcaps else 0.0
    metadata = context.attn_metadata
    if context.layer_groups:  # (the layer's KV group: its block table and slots)
        metadata = metadata.groups[context.layer_groups[layer_index]]
    if sinks is not None:
        if not context.backend.attention_sinks:
            raise ValueError(f"the {context.backend.name} attention backend has no attention sinks, as the model needs")
        context.backend.forward(query, key, value, kv_cache, metadata, scale, output, window, softcap, sinks)
    elif window or softcap:
        context.backend.forward(query, key, value, kv_cache, metadata, scale, output, window, softcap)
    else:
        context.backend.forward(query, key, value, kv_cache, metadata, scale, output)


@unified_attention.register_fake
def _(query, key, value, output, layer_index: int, scale: float, sinks=None) -> None:
    return None
