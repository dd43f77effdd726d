"""`POST /v1/messages`, Anthropic's Messages API (what Claude Code and other agents built for Claude speak), on the
chat machinery: the request becomes a chat request (`anthropic_requests`), and the chat reply's reasoning, text and
tool calls become content blocks (`thinking`, `text`, `tool_use`), whole or as Anthropic's stream of events:

    message_start                                         the message, its content empty, its usage the input's
    content_block_start  index 0                          one block at a time, in the order the model wrote them
    content_block_delta  text_delta | thinking_delta | input_json_delta   (a thinking block ends with signature_delta)
    content_block_stop   index 0
    ...                  index 1, 2, ...
    message_delta        stop_reason, stop_sequence, usage
    message_stop

Errors under /v1/messages are Anthropic's error objects, whoever raises them (`anthropic_error`); an error midway
through a stream is an `error` event, which ends it.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiln.engine.serving.openai_requests import APIError, ParsedRequest
from kiln.engine.serving.responses import apply_output, collect, next_items, raise_for, sse_response

if TYPE_CHECKING:
    from kiln.engine.serving.completion import ServerState
    from kiln.engine.serving.engine_client import Inbox
    from kiln.engine.serving.responses import Choice

PATH = "/v1/messages"
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
# NOTE: Kiln signs nothing: a thinking block's signature is empty, and one sent back is not checked
SIGNATURE = ""


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def anthropic_error(error: APIError) -> tuple[int, dict[str, Any]]:
    """An error's HTTP status and body as Anthropic sends them. A server that cannot take the request now (Kiln's
    503: busy, draining, its engine down) answers Anthropic's 529 `overloaded_error`, which its clients retry."""
    status = error.status
    if status == 503:
        status, kind = 529, "overloaded_error"
    elif status >= 500:
        kind = "api_error"
    else:
        kind = ERROR_TYPES.get(status, "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


class MessageShape:
    """A Messages request's reply: the message object, whole or as the stream of events."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.parsed = parsed
        self.id = "msg_" + uuid.uuid4().hex

    def message(self, state: ServerState, choice: Choice, content: list[dict[str, Any]], done: bool):
        stop_reason, stop_sequence = _stop(choice) if done else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": state.served_model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(choice),
        }

    def whole(self, state: ServerState, choice: Choice) -> dict[str, Any]:
        return self.message(state, choice, content_blocks(choice.reply.message(choice.text.text)), done=True)

    async def reply(self, request: web.Request, state: ServerState, choice: Choice, queue: Inbox):
        if not self.parsed.stream:
            await collect(state, {choice.request_id: choice}, queue)
            return web.json_response(self.whole(state, choice))

        async def frames():
            async for event in self.events(state, choice, queue):
                yield _sse(event)

        return await sse_response(request, state, frames(), lambda e: _sse(anthropic_error(e)[1]))

    async def events(self, state: ServerState, choice: Choice, queue: Inbox):
        yield {"type": "message_start", "message": self.message(state, choice, [], done=False)}
        blocks = BlockStream()
        finished = False
        while not finished:
            if choice.finish_reason is None:
                for item in await next_items(queue):
                    raise_for(item)
                    if item.request_id == choice.request_id and choice.finish_reason is None:
                        apply_output(state, choice, item)
            finished = choice.finish_reason is not None
            fields = choice.reply.update(choice.text.text, finished)
            for event in blocks.step(fields, finished, choice.reply.called_tools):
                yield event
        stop_reason, stop_sequence = _stop(choice)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield {"type": "message_delta", "delta": delta, "usage": _usage(choice)}
        yield {"type": "message_stop"}


def content_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat reply's fields (`ChatReply.message`) as content blocks: thinking, text, then each tool call."""
    content = []
    if reply.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": SIGNATURE})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls", []):
        f = call["function"]
        if f["name"] is not None:
            content.append(_tool_use(call["id"], f["name"], _input(f["arguments"])))
    return content


class BlockStream:
    """A streamed reply's content blocks, from the chat reply's deltas (`ChatReply.update`): one block open at a
    time, each started, given its deltas, and stopped."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: tuple[str, int] | None = None  # the open block's type (and call index)
        self.held = ""  # text that would open a text block, all whitespace so far: a tool call after it drops it

    def step(self, fields: dict[str, Any], finished: bool, called_tools: bool) -> list[dict[str, Any]]:
        """The events for one update's `fields` (reasoning_content, content, tool_calls); the last ones when
        `finished`."""
        events: list[dict[str, Any]] = []
        if fields.get("reasoning_content"):
            if self.kind != ("thinking", 0):
                events += self._start(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": fields["reasoning_content"]}))
        text = fields.get("content", "")
        if text and self.kind != ("text", 0):
            self.held, text = self.held + text, ""
            if self.held.strip():
                events += self._start(("text", 0), {"type": "text", "text": ""})
                self.held, text = "", self.held
        if text:
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in fields.get("tool_calls", []):
            if "id" in call:
                events += self._start(("tool_use", call["index"]), _tool_use(call["id"], call["function"]["name"], {}))
            if call["function"]["arguments"]:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        if finished:
            # (whitespace beside calls is no text block, as the whole message's content is None then)
            if self.held and not called_tools:
                events += self._start(("text", 0), {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": self.held}))
            events += self._stop()
        return events

    def _start(self, kind: tuple[str, int], block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.index += 1
        self.kind = kind
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _stop(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        events = (
            [self._delta({"type": "signature_delta", "signature": SIGNATURE})] if self.kind[0] == "thinking" else []
        )
        self.kind = None
        return [*events, {"type": "content_block_stop", "index": self.index}]


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def _stop(choice: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the reply."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.reply.called_tools:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):  # (a stop token's id otherwise: the model's own end)
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _usage(choice: Choice) -> dict[str, int]:
    return {"input_tokens": len(choice.prompt_ids), "output_tokens": len(choice.token_ids)}


def _tool_use(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call_id.removeprefix("call_"), "name": name, "input": arguments}


def _refuse(constant: str) -> None:
    raise ValueError(constant)  # NaN and Infinity: not JSON


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use's input. Arguments cut short (max_tokens) give what Anthropic's clients make
    of the same text streamed (jiter's partial mode): the members complete so far, a cut string or literal dropped."""
    try:
        value = json.loads(arguments, parse_constant=_refuse)
    except ValueError:
        value = _complete_part(arguments)
    return value if isinstance(value, dict) else {}


def _complete_part(text: str) -> Any:
    """The JSON value a cut JSON text holds so far: the text (or its head up to one of its last 64 commas or opening
    brackets) with the brackets still open closed, the longest that parses."""
    closers: list[str] = []
    cuts: list[tuple[int, str]] = []  # (where the text may be cut, the closers it then needs)
    in_string = escaped = False
    for i, c in enumerate(text):
        if in_string:
            in_string, escaped = escaped or c != '"', not escaped and c == "\\"
        elif c == '"':
            in_string = True
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
            cuts.append((i + 1, "".join(reversed(closers))))
        elif c in "}]" and closers:
            closers.pop()
        elif c == ",":
            cuts.append((i, "".join(reversed(closers))))
    for head, ending in [(text, "".join(reversed(closers))), *((text[:i], e) for i, e in reversed(cuts[-64:]))]:
        try:
            return json.loads(head + ending, parse_constant=_refuse)
        except ValueError:
            continue
    return None
