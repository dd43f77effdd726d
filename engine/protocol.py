"""Messages between the API server and the engine core: typed dataclasses, msgpack on the wire.

Every message is `[type name, {field: value}]`; decoding looks the name up in a fixed table and builds
that dataclass, so nothing on a socket can name code to run (no pickle anywhere).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    startup_stats: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)  # as in EngineOutputs, so /metrics is right at once


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[list[float]]] | None = None  # per token: [[token_id, logprob, rank], ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestFailed:
    request_id: str
    message: str


@dataclass
class EngineOutputs:
    outputs: list[RequestOutput]
    failed: list[RequestFailed] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # running, waiting, kv usage, prefix hit rate, ...


_TYPES = {cls.__name__: cls for cls in (AddRequest, AbortRequests, Shutdown, Ready, RequestOutput, RequestFailed,
                                        EngineOutputs)}  # fmt: skip
_NESTED = {"EngineOutputs": {"outputs": RequestOutput, "failed": RequestFailed}}


class ProtocolError(ValueError):
    """A frame that is not one of our messages (malformed, unknown type, wrong fields)."""


def encode(message: Any) -> bytes:
    return msgpack.packb([type(message).__name__, asdict(message)], use_bin_type=True)


def decode(frame: bytes) -> Any:
    try:
        name, body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        cls = _TYPES[name]
        nested = _NESTED.get(name, {})
        body = {k: [nested[k](**item) for item in v] if k in nested else v for k, v in body.items()}
        allowed = {f.name for f in fields(cls)}
        if not set(body) <= allowed:
            raise ProtocolError(f"unexpected fields {sorted(set(body) - allowed)} in {name}")
        return cls(**body)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack errors, bad shapes, unknown names: all just "not a message"
        raise ProtocolError(f"not a Kiln message: {type(e).__name__}") from None
