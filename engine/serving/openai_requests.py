"""Parse and validate OpenAI-style request bodies into prompts and SamplingParams.

Every way a body can be wrong becomes an `APIError` with a 4xx status and the offending parameter
named, in OpenAI's error shape; nothing here may raise anything else on bad input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams
from kiln.engine.serving.api_errors import APIError, check_field
from kiln.engine.serving.chat_messages import chat_message, tools_and_choice
from kiln.engine.serving.request_body import nested_json

__all__ = ["APIError", "ParsedRequest", "parse_chat", "parse_completion"]


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
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field asked for (echo's are in `logprobs`)
    prompt_only: bool = False  # completions' max_tokens 0 with echo: one token is generated and dropped
    # chat: variables for the chat template (vLLM's chat_template_kwargs: {"enable_thinking": false} for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None


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
    logit_bias = check_field(body, "logit_bias", (dict,))
    if logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in logit_bias.items()}
        except (TypeError, ValueError):
            raise APIError(400, "'logit_bias' keys must be token ids", "logit_bias") from None
        if len(logit_bias) > 1024:
            raise APIError(400, "'logit_bias' may hold at most 1024 entries", "logit_bias")
    stop_token_ids = check_field(body, "stop_token_ids", (list,))
    kwargs = dict(
        n=check_field(body, "n", (int,), 1),
        temperature=check_field(body, "temperature", num, defaults.get("temperature", 1.0)),
        top_p=check_field(body, "top_p", num, defaults.get("top_p", 1.0)),
        top_k=check_field(body, "top_k", (int,), defaults.get("top_k", 0)),
        min_p=check_field(body, "min_p", num, defaults.get("min_p", 0.0)),
        presence_penalty=check_field(body, "presence_penalty", num, 0.0),
        frequency_penalty=check_field(body, "frequency_penalty", num, 0.0),
        repetition_penalty=check_field(body, "repetition_penalty", num, defaults.get("repetition_penalty", 1.0)),
        logit_bias=logit_bias,
        seed=check_field(body, "seed", (int,)),
        max_tokens=check_field(body, "max_tokens", (int,), max_tokens_default),
        min_tokens=check_field(body, "min_tokens", (int,), 0),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=check_field(body, "ignore_eos", (bool,), False),
        logprobs=logprobs,
        skip_special_tokens=check_field(body, "skip_special_tokens", (bool,), True),
        include_stop_str_in_output=check_field(body, "include_stop_str_in_output", (bool,), False),
    )
    kwargs["structured_output"], constraint_param = _structured_output(body)  # (checked after the fields above)
    try:
        return SamplingParams(**kwargs), constraint_param
    except (ValueError, TypeError) as e:
        message = str(e)
        param = message.split()[0].strip("'`:").split("[")[0] if message else None  # (logit_bias[5]: logit_bias)
        raise APIError(400, message, param if param in kwargs else None) from None


def _structured_output(body: dict[str, Any]) -> tuple[StructuredOutputParams | None, str | None]:
    """OpenAI's `response_format` (json_object, json_schema), or vLLM's `guided_json`, `guided_choice`,
    `guided_regex`, `guided_grammar`; with the parameter it came from."""
    given: list[tuple[str, dict[str, Any]]] = []  # (parameter, StructuredOutputParams fields)
    response_format = check_field(body, "response_format", (dict,))
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
        value = check_field(body, name, (str,))
        if value is not None:
            given.append((name, {field: value}))
    guided_json = check_field(body, "guided_json", (dict, str))
    if isinstance(guided_json, str):
        try:
            guided_json = nested_json(guided_json)
        except ValueError:
            guided_json = None
        if not isinstance(guided_json, dict):
            raise APIError(400, "'guided_json' must be a JSON schema: an object, or its JSON text", "guided_json")
    if guided_json is not None:
        given.append(("guided_json", {"json": guided_json}))
    choices = check_field(body, "guided_choice", (list,))
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
    stream = check_field(body, "stream", (bool,), False)
    if body.get("stream_options") is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    options = check_field(body, "stream_options", (dict,), {})
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
    if any(len(p) == 0 for p in prompts):
        raise APIError(400, "the prompt is empty", "prompt")
    logprobs = check_field(body, "logprobs", (int,))
    stream, include_usage = _stream_flags(body)
    echo = check_field(body, "echo", (bool,), False)
    prompt_only = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    if prompt_only:  # the prompt alone (its log-probabilities, as evaluations ask): one token made, then dropped
        if not echo:
            raise APIError(400, "'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone)", "max_tokens")
        body = {**body, "max_tokens": 1}
    params, constraint_param = _sampling_params(body, 16, logprobs, defaults or {})
    asked = _prompt_logprobs(body, stream)
    wanted = [k for k in (asked, logprobs if echo else None) if k is not None]
    if wanted:  # echo with logprobs lists the prompt's tokens with theirs
        params = dataclasses.replace(params, prompt_logprobs=max(wanted))
    if check_field(body, "suffix", (str,)):
        raise APIError(400, "'suffix' is not supported", "suffix")
    best_of = check_field(body, "best_of", (int,))
    if best_of is not None and best_of != params.n:
        raise APIError(400, "'best_of' is not supported (other than equal to 'n')", "best_of")
    check_field(body, "user", (str,))
    return ParsedRequest(
        prompts,
        None,
        params,
        stream,
        include_usage,
        echo,
        logprobs,
        constraint_param=constraint_param,
        prompt_logprobs=asked,
        prompt_only=prompt_only,
    )


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: each prompt token's log-probability and the top k besides."""
    k = check_field(body, "prompt_logprobs", (int,))
    if k is None:
        return None
    if not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"'prompt_logprobs' must lie in [0, {MAX_LOGPROBS}], got {k}", "prompt_logprobs")
    if stream:
        raise APIError(400, "'prompt_logprobs' is not supported when streaming (as in vLLM)", "prompt_logprobs")
    return k


def parse_chat(body: Any, defaults: dict[str, Any] | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    messages = [chat_message(m, i) for i, m in enumerate(messages)]
    tools, tool_choice, tool_function = tools_and_choice(body)
    parallel_tool_calls = check_field(body, "parallel_tool_calls", (bool,), True)
    want_logprobs = check_field(body, "logprobs", (bool,), False)
    top = check_field(body, "top_logprobs", (int,), 0)
    if body.get("top_logprobs") is not None and not want_logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"'top_logprobs' must lie in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    stream, include_usage = _stream_flags(body)
    params, constraint_param = _sampling_params(body, None, top if want_logprobs else None, defaults or {})
    asked = _prompt_logprobs(body, stream)
    if asked is not None:
        params = dataclasses.replace(params, prompt_logprobs=asked)
    check_field(body, "user", (str,))
    template_kwargs = check_field(body, "chat_template_kwargs", (dict,))
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
        prompt_logprobs=asked,
        chat_template_kwargs=template_kwargs,
    )


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
