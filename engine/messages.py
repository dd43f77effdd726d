"""Messages between the API server and the engine core: typed dataclasses, msgpack on the wire.

Both processes import this module and neither imports the other: it is the whole interface between them. Every
message is `[type name, {field: value}]`; decoding looks the name up in a fixed table and builds that dataclass, so
nothing on a socket can name code to run (no pickle anywhere). `EngineCoreOutput` and `RequestFailed` are also what
`EngineCore.step` returns in-process (offline `LLM`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from operator import attrgetter
from typing import Any

import msgpack

from kiln.engine.config import EngineConfig


@dataclass(frozen=True)
class EngineCoreArgs:
    """What the engine-core process is started with, as JSON on its standard input (not a socket message)."""

    config: dict[str, Any]  # EngineConfig's fields
    input_address: str  # ZMQ endpoints it binds: requests in, outputs out
    output_address: str
    parent_pid: int  # the API server: when it is gone, the engine stops
    data_parallel_rank: int = 0  # which of --data-parallel-size engine cores this is (its KV events say so)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineCoreArgs:
        return cls(**json.loads(text))

    def engine_config(self) -> EngineConfig:
        config = dict(self.config)
        if config.get("cudagraph_capture_sizes") is not None:  # (JSON has no tuples)
            config["cudagraph_capture_sizes"] = tuple(config["cudagraph_capture_sizes"])
        return EngineConfig(**config)


# A token's log-probabilities: [[token_id, logprob, rank], ...], the sampled token first, then the top-N not already
# listed (rank 1 = the most likely token)
TokenLogprobs = list[list[float]]


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
class Alive:
    """The engine core's heartbeat, sent each second by a thread of its own whatever its step is doing: only a
    process that has stopped altogether (SIGSTOP, a deadlock holding the interpreter) goes quiet."""


@dataclass
class Ready:
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    tokenizer_class: str | None  # the transformers class that reads the tokenizer (None: the built-in one)
    startup_stats: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)  # as in EngineOutputs, so /metrics is right at once


@dataclass
class StartupFailed:
    message: str  # a bad model or setting, said in a line (the engine core then exits)


@dataclass
class EngineFailed:
    message: str  # why the engine core is stopping (a tensor-parallel rank gone), said before it exits


@dataclass(slots=True)  # one per running request per step: slots make each lighter to build
class EngineCoreOutput:
    """A request's new tokens from one step; `finish_reason` set on its last."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one entry per new token, when the request asked
    finish_reason: str | None = None  # "stop" (EOS, a stop token, a grammar's end), "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the request's first tokens, when it asked


@dataclass
class RequestFailed:
    request_id: str
    message: str


@dataclass
class EngineOutputs:
    outputs: list[EngineCoreOutput]
    failed: list[RequestFailed] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # running, waiting, kv usage, prefix hit rate, ...


_MESSAGES = (
    AddRequest,
    AbortRequests,
    Shutdown,
    Alive,
    Ready,
    StartupFailed,
    EngineFailed,
    EngineCoreOutput,
    RequestFailed,
    EngineOutputs,
)
_TYPES = {cls.__name__: cls for cls in _MESSAGES}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _TYPES.values()}
# Lists of messages inside a message travel as lists of field values (no names): an engine step's outputs
# are hundreds of them, and `dataclasses.asdict` (a deep copy) would cost milliseconds per step.
_NESTED = {"EngineOutputs": {"outputs": EngineCoreOutput, "failed": RequestFailed}}
_VALUES = {cls: attrgetter(*_FIELDS[cls]) for cls in (EngineCoreOutput, RequestFailed)}


class ProtocolError(ValueError):
    """A frame that is not one of our messages (malformed, unknown type, wrong fields)."""


def encode(message: Any) -> bytes:
    name = type(message).__name__
    nested = _NESTED.get(name, {})
    body = {}
    for f in _FIELDS[type(message)]:
        value = getattr(message, f)
        if f in nested:
            values = _VALUES[nested[f]]
            value = [values(item) for item in value]
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
        message = cls(**body)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack errors, bad shapes, unknown names: all just "not a message"
        raise ProtocolError(f"not a Kiln message: {type(e).__name__}") from None
    if (problem := _INPUT_CHECKS.get(cls, lambda _: None)(message)) is not None:
        raise ProtocolError(f"a malformed {name}: {problem}")
    return message


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _add_request_problem(m: AddRequest) -> str | None:
    if not isinstance(m.request_id, str):
        return "request_id is not a string"
    if not isinstance(m.prompt_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in m.prompt_token_ids
    ):
        return "prompt_token_ids is not a list of integers"
    if not isinstance(m.params, dict) or not all(isinstance(k, str) for k in m.params):
        return "params is not a dict of named fields"
    return None


# What the engine core's input socket takes is checked field by field (the engine acts on it); the other messages
# come from the engine core itself
_INPUT_CHECKS = {
    AddRequest: _add_request_problem,
    AbortRequests: lambda m: None if _is_str_list(m.request_ids) else "request_ids is not a list of strings",
}
