"""The `kiln::unified_attention` custom op and the attention-backend registry.

Every layer's attention is one call of this op. To Dynamo it is opaque (a registered custom op with a
fake implementation), which is where the compiled graph is split into pieces; at run time it hands
the layer's query/key/value to the selected backend together with the step's forward context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from kiln.backends import fused_kernels
from kiln.backends.forward_context import AttentionMetadata, get_forward_context


class AttentionBackend(ABC):
    """Paged attention over a mixed batch of prefill chunks and decodes.

    Contract for `forward`:
      1. write `key`/`value` of the first `metadata.num_actual_tokens` tokens into `kv_cache` at
         `metadata.slot_mapping` (slot = block_id * block_size + offset);
      2. for each request i, let its queries be rows `query_start_loc[i]:query_start_loc[i+1]` and its
         context `seq_lens[i]` tokens read through `block_table[i]`; query j of a request with q_len
         queries sits at position `seq_lens[i] - q_len + j` and attends causally to positions <= it;
      3. write the result into `output` `[T, num_heads, head_dim]`; rows past `num_actual_tokens` are
         padding and may hold anything.
    Writing before reading is what makes a request's own chunk, and blocks another request of the same
    batch just cached, visible to attention.
    """

    name: str
    cudagraph_safe: bool = True  # no host sync and no data-dependent launch shapes: may run inside a CUDA graph

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
        qk_norm_rope: QKNormRope | None = None,
    ) -> None: ...


class QKNormRope(NamedTuple):
    """Qwen3's per-head RMSNorm of q and k and the rotary after it, handed to the attention op (compiled, on the
    GPU) instead of run before it: a decode-only batch's kernel applies it to the q and k it loads anyway, one
    kernel a layer fewer. cos and sin: [T, head_dim / 2], each token's rotation, in the model's dtype."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, key) normalised and rotated, new contiguous tensors (by `fused_kernels.qk_norm_rope`)."""
        cos, sin, eps = self.cos, self.sin, self.eps
        q = fused_kernels.qk_norm_rope(query, cos, sin, self.q_weight, self.q_weight, eps, query.shape[1])
        return q, fused_kernels.qk_norm_rope(key, cos, sin, self.k_weight, self.k_weight, eps, 0)


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
@torch.library.custom_op("kiln::unified_attention", mutates_args=("output",))
def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_index: int, scale: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0,
) -> None:  # fmt: skip
    attend(query, key, value, output, layer_index, scale, cos, sin, q_norm_weight, k_norm_weight, eps)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_index: int,
           scale: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
           q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
           eps: float = 0.0) -> None:  # fmt: skip
    """The op's body: the step's backend on this layer's KV cache. Where no tracer looks (eager layers, and
    the split graph's attention pieces once compiled), it is called directly: through the dispatcher, a
    `custom_op` call costs ~25 µs more (measured on the CPU machine), once a layer every step. With cos, sin and
    the norm weights, query and key are Qwen3's raw projections, normalised and rotated here (`QKNormRope`)."""
    context = get_forward_context()
    transform = None if cos is None else QKNormRope(cos, sin, q_norm_weight, k_norm_weight, eps)
    context.backend.forward(query, key, value, context.kv_caches[layer_index], context.attn_metadata, scale, output,
                            transform)  # fmt: skip


@unified_attention.register_fake
def _(query, key, value, output, layer_index: int, scale: float, cos=None, sin=None, q_norm_weight=None,
      k_norm_weight=None, eps: float = 0.0) -> None:  # fmt: skip
    return None
