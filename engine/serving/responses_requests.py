"""A Responses API request as the chat request it asks for: `input` items as messages (function calls and their
outputs as an assistant's tool calls and tool messages), `instructions` as the system message, `text.format` as
`response_format`, flat function tools as chat's; errors with the Responses API's parameter names.
"""

from __future__ import annotations

from typing import Any

from kiln.engine.serving.openai_requests import APIError, ParsedRequest, parse_chat

# the chat request's parameter names as the Responses API calls them, for the errors parse_chat raises
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_ROLES = ("user", "assistant", "system", "developer")
# vLLM's sampling extras and guided decoding, taken as on chat (and on Anthropic's Messages API)
_CHAT_EXTRAS = ("top_k", "min_p", "repetition_penalty", "stop")
_CHAT_EXTRAS += ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# OpenAI's bounds on `metadata`, which the response echoes (three times in a stream)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def chat_body(body: Any) -> dict[str, Any]:
    """The chat-completions body a Responses request asks for (APIError on what it cannot be)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise APIError(
            400, "this server keeps no responses: send the whole conversation as 'input'", "previous_response_id"
        )
    if body.get("store") is True:
        raise APIError(400, "this server keeps no responses: give 'store': false", "store")
    if body.get("background"):
        raise APIError(400, "background responses are not supported", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, "'truncation' must be 'disabled'", "truncation")
    _check_metadata(body.get("metadata"))
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(400, "'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", None), ("top_p", None), ("seed", None)):
        if body.get(ours) is not None:
            chat[theirs or ours] = body[ours]
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "a named 'tool_choice' is {'type': 'function', 'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if text is not None and not isinstance(text, dict) or fmt is not None and not isinstance(fmt, dict):
            raise APIError(400, "'text' is {'format': {'type': 'text' | 'json_object' | 'json_schema', ...}}", "text")
        if fmt is not None and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        elif fmt is not None:
            chat["response_format"] = {"type": fmt.get("type")}
    for name in _CHAT_EXTRAS:
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    rule = (
        f"'metadata' is an object of at most {MAX_METADATA_PAIRS} pairs, each key a string of at most "
        f"{MAX_METADATA_KEY_CHARS} characters and each value a string of at most {MAX_METADATA_VALUE_CHARS}"
    )
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, rule, "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(400, rule, "metadata")


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": item["role"], "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}]: a function_call has 'call_id', 'name' and 'arguments'", "input")
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise APIError(
                    400, f"input[{i}]: a function_call_output has 'call_id' and 'output' (a string)", "input"
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # a past turn's reasoning: chat templates drop it too
        else:
            raise APIError(
                400,
                f"input[{i}] must be a message (role one of {', '.join(_ROLES)}), a function_call or a "
                "function_call_output",
                "input",
            )
    return messages


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    raise APIError(400, f"input[{i}]: content is a string or a list of input_text parts", "input")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}]: only function tools are supported, not {str(kind)[:40]!r}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def parse_responses(body: Any, defaults: dict[str, Any]) -> tuple[ParsedRequest, dict[str, Any]]:
    """The chat request a Responses body makes, and the body (for the fields a response repeats)."""
    try:
        return parse_chat(chat_body(body), defaults), body
    except APIError as e:
        raise in_responses_terms(e) from None


def in_responses_terms(error: APIError) -> APIError:
    """A chat request's error with the Responses API's parameter names."""
    error.param = _PARAMS.get(error.param, error.param)
    error.message = error.message.replace("max_tokens", "max_output_tokens")
    return error
