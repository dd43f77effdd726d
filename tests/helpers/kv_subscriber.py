"""A KV-cache event subscriber written from vLLM's documented schema, not from Kiln's code: what a KV-aware router
(llm-d's indexer, vllm-router's kv_aware) does with a vLLM worker's events.

vLLM (vllm/distributed/kv_events.py; docs "KV cache events"): a PUB socket sends three frames, (topic, seq as 8
bytes big-endian, payload); the payload is a msgpack `KVEventBatch` [ts, events, data_parallel_rank]; each event a
map with its class name under "type" (vLLM since PR #42892) or, before, an array with the tag first and the fields
in declaration order: BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name), BlockRemoved(block_hashes, medium), AllBlocksCleared(). Like llm-d's decoder, this one reads both. A
replay ROUTER socket takes a start seq (8 bytes big-endian) and answers with (topic, seq, payload) frames, then
(b"", -1, b"").
"""

from __future__ import annotations

import time

import msgpack
import zmq

END = -1
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def as_map(event) -> dict:
    """An event as a map, whichever layout it came in (a positional array's missing trailing fields are None)."""
    if isinstance(event, dict):
        return event
    tag, *values = event
    names = FIELDS[tag]
    assert len(values) <= len(names) or tag == "BlockStored", event  # (later vLLMs append fields to BlockStored)
    return {"type": tag, **dict(zip(names, values))}


class KVEventSubscriber:
    """Keeps what each worker's cache holds: hash -> the token prefix that block ends (its parents' tokens first),
    and checks every event as it applies it (a violation raises AssertionError)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.next_seq = 0  # the batch applied next
        self.live: dict[int, tuple[int, ...]] = {}  # stored and not removed: hash -> tokens from the prompt's start
        self.stored_count: dict[int, int] = {}  # times each hash was stored
        self.removed: list[int] = []
        self.cleared = 0
        self.batches: list[tuple[int, list]] = []  # (seq, batch) as applied
        self.replayed: list[int] = []  # seqs that came through the replay socket
        self.layouts: set[str] = set()  # "map", "array": how the events came

    def close(self) -> None:
        self.context.destroy(linger=0)

    def poll(self, seconds: float = 0.5, drop: set[int] | None = None) -> int:
        """Apply the batches that arrive within `seconds`; a gap in seq is filled from the replay socket first.
        `drop`: seqs to pass over as if lost on the way (a test's gap). Returns how many were applied."""
        applied, deadline = 0, time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000)):
                break
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if drop and seq in drop:
                continue
            if seq < self.next_seq:  # (already had it from a replay)
                continue
            if seq > self.next_seq:
                applied += self.replay(self.next_seq, until=seq)
            self.apply(seq, msgpack.unpackb(payload, raw=False))
            applied += 1
        return applied

    def replay(self, start: int, until: int) -> int:
        assert self.replay_endpoint is not None, f"batches {start}..{until - 1} were lost and there is no replay"
        asker = self.context.socket(zmq.DEALER)
        asker.connect(self.replay_endpoint)
        asker.send_multipart((b"", start.to_bytes(8, "big")))  # the empty frame: a REQ socket's envelope
        applied = 0
        try:
            while True:
                assert asker.poll(5000), "no answer from the replay socket"
                _, topic, seq_bytes, payload = asker.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END:
                    break
                assert topic == self.topic
                if self.next_seq <= seq < until:
                    self.apply(seq, msgpack.unpackb(payload, raw=False))
                    self.replayed.append(seq)
                    applied += 1
        finally:
            asker.close(linger=0)
        assert self.next_seq == until, f"the replay left a gap: have up to {self.next_seq}, the stream is at {until}"
        return applied

    def apply(self, seq: int, batch: list) -> None:
        assert seq == self.next_seq, f"batch {seq} out of order (expected {self.next_seq})"
        ts, events, rank = batch  # KVEventBatch, array-like
        assert isinstance(ts, float) and rank == 0
        for event in events:
            self._apply(event)
        self.batches.append((seq, batch))
        self.next_seq = seq + 1

    def _apply(self, raw: dict | list) -> None:
        self.layouts.add("map" if isinstance(raw, dict) else "array")
        event = as_map(raw)
        tag = event["type"]
        if tag == "BlockStored":
            hashes, parent, token_ids = event["block_hashes"], event["parent_block_hash"], event["token_ids"]
            block_size = event["block_size"]
            assert event["lora_id"] is None and event["lora_name"] is None and event["medium"] == "GPU"
            assert len(token_ids) == block_size * len(hashes)
            prefix = () if parent is None else self.live[parent]  # a parent is a block the worker holds
            for i, block_hash in enumerate(hashes):
                assert block_hash not in self.live, f"block {block_hash} stored twice"
                assert isinstance(block_hash, int) and 0 <= block_hash < 2**64
                prefix = prefix + tuple(token_ids[i * block_size : (i + 1) * block_size])
                self.live[block_hash] = prefix
                self.stored_count[block_hash] = self.stored_count.get(block_hash, 0) + 1
        elif tag == "BlockRemoved":
            hashes = event["block_hashes"]
            assert event["medium"] == "GPU"
            for block_hash in hashes:
                assert block_hash in self.live, f"block {block_hash} removed but never stored"
                del self.live[block_hash]
                self.removed.append(block_hash)
        elif tag == "AllBlocksCleared":
            assert event == {"type": "AllBlocksCleared"}
            self.live.clear()
            self.cleared += 1
        else:
            raise AssertionError(f"unknown event {tag!r}")

    def cached_prefix_tokens(self, token_ids: list[int], block_size: int) -> int:
        """How many of `token_ids`' first tokens the worker holds in whole blocks, as a router would score it."""
        held = set(self.live.values())
        n = 0
        while (n + 1) * block_size <= len(token_ids) and tuple(token_ids[: (n + 1) * block_size]) in held:
            n += 1
        return n * block_size
