"""Messages between the API server and the engine core: typed dataclasses, msgpack on the wire.

Every message is `[type name, {field: value}]`; decoding looks the name up in a fixed table and builds
that dataclass, so nothing on a socket can name code to run (no pickle anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
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
class StartupFailed:
    message: str  # a bad model or setting, said in a line (the engine core then exits)


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


_TYPES = {cls.__name__: cls for cls in (AddRequest, AbortRequests, Shutdown, Ready, StartupFailed, RequestOutput,
                                        RequestFailed, EngineOutputs)}  # fmt: skip
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _TYPES.values()}
# Lists of messages inside a message travel as lists of field values (no names): an engine step's outputs
# are hundreds of them, and `dataclasses.asdict` (a deep copy) would cost milliseconds per step. A sender may
# put the tuple of an item's field values, in order, in place of the item (the engine core does, per step).
_NESTED = {"EngineOutputs": {"outputs": RequestOutput, "failed": RequestFailed}}


class ProtocolError(ValueError):
    """A frame that is not one of our messages (malformed, unknown type, wrong fields)."""


def encode(message: Any) -> bytes:
    name = type(message).__name__
    nested = _NESTED.get(name, {})
    body = {}
    for f in _FIELDS[type(message)]:
        value = getattr(message, f)
        if f in nested:
            names = _FIELDS[nested[f]]
            value = [item if isinstance(item, tuple) else [getattr(item, g) for g in names] for item in value]
        body[f] = value
    return msgpack.packb([name, body], use_bin_type=True)


def decode(frame: bytes) -> Any:
    try:
        name, body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        cls = _TYPES[name]
        if not set(body) <= set(_FIELDS[cls]):
            raise ProtocolError(f"unexpected fields {sorted(set(body) - set(_FIELDS[cls]))} in {name}")
        for key, item_cls in _NESTED.get(name, {}).items():
            if key in body:
                if any(len(item) > len(_FIELDS[item_cls]) for item in body[key]):
                    raise ProtocolError(f"too many fields in an item of {name}.{key}")
                body[key] = [item_cls(*item) for item in body[key]]
        return cls(**body)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack errors, bad shapes, unknown names: all just "not a message"
        raise ProtocolError(f"not a Kiln message: {type(e).__name__}") from None
