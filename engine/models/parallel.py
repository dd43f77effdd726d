"""Tensor-parallel layers: each rank holds a slice of every large weight and computes its share.

    column-parallel (qkv, gate_up): W's output rows split; every rank gets the full input and
                                    returns its slice of the outputs (its heads, its MLP columns)
    row-parallel (o_proj, down):    W's input columns split; every rank returns a partial sum, and
                                    one all-reduce adds them up
    vocab-parallel embedding:       each rank looks up the ids in its vocab range, zeros elsewhere,
                                    and one all-reduce adds them up
    vocab-parallel LM head:         each rank scores its vocab range; an all-gather joins them

Weights are cut while loading: a layer reads only its rows or columns of a checkpoint tensor (a
safetensors slice, or a full tensor for dummy weights). With one rank every layer is the plain
layer it replaces, with no collective in its forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kiln.backends.kernels.collectives  # noqa: F401  (registers torch.ops.kiln.all_reduce_ / all_gather)
from kiln.engine.models import quantization
from kiln.engine.models.layers import Embedding, Linear, project

ShardId = str | int | None  # which Hugging Face tensor of a fused parameter ("q", "k", "v", 0, 1); None: unfused


@dataclass(frozen=True)
class TensorParallelShard:
    """This process's place among the tensor-parallel ranks; every layer slices its weights by it."""

    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {self.size}")
        return n // self.size


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads are split across ranks; with fewer KV heads than ranks each rank keeps a copy of one."""
    if num_kv_heads >= tp_size:
        return TensorParallelShard(0, tp_size).split(num_kv_heads, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of num_key_value_heads {num_kv_heads}")
    return 1


class ColumnParallelLinear(Linear):
    """Output rows split across ranks. Fused: each part (q, k, v or gate, up) is split on its own and
    the rank's slices are stacked, so a fused matmul still yields [q | k | v] of this rank's heads."""

    def __init__(self, in_features: int, parts: dict[ShardId, tuple[int, int, int]], bias: bool) -> None:
        # parts: shard id -> (rows of the full checkpoint tensor, first row this rank reads, rows it reads)
        super().__init__(in_features, sum(size for _, _, size in parts.values()), bias=bias)
        self.parts = parts

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        if param_name in ("weight_scale", "input_scale"):  # an FP8 layer's
            return quantization.scale_parts(self, param_name, [(s, rows) for s, (rows, _, _) in self.parts.items()])
        tail = (self.in_features,) if param_name == "weight" else ()
        return [(shard, (rows, *tail)) for shard, (rows, _, _) in self.parts.items()]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        offset = 0
        for key, (_, start, size) in self.parts.items():
            if key == shard:
                if param_name in ("weight_scale", "input_scale"):
                    quantization.load_scale(self, param_name, source, offset, start, size)
                elif param_name == "weight" and quantization.quantized_at_load(self):
                    quantization.quantize_rows(self, source[start : start + size], offset)
                else:
                    getattr(self, param_name)[offset : offset + size].copy_(source[start : start + size])
                return
            offset += size
        raise KeyError(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul, this rank's attention heads and KV heads only."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, shard: TensorParallelShard
    ) -> None:
        self.num_heads = shard.split(num_heads, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, shard.size)
        # NOTE: a replicated KV head serves the query heads of tp_size / num_kv_heads consecutive ranks.
        first_kv_head = shard.rank * self.num_kv_heads * num_kv_heads // max(num_kv_heads, shard.size)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        parts = {"q": (num_heads * head_dim, shard.rank * q, q)}
        for name in ("k", "v"):
            parts[name] = (num_kv_heads * head_dim, first_kv_head * head_dim, kv)
        super().__init__(hidden_size, parts, bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate and up in one matmul, this rank's intermediate columns of each."""

    def __init__(self, in_features: int, out_features: list[int], shard: TensorParallelShard) -> None:
        parts = {}
        for i, full in enumerate(out_features):
            size = shard.split(full, "intermediate_size")
            parts[i] = (full, shard.rank * size, size)
        super().__init__(in_features, parts, bias=False)


class RowParallelLinear(Linear):
    """Input columns split across ranks; partial sums are all-reduced, then the (whole) bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: TensorParallelShard) -> None:
        super().__init__(shard.split(in_features, "projection input size"), out_features, bias=bias)
        self.full_in_features, self.tp_size, self.start = in_features, shard.size, shard.rank * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = project(x, self, with_bias=False)
        torch.ops.kiln.all_reduce_(out)
        return out if self.bias is None else out + self.bias

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        if param_name in ("weight_scale", "input_scale"):  # an FP8 layer's
            return quantization.scale_parts(self, param_name, [(None, self.out_features)])
        return [(None, (self.out_features, self.full_in_features) if param_name == "weight" else (self.out_features,))]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        if param_name in ("weight_scale", "input_scale"):
            quantization.load_scale(self, param_name, source, 0, 0, self.out_features)
        elif param_name == "weight" and quantization.quantized_at_load(self):
            quantization.quantize_rows(self, source[:, self.start : self.start + self.in_features], 0)
        elif param_name == "weight":
            self.weight.copy_(source[:, self.start : self.start + self.in_features])
        else:
            self.bias.copy_(source[:])


class VocabParallelEmbedding(Embedding):
    """Rows of the vocabulary split across ranks (the last rank's slice padded with zero rows)."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: TensorParallelShard) -> None:
        per_rank = -(-vocab_size // shard.size)
        super().__init__(per_rank, hidden_size)
        self.vocab_size, self.tp_size = vocab_size, shard.size
        self.start = min(shard.rank * per_rank, vocab_size)  # a tiny vocabulary can leave the last ranks none
        self.end = min(self.start + per_rank, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        # NOTE: ids of other ranks look up local row 0 (a real row) and are zeroed after, never read padding.
        hidden = F.embedding((input_ids - self.start) * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        torch.ops.kiln.all_reduce_(hidden)
        return hidden

    def checkpoint_parts(self, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
        return [(None, (self.vocab_size, self.embedding_dim))]

    def load_weight(self, param_name: str, source: Any, shard: ShardId) -> None:
        rows = self.end - self.start
        self.weight[:rows].copy_(source[self.start : self.end])
        self.weight[rows:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """Scores of this rank's vocab rows; the all-gather gives every rank the whole vocabulary's logits.

    Shares the embedding's layout, so tied embeddings tie shard to shard."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return torch.ops.kiln.all_gather(logits, self.tp_size)[:, : self.vocab_size]


def checkpoint_parts(module: nn.Module, param_name: str) -> list[tuple[ShardId, tuple[int, ...]]]:
    """The checkpoint tensors a parameter is cut from, in order, with their full (unsharded) shapes."""
    if hasattr(module, "checkpoint_parts"):
        return module.checkpoint_parts(param_name)
    return [(None, tuple(getattr(module, param_name).shape))]


def load_part(module: nn.Module, param_name: str, source: Any, shard: ShardId) -> None:
    """Copy this rank's slice of a checkpoint tensor (a safetensors slice or a tensor) into the parameter."""
    if hasattr(module, "load_weight"):
        module.load_weight(param_name, source, shard)
    else:
        getattr(module, param_name).copy_(source[...])  # ([...]: a 0-dim tensor's whole, as [:] is not)
