"""Parse and validate OpenAI-style request bodies into prompts and SamplingParams.

Every way a body can be wrong becomes an `APIError` with a 4xx status and the offending parameter
named, in OpenAI's error shape; nothing here may raise anything else on bad input.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kiln.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
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
    tools: list[dict[str, Any]] | None = None  # chat: shown to the model through its template
    constraint_param: str | None = None  # the parameter params.structured_output came from
    tool_choice: str = "none"  # none, auto, required, or function (a named one: tool_function)
    tool_function: str | None = None
    parallel_tool_calls: bool = True


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
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _sampling_params(
    body: dict[str, Any], max_tokens_default: int | None, logprobs: int | None, defaults: dict[str, Any]
) -> tuple[SamplingParams, str | None]:
    """The request's SamplingParams, and the parameter its structured-output constraint came from. `defaults`: the
    model's generation_config.json sampling fields, for those the body leaves out."""
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
        temperature=_check(body, "temperature", num, defaults.get("temperature", 1.0)),
        top_p=_check(body, "top_p", num, defaults.get("top_p", 1.0)),
        top_k=_check(body, "top_k", (int,), defaults.get("top_k", 0)),
        min_p=_check(body, "min_p", num, defaults.get("min_p", 0.0)),
        presence_penalty=_check(body, "presence_penalty", num, 0.0),
        frequency_penalty=_check(body, "frequency_penalty", num, 0.0),
        repetition_penalty=_check(body, "repetition_penalty", num, defaults.get("repetition_penalty", 1.0)),
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
    )
    kwargs["structured_output"], constraint_param = _structured_output(body)  # (checked after the fields above)
    try:
        return SamplingParams(**kwargs), constraint_param
    except (ValueError, TypeError) as e:
        message = str(e)
        param = message.split()[0].strip("'`:") if message else None
        raise APIError(400, message, param if param in kwargs else None) from None


def _structured_output(body: dict[str, Any]) -> tuple[StructuredOutputParams | None, str | None]:
    """OpenAI's `response_format` (json_object, json_schema), or vLLM's `guided_json`, `guided_choice`,
    `guided_regex`, `guided_grammar`; with the parameter it came from."""
    given: list[tuple[str, dict[str, Any]]] = []  # (parameter, StructuredOutputParams fields)
    response_format = _check(body, "response_format", (dict,))
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(
                400, "'response_format.type' must be one of 'text', 'json_object', 'json_schema'", "response_format"
            )
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "'response_format.json_schema.schema' must be a JSON schema object", "response_format"
                )
            given.append(("response_format", {"json": schema}))
    for name, field in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = _check(body, name, (str,))
        if value is not None:
            given.append((name, {field: value}))
    guided_json = _check(body, "guided_json", (dict, str))
    if isinstance(guided_json, str):
        try:
            guided_json = json.loads(guided_json)
        except (ValueError, RecursionError):
            guided_json = None
        if not isinstance(guided_json, dict):
            raise APIError(400, "'guided_json' must be a JSON schema: an object, or its JSON text", "guided_json")
    if guided_json is not None:
        given.append(("guided_json", {"json": guided_json}))
    choices = _check(body, "guided_choice", (list,))
    if choices is not None:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise APIError(400, "'guided_choice' must be a non-empty list of non-empty strings", "guided_choice")
        given.append(("guided_choice", {"grammar": "root ::= " + " | ".join(map(_ebnf_string, choices))}))
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(
            400,
            "give at most one of response_format (json_object or json_schema), guided_json, "
            "guided_choice, guided_regex and guided_grammar",
            given[1][0],
        )
    name, fields = given[0]
    try:
        return StructuredOutputParams(**fields), name
    except ValueError as e:
        raise APIError(400, str(e), name) from None


def _ebnf_string(text: str) -> str:
    """`text` as a quoted EBNF literal, matching exactly itself (guided_choice)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def escape(c: str) -> str:
        if c in escapes or c.isprintable():
            return escapes.get(c, c)
        return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"

    return '"' + "".join(map(escape, text)) + '"'


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _check(body, "stream", (bool,), False)
    if body.get("stream_options") is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    options = _check(body, "stream_options", (dict,), {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, include_usage


def parse_completion(body: Any, defaults: dict[str, Any] | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or (isinstance(p, list) and all(_is_token_id(t) for t in p)) for p in prompt)
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
    params, constraint_param = _sampling_params(body, 16, logprobs, defaults or {})
    echo = _check(body, "echo", (bool,), False)
    if echo and logprobs is not None:
        raise APIError(
            400,
            "'echo' with 'logprobs' asks for the prompt's log-probabilities, which this server does not compute",
            "echo",
        )
    if _check(body, "suffix", (str,)):
        raise APIError(400, "'suffix' is not supported", "suffix")
    best_of = _check(body, "best_of", (int,))
    if best_of is not None and best_of != params.n:
        raise APIError(400, "'best_of' is not supported (other than equal to 'n')", "best_of")
    _check(body, "user", (str,))
    return ParsedRequest(prompts, None, params, stream, include_usage, echo, logprobs, None, constraint_param)


def parse_chat(body: Any, defaults: dict[str, Any] | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    messages = [_chat_message(m, i) for i, m in enumerate(messages)]
    tools, tool_choice, tool_function = _tools(body)
    parallel_tool_calls = _check(body, "parallel_tool_calls", (bool,), True)
    want_logprobs = _check(body, "logprobs", (bool,), False)
    top = _check(body, "top_logprobs", (int,), 0)
    if body.get("top_logprobs") is not None and not want_logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"'top_logprobs' must lie in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    stream, include_usage = _stream_flags(body)
    params, constraint_param = _sampling_params(body, None, top if want_logprobs else None, defaults or {})
    _check(body, "user", (str,))
    return ParsedRequest(
        None,
        messages,
        params,
        stream,
        include_usage,
        False,
        top if want_logprobs else None,
        tools,
        constraint_param,
        tool_choice,
        tool_function,
        parallel_tool_calls,
    )


def _chat_message(m: Any, i: int) -> dict[str, Any]:
    """A message as chat templates take it: its content a string (text parts joined by newlines), an assistant's
    tool calls with their arguments as objects."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{where} needs a string 'role'", "messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError(
                400, f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported", "messages"
            )
        content = "\n".join(p["text"] for p in content)
    tool_calls = m.get("tool_calls")
    if content is None and m["role"] == "assistant" and tool_calls:
        content = ""
    if not isinstance(content, str):
        raise APIError(400, f"{where} needs 'content': a string or a list of text parts", "messages")
    message = {**m, "content": content}  # other keys (e.g. reasoning_content) as given
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise APIError(400, f"{where}: '{key}' must be a string", "messages")
    if tool_calls is not None:
        if m["role"] != "assistant" or not isinstance(tool_calls, list):
            raise APIError(400, f"{where}: 'tool_calls' is a list, on an assistant message", "messages")
        message["tool_calls"] = [_tool_call(call, where) for call in tool_calls]
    return message


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)  # as templates render them: an object, not its JSON text
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise APIError(
            400, f"{where}: a tool call is {{'function': {{'name': ..., 'arguments': a JSON object}}}}", "messages"
        )
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": name, "arguments": arguments}}


MAX_TOOLS = 128  # as OpenAI
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """`tools` (shown to the model by the chat template), `tool_choice` (none, auto, required, or function) and the
    named function. Tools without a tool_choice mean "auto", as OpenAI reads them."""
    tools = _check(body, "tools", (list,))
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None, "none", None
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools per request", "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '-' or '.'", "tools")
        if name in names:
            raise APIError(400, f"tools[{i}]: two tools are named {name!r}", "tools")
        names.add(name)
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise APIError(400, f"tools[{i}].function.description must be a string", "tools")
    if choice is None:
        return tools, "auto", None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400, "a named 'tool_choice' is {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in names:
            raise APIError(400, f"'tool_choice' names {name[:64]!r}, which is not among the tools", "tool_choice")
        return tools, "function", name
    if choice not in ("none", "auto", "required"):
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or a named function", "tool_choice")
    return tools, choice, None


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
