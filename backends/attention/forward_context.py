"""The per-step forward context: the one place where step metadata reaches the attention op.

The model runner sets it around each forward pass; `kiln::unified_attention` reads it. Nothing else
about a step is global. Keeping the metadata out of the op's arguments is what lets Dynamo trace the
model once: the graph sees only `(query, key, value, layer_index, scale)`, never per-step shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kiln.backends.attention.op import AttentionBackend


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch reads and writes the paged KV cache.

    A batch of B requests packs their new tokens back to back::

        tokens:          | req0: 5 prefill-chunk tokens | req1: 1 decode | req2: 3 | pad |
        query_start_loc: 0                              5                6        9
        seq_lens:        context + new tokens of each request (what attention sees after the write)

    Device tensors live in persistent buffers the runner refills each step (CUDA-graph safe); the
    `_cpu` copies serve backends that plan on the host.
    """

    num_actual_tokens: int  # tokens in the batch before padding
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [T_padded] int64; NOTE: padded tokens map into the scratch block 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # with several KV groups (kiln.cache.groups): each group's metadata, its own block table and slot mapping (the
    # first is this one); empty with one
    groups: tuple[AttentionMetadata, ...] = ()
    # a model with recurrent layers (Gated DeltaNet): each request's row of their state tensors [B] int32 (padded
    # requests: the scratch row 0), on the device and the host
    state_slots: torch.Tensor | None = None
    state_slots_cpu: torch.Tensor | None = None
    # with speculative decoding too, [2, B] int32 on the device: the tokens of each request's last step it folds into
    # its state first, and whether this step's are folded later instead (it verifies drafts; linear_attention/op.py)
    state_folds: torch.Tensor | None = None
    # what ops derive from this step's metadata alone, computed by the first layer that needs it (op.py's plan)
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    def with_groups(self, block_tables: torch.Tensor, slot_mappings: torch.Tensor) -> AttentionMetadata:
        """This metadata for each KV group: block_tables [B, G, width] and slot_mappings [G, T] give each its
        own (views: a group's table rows are G * width apart)."""
        groups = [
            dataclasses.replace(self, block_table=block_tables[:, g], slot_mapping=slot_mappings[g])
            for g in range(slot_mappings.shape[0])
        ]
        groups[0].groups = tuple(groups)
        return groups[0]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one [2, num_blocks, block_size, num_kv_heads, head_dim] per layer
    backend: AttentionBackend
    cudagraph_size: int | None = None  # set: compiled pieces replay (or capture) their graph for this size
    windows: tuple[int, ...] = ()  # each layer's sliding window (0: none); empty: no layer slides
    softcaps: tuple[float, ...] = ()  # each layer's attention score cap (0: none); empty: no layer caps
    layer_groups: tuple[int, ...] = ()  # each layer's KV group (attn_metadata.groups' index); empty: one group
    # each recurrent layer's (conv_states [S, K - 1, D], ssm_states [S, Hv, Dk, Dv]), by its state index
    recurrent_states: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # speculative decoding (EAGLE-3): where `kiln::save_hidden` copies the target layers' states [max_tokens, n * H]
    aux_hidden: torch.Tensor | None = None
    # with speculative decoding, each recurrent layer's record of its slots' last step (linear_attention.op.DraftRecord)
    draft_records: tuple = ()


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _forward_context
    previous, _forward_context = _forward_context, context
    try:
        yield
    finally:
        _forward_context = previous


def current_cudagraph_size() -> int | None:
    return None if _forward_context is None else _forward_context.cudagraph_size


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("kiln::unified_attention called outside set_forward_context()")
    return _forward_context
