"""Parse and validate OpenAI-style request bodies into prompts and SamplingParams.

Every way a body can be wrong becomes an `APIError` with a 4xx status and the offending parameter
named, in OpenAI's error shape; nothing here may raise anything else on bad input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kiln.engine.sampling_params import SamplingParams, StructuredOutputParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    prompts: list[str | list[int]] | None  # completions
    messages: list[dict[str, Any]] | None  # chat
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top logprobs per token (chat: top_logprobs when logprobs is true)


def _check(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a finite number", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object"}  # fmt: skip
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _sampling_params(body: dict[str, Any], max_tokens_default: int | None, logprobs: int | None) -> SamplingParams:
    num = (int, float)
    stop = body.get("stop")
    is_strings = isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    if stop is not None and not (isinstance(stop, str) or is_strings):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    logit_bias = _check(body, "logit_bias", (dict,))
    if logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in logit_bias.items()}
        except (TypeError, ValueError):
            raise APIError(400, "'logit_bias' keys must be token ids", "logit_bias") from None
        if len(logit_bias) > 1024:
            raise APIError(400, "'logit_bias' may hold at most 1024 entries", "logit_bias")
    stop_token_ids = _check(body, "stop_token_ids", (list,))
    kwargs = dict(
        n=_check(body, "n", (int,), 1),
        temperature=_check(body, "temperature", num, 1.0),
        top_p=_check(body, "top_p", num, 1.0),
        top_k=_check(body, "top_k", (int,), 0),
        min_p=_check(body, "min_p", num, 0.0),
        presence_penalty=_check(body, "presence_penalty", num, 0.0),
        frequency_penalty=_check(body, "frequency_penalty", num, 0.0),
        repetition_penalty=_check(body, "repetition_penalty", num, 1.0),
        logit_bias=logit_bias,
        seed=_check(body, "seed", (int,)),
        max_tokens=_check(body, "max_tokens", (int,), max_tokens_default),
        min_tokens=_check(body, "min_tokens", (int,), 0),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_check(body, "ignore_eos", (bool,), False),
        logprobs=logprobs,
        skip_special_tokens=_check(body, "skip_special_tokens", (bool,), True),
        include_stop_str_in_output=_check(body, "include_stop_str_in_output", (bool,), False),
        structured_output=_structured_output(body),
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        param = message.split()[0].strip("'`:") if message else None
        raise APIError(400, message, param if param in kwargs else None) from None


def _structured_output(body: dict[str, Any]) -> StructuredOutputParams | None:
    """OpenAI's `response_format` (json_object, json_schema), or Kiln's `guided_regex` / `guided_grammar`."""
    given: list[tuple[str, dict[str, Any]]] = []  # (parameter, StructuredOutputParams fields)
    response_format = _check(body, "response_format", (dict,))
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(400, "'response_format.type' must be one of 'text', 'json_object', 'json_schema'",
                           "response_format")  # fmt: skip
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                               "response_format")  # fmt: skip
            given.append(("response_format", {"json": schema}))
    for name, field in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = _check(body, name, (str,))
        if value is not None:
            given.append((name, {field: value}))
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, "give at most one of response_format (json_object or json_schema), guided_regex and "
                       "guided_grammar", given[1][0])  # fmt: skip
    name, fields = given[0]
    try:
        return StructuredOutputParams(**fields)
    except ValueError as e:
        raise APIError(400, str(e), name) from None


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _check(body, "stream", (bool,), False)
    options = _check(body, "stream_options", (dict,), {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, include_usage


def parse_completion(body: Any) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or (isinstance(p, list) and all(_is_token_id(t) for t in p)) for p in prompt
    ):
        prompts = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    if len(prompts) > 256:
        raise APIError(400, "at most 256 prompts per request", "prompt")
    if any(len(p) == 0 for p in prompts):
        raise APIError(400, "the prompt is empty", "prompt")
    logprobs = _check(body, "logprobs", (int,))
    stream, include_usage = _stream_flags(body)
    params = _sampling_params(body, 16, logprobs)
    echo = _check(body, "echo", (bool,), False)
    _check(body, "user", (str,))
    return ParsedRequest(prompts, None, params, stream, include_usage, echo, logprobs)


def parse_chat(body: Any) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise APIError(400, "each message needs a string 'role' and a string 'content'", "messages")
    want_logprobs = _check(body, "logprobs", (bool,), False)
    top = _check(body, "top_logprobs", (int,), 0)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    stream, include_usage = _stream_flags(body)
    params = _sampling_params(body, None, top if want_logprobs else None)
    _check(body, "user", (str,))
    return ParsedRequest(None, messages, params, stream, include_usage, False, top if want_logprobs else None)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
