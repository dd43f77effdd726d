"""Chat messages and function tools, checked and put as chat templates take them."""

from __future__ import annotations

import re
from typing import Any

from kiln.engine.serving.api_errors import APIError, check_field
from kiln.engine.serving.request_body import nested_json

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's ("function": its old tool role)


def chat_message(m: Any, i: int) -> dict[str, Any]:
    """A message as chat templates take it: its content a string (text parts joined by newlines), an assistant's
    tool calls with their arguments as objects."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{where} needs a string 'role'", "messages")
    if m["role"] not in ROLES:  # a template writes the role into the prompt as is: a made-up one could forge turns
        raise APIError(400, f"{where}: 'role' must be one of {', '.join(ROLES)}", "messages")
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
    if isinstance(m.get("reasoning_content"), str) and "thinking" not in m and not content:
        # gpt-oss's template reads an earlier turn's reasoning as `thinking` (and refuses it beside content)
        message["thinking"] = m["reasoning_content"]
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
            arguments = nested_json(arguments)  # as templates render them: an object, not its JSON text
        except ValueError:
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise APIError(
            400, f"{where}: a tool call is {{'function': {{'name': ..., 'arguments': a JSON object}}}}", "messages"
        )
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": name, "arguments": arguments}}


MAX_TOOLS = 128  # as OpenAI
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def tools_and_choice(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """`tools` (shown to the model by the chat template), `tool_choice` (none, auto, required, or function) and the
    named function. Tools without a tool_choice mean "auto", as OpenAI reads them."""
    tools = check_field(body, "tools", (list,))
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
