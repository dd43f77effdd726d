"""The prefix cache's changes as vLLM's KV-cache events, so a KV-aware router (llm-d's, vllm-router's kv_aware) can
send a request where its prefix lives.

The pool records an event whenever its hash map changes: a block's hash registered (BlockStored), a hash dropped
by eviction or `uncache` (BlockRemoved), every hash forgotten at once (AllBlocksCleared). A hash that is already
held by another block changes nothing and is not sent, so a subscriber sees each hash stored once until it is
removed. The engine core takes the events after each step and publishes them as one batch (engine/kv_events).

On the wire each event is what vLLM sends: a msgpack map tagged under "type" (vLLM since its PR #42892, v0.34.0
among them; the only form vllm-router's kv_aware policy reads), or, with the config's "layout": "array", the
positional array vLLM sent before (its `KVCacheEvent` structs were `array_like=True`), for subscribers that read
only that. llm-d's and SMG's decoders read both.

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
     "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A hash is the last 8 bytes of Kiln's sha256 block hash as an unsigned integer, as vLLM sends its own
(`maybe_convert_block_hash`, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). Consumers match prompts by `token_ids`, not by
re-deriving the engine's hash: the chain's `parent_block_hash` links a block to the one before it (None for a
prompt's first block).

NOTE: a model with several KV groups (hybrid.py) sends every group's blocks, each group's hashes its own; vLLM's
later `group_idx` field is not sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The tier a block lives in. vLLM names its device cache "GPU" (and "CPU" an offloaded tier, which routers rank
# lower): Kiln's KV cache is the engine's own tier on whatever device it runs.
MEDIUM_GPU = "GPU"


def external_hash(block_hash: bytes) -> int:
    """A block hash as events carry it: its last 8 bytes, big-endian, unsigned (vLLM's int form)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int

    def wire(self, layout: str = "map") -> dict[str, Any] | list[Any]:
        # lora_id and lora_name: Kiln serves no adapters
        fields = {
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": MEDIUM_GPU,
            "lora_name": None,
        }
        return _tagged("BlockStored", fields, layout)


@dataclass
class BlockRemoved:
    block_hashes: list[int]

    def wire(self, layout: str = "map") -> dict[str, Any] | list[Any]:
        return _tagged("BlockRemoved", {"block_hashes": self.block_hashes, "medium": MEDIUM_GPU}, layout)


@dataclass
class AllBlocksCleared:
    def wire(self, layout: str = "map") -> dict[str, Any] | list[Any]:
        return _tagged("AllBlocksCleared", {}, layout)


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
LAYOUTS = ("map", "array")


def _tagged(tag: str, fields: dict[str, Any], layout: str) -> dict[str, Any] | list[Any]:
    """The event as a map with its tag under "type", or as an array with its tag first and its fields in order."""
    return {"type": tag, **fields} if layout == "map" else [tag, *fields.values()]


@dataclass
class KVEventLog:
    """The events since `take`, in order. A block stored right after its parent joins the parent's BlockStored (one
    event for a request's new blocks, as vLLM sends them); consecutive removals share one BlockRemoved."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        parent = None if parent_hash is None else external_hash(parent_hash)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(external_hash(block_hash))
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([external_hash(block_hash)], parent, list(token_ids), len(token_ids)))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self.events.append(BlockRemoved([external_hash(block_hash)]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
