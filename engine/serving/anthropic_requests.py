"""An Anthropic Messages API request as the chat request it asks for: `system` as the system message, `tool_use`
blocks as an assistant's tool calls, `tool_result` blocks as tool messages, `thinking` blocks as reasoning_content,
`tools` with `input_schema` as function tools, `tool_choice` in chat's terms; then `openai_requests.parse_chat` checks
it all as it checks a chat request. Errors keep their wording with the Messages API's names.

    tool_choice {"type": "auto"}   "auto"       (needs --enable-auto-tool-choice and --tool-call-parser)
                {"type": "any"}    "required"   (constrained: a valid call to one of the tools)
                {"type": "tool", "name": F}   the named function F (constrained)
                {"type": "none"}   "none"
"""

from __future__ import annotations

from typing import Any

from kiln.engine.serving.api_errors import check_field
from kiln.engine.serving.openai_requests import APIError, ParsedRequest, parse_chat

ROLES = ("user", "assistant")
# Kiln's (and vLLM's) sampling and structured-output fields, taken here as on chat (a client sends them as extra body)
EXTRAS = (
    "seed",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "logit_bias",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
MAX_USER_ID_CHARS = 256  # as Anthropic
THINKING = ("enabled", "disabled", "adaptive", "between_tools")
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# NOTE: Claude Code opens its system prompt with a block that changes every request; kept, it would be the first
# tokens of every prompt, and no prefix-cache hit would ever reach past it
_BILLING_HEADER = "x-anthropic-billing-header"


def chat_body(body: Any, count_only: bool = False) -> dict[str, Any]:
    """The chat-completions body a Messages request asks for (APIError on what it cannot be). `count_only`: a
    /v1/messages/count_tokens body, which has no max_tokens and samples nothing."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise APIError(400, "'model' is required: a string", "model")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat: dict[str, Any] = {"messages": messages}
    _check_thinking(body.get("thinking"))
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice, bool(tools)))
    if count_only:
        return {**chat, "max_tokens": 1}
    if body.get("max_tokens") is None:
        raise APIError(400, "'max_tokens' is required: the most tokens to generate", "max_tokens")
    _check_metadata(body.get("metadata"))
    stop = check_field(body, "stop_sequences", (list,))
    if stop is not None:
        chat["stop"] = stop
    for name in ("max_tokens", "stream", "temperature", "top_p", "top_k", *EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list) or not all(_is_text_block(b) for b in system):
        raise APIError(400, "'system' must be a string or a list of text blocks ({'type': 'text', 'text': ...})")
    texts = [b["text"] for b in system if not b["text"].startswith(_BILLING_HEADER)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _is_text_block(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise APIError(
                400,
                f"messages[{i}]: 'role' must be 'user' or 'assistant' (the system prompt is the top-level 'system')",
                "messages",
            )
        content = m.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif isinstance(content, list) and content and all(isinstance(b, dict) for b in content):
            chat += _user_turn(content, i) if role == "user" else [_assistant_turn(content, i)]
        else:
            raise APIError(400, f"messages[{i}]: 'content' must be a string or a non-empty list of blocks", "messages")
    if messages[-1]["role"] == "assistant":
        raise APIError(
            400,
            "the last message is the assistant's: continuing it (prefill) is not supported; end with a user message",
            "messages",
        )
    return chat


def _user_turn(blocks: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """A user message's blocks as chat messages, in order: each run of text blocks a user message, each tool_result
    a tool message."""
    turn: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{where}: a tool_result needs 'tool_use_id', a string", "messages")
            text = _tool_result_text(block.get("content"), where)
            turn.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif _is_text_block(block):
            if turn and turn[-1]["role"] == "user":
                turn[-1]["content"] += "\n" + block["text"]
            else:
                turn.append({"role": "user", "content": block["text"]})
        else:
            raise _unsupported(block, where, "text and tool_result")
    return turn


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_block(b) for b in content):
        return "\n".join(b["text"] for b in content)
    raise APIError(400, f"{where}: a tool_result's 'content' is a string or a list of text blocks", "messages")


def _assistant_turn(blocks: list[dict[str, Any]], i: int) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type")
        if _is_text_block(block):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{where}: a tool_use needs 'id' and 'name', strings", "messages")
            if not isinstance(block.get("input"), dict):
                raise APIError(400, f"{where}: a tool_use's 'input' must be an object", "messages")
            function = {"name": block["name"], "arguments": block["input"]}  # (an object, as templates take them)
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # another server's encrypted thinking: nothing a template could render
        else:
            raise _unsupported(block, where, "text, tool_use and thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _unsupported(block: dict[str, Any], where: str, allowed: str) -> APIError:
    kind = block.get("type")
    if kind in ("text", "tool_result", "tool_use", "thinking"):
        return APIError(400, f"{where}: a malformed {kind} block", "messages")
    shown = str(kind)[:40] if isinstance(kind, str) else "a block without a type"
    return APIError(400, f"{where}: {shown!r} blocks are not supported here; {allowed} blocks are", "messages")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", "tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(
                400,
                f"tools[{i}]: only custom tools ({{name, description, input_schema}}) are supported, "
                f"not {str(kind)[:40]!r}",
                "tools",
            )
        if not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}]: 'input_schema' is required, a JSON schema object", "tools")
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool["input_schema"],
        }
        if function["description"] is None:  # (a template renders the tool as given: no null description)
            del function["description"]
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any, has_tools: bool) -> dict[str, Any]:
    """Chat's `tool_choice` and `parallel_tool_calls` for an Anthropic tool_choice."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(400, "'tool_choice' is {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    chat: dict[str, Any] = {}
    parallel = not check_field(choice, "disable_parallel_tool_use", (bool,), False)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "a 'tool_choice' of type 'tool' needs 'name', a string", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind != "auto" or has_tools:  # (auto without tools: there is nothing to choose)
        chat["tool_choice"] = _CHOICES[kind]
    if has_tools:
        chat["parallel_tool_calls"] = parallel
    return chat


def _check_thinking(thinking: Any) -> None:
    """`thinking` as Anthropic takes it. NOTE: it turns nothing on or off here: the reasoning parser
    (--reasoning-parser) reads whatever thinking the model writes, and no budget is held to (nor need it be less than
    max_tokens, which a small context may bound below 1024)."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING:
        raise APIError(400, f"'thinking.type' must be one of {', '.join(THINKING)}", "thinking")
    if kind != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
        raise APIError(400, "'thinking.budget_tokens' must be an integer of at least 1024", "thinking")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise APIError(400, "'metadata' is an object whose one field is 'user_id'", "metadata")
    user_id = metadata.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > MAX_USER_ID_CHARS):
        raise APIError(400, f"'metadata.user_id' must be a string of at most {MAX_USER_ID_CHARS} characters")


def parse_messages(body: Any, defaults: dict[str, Any]) -> ParsedRequest:
    """The chat request a POST /v1/messages body makes."""
    return parse_chat(chat_body(body), defaults)


def parse_count_tokens(body: Any, defaults: dict[str, Any]) -> ParsedRequest:
    """The chat request whose prompt a POST /v1/messages/count_tokens body counts."""
    return parse_chat(chat_body(body, count_only=True), defaults)


def context_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> APIError | None:
    """A request past the context, in Anthropic's words (Claude Code reads them: "prompt is too long" makes it
    compact the conversation, and the second form's numbers make it lower max_tokens)."""
    if num_prompt_tokens > max_model_len:
        return APIError(400, f"prompt is too long: {num_prompt_tokens} tokens > {max_model_len} maximum", "messages")
    if num_prompt_tokens + max_tokens > max_model_len:
        return APIError(
            400,
            f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} + {max_tokens} > "
            f"{max_model_len}, decrease input length or `max_tokens` and try again",
            "max_tokens",
        )
    return None


# chat's words for what the Messages API calls otherwise, in the errors parse_chat raises
_WORDS = (("'stop'", "'stop_sequences'"), ("].function.parameters", "].input_schema"), ("].function.", "]."))


def in_anthropic_terms(error: APIError) -> APIError:
    """A chat request's error with the Messages API's names."""
    if error.param == "stop":
        error.param = "stop_sequences"
        if error.message.startswith("stop "):  # (SamplingParams' own words)
            error.message = "stop_sequences" + error.message[len("stop") :]
    for chat_word, word in _WORDS:
        error.message = error.message.replace(chat_word, word)
    if error.code == "context_length_exceeded" and not error.message.startswith("prompt is too long"):
        error.message = "prompt is too long: " + error.message
    return error
