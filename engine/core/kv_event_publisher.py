"""KV-cache events over ZMQ as vLLM publishes them (vllm/distributed/kv_events.py `ZmqEventPublisher`), for a
KV-aware router to subscribe to.

    engine step ──events──► queue ──► publisher thread ──PUB──► (topic, seq, batch)        every subscriber
                                              │ keeps the last buffer_steps batches
                                    ROUTER ◄──┴──► (topic, seq, batch) ... then (b"", -1, b"")   one that asked

Each batch is msgpack `[ts, [event, ...], data_parallel_rank]` (vLLM's `KVEventBatch`, array-like), its events
in `kiln.cache.kv_events`'s layouts (vLLM's tagged maps unless the config asks for arrays). `seq` is the batch's
number, 8 bytes big-endian, from 0 with no gaps: a subscriber that sees one skipped sends the first number it missed
(8 bytes big-endian) to the replay socket, gets the batches kept from there on in the same three frames, then the
end marker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgpack
import zmq

from kiln.cache.kv_events import KVCacheEvent, KVEventLog
from kiln.engine.kv_events_config import KVEventsConfig

logger = logging.getLogger("kiln")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def rank_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Rank r's address: a tcp port moved up by r (0 stays: the system picks), an ipc path with `_dp{r}` (vLLM's)."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, port = endpoint.rsplit(":", 1)
    return endpoint if port == "0" else f"{base}:{int(port) + data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


class KVEventPublisher:
    """Publishes what `log` (the block pool's, `BlockPool.record_kv_events`) gathered, a batch each `flush`."""

    def __init__(self, config: KVEventsConfig, log: KVEventLog, data_parallel_rank: int = 0) -> None:
        self.log = log
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = rank_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = rank_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._layout = config.layout
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        # NOTE: made here so a taken port fails the start-up in a line; used by the thread alone from then on
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # room for a whole replay and its end marker, however slowly the asker reads
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot open {self.endpoint} / {self.replay_endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kiln-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def flush(self) -> None:
        """The events since the last flush (a step's) as one batch, if there are any."""
        if self.log.events:
            self.publish(self.log.take())

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """`events` as one batch. Past max_queue_size waiting batches, this one is dropped (and logged): the engine
        never waits for a subscriber."""
        try:
            self._queue.put_nowait((time.time(), [event.wire(self._layout) for event in events]))
        except queue.Full:
            logger.warning("KV-event queue full: a batch of %d events dropped", len(events))

    def close(self) -> None:
        """Send what is queued (for up to two seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = msgpack.packb([ts, events, self.data_parallel_rank], use_bin_type=True)
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._kept.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [asker's identity, b"", first seq] (a REQ or DEALER asker)
            logger.warning("dropped a malformed KV-event replay request")
            return
        asker, _, first = frames
        start = int.from_bytes(first, "big")
        for seq, payload in self._kept:
            if seq >= start:
                self._replay.send_multipart((asker, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((asker, b"", b"", END_SEQ, b""))
