"""Attention: the `kiln::unified_attention` op, the forward context it reads, and the backends behind it."""

from kiln.backends.attention import torch_backend, triton_backend  # noqa: F401  (register the backends)
from kiln.backends.attention.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from kiln.backends.attention.op import (
    AttentionBackend,
    available_backends,
    default_backend_name,
    get_attention_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "available_backends",
    "default_backend_name",
    "get_attention_backend",
    "set_forward_context",
]
