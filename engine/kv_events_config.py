"""`--kv-events-config`: vLLM's JSON keys for publishing KV-cache events (vllm/config/kv_events.py), checked at
start-up. The engine core publishes with `kiln.engine.core.kv_event_publisher`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")
LAYOUTS = ("map", "array")  # as kiln.cache.kv_events writes them


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when events are enabled (vLLM's default)
    # the PUB socket: bound where the address has a wildcard (tcp://*:5557) or is ipc://, else connected to (a
    # subscriber that binds, as llm-d's indexer does); with data parallelism rank r's port is this one + r
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket a subscriber asks for missed batches on (always bound)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it, batches to a slow subscriber are dropped
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""  # the first frame of every message (subscribers filter on it; vllm-router's take only "")
    # Kiln's own key: "map" (vLLM's events since v0.23, tagged maps) or "array" (the positional arrays before)
    layout: str = "map"

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: unknown publisher {self.publisher!r}; choose one of {PUBLISHERS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"kv_events_config: unknown layout {self.layout!r}; choose one of {LAYOUTS}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be a positive integer, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(("tcp://", "ipc://"))):
                raise ValueError(f"kv_events_config: {name} must be a tcp:// or ipc:// address, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """From the CLI's JSON text, a dict, or itself; a wrong one is one ValueError."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; Kiln reads {sorted(known)}")
        return cls(**value)
