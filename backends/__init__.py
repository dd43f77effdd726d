"""Attention: the `kiln::unified_attention` op, the forward context it reads, and the backends."""

from kiln.backends import torch_attention, triton_attention  # noqa: F401  (register the backends)
from kiln.backends.attention import (
    AttentionBackend,
    available_backends,
    default_backend_name,
    get_attention_backend,
)
from kiln.backends.forward_context import AttentionMetadata, ForwardContext, set_forward_context

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "available_backends",
    "default_backend_name",
    "get_attention_backend",
    "set_forward_context",
]
