"""`POST /v1/responses`, OpenAI's Responses API (what Codex-style agents and gpt-oss clients speak), on the chat
machinery: the request becomes a chat request (`responses_requests`), and the chat reply's reasoning, content and
tool calls become output items, whole or as the typed stream events.

Stateless: the server keeps no responses, so `store: true` and `previous_response_id` are refused (400); a
request that leaves `store` out is answered and forgotten.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiln.engine.serving.openai_requests import APIError, ParsedRequest
from kiln.engine.serving.responses import apply_output, collect, next_items, raise_for, sse_response

if TYPE_CHECKING:
    from kiln.engine.serving.completion import ServerState
    from kiln.engine.serving.responses import Choice


class ResponseShape:
    """A Responses request's reply: the response object, whole or as the stream of typed events."""

    def __init__(self, body: dict[str, Any], parsed: ParsedRequest) -> None:
        self.body, self.parsed = body, parsed
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.sequence = 0

    def response(self, state: ServerState, status: str, output: list[dict[str, Any]], choice: Choice | None):
        body = self.body
        text = body.get("text") if isinstance(body.get("text"), dict) else None
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": state.served_model_name,
            "output": output,
            "parallel_tool_calls": self.parsed.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": body.get("reasoning"),
            "store": False,
            "temperature": self.parsed.params.temperature,
            "text": text or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
            "tools": [_function_tool(tool) for tool in body.get("tools") or []],
            "top_p": self.parsed.params.top_p,
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
        }
        if choice is not None:  # (a response in progress has none yet: the spec's `usage` is an object or absent)
            prompt, generated = len(choice.prompt_ids), len(choice.token_ids)
            response["usage"] = {
                "input_tokens": prompt,
                # NOTE: Kiln bills nothing for caching a prompt, so nothing counts as written to the cache
                "input_tokens_details": {"cached_tokens": choice.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + generated,
            }
        return response

    def whole(self, state: ServerState, choice: Choice) -> dict[str, Any]:
        message = choice.reply.message(choice.text.text)
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content"):
            output.append(_message_item(_item_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls", []):
            f = call["function"]
            output.append(_call_item(_item_id("fc"), call["id"], f["name"], f["arguments"], "completed"))
        status = _status(choice)
        if output and status == "incomplete":
            output[-1]["status"] = "incomplete"  # (the item being written when max_output_tokens cut it)
        return self.response(state, status, output, choice)

    async def reply(self, request: web.Request, state: ServerState, choice: Choice, queue) -> web.StreamResponse:
        if not self.parsed.stream:
            await collect(state, {choice.request_id: choice}, queue)
            return web.json_response(self.whole(state, choice))

        async def frames():
            async for event in self.events(state, choice, queue):
                yield self._sse(event)

        def error_frame(e: APIError) -> bytes:
            return self._sse({"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param})

        return await sse_response(request, state, frames(), error_frame)

    def _sse(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

    async def events(self, state: ServerState, choice: Choice, queue):
        """The typed events: created, in_progress, then each output item added, its deltas and done (one item at
        a time: reasoning, the message, each function call), then completed."""
        yield {"type": "response.created", "response": self.response(state, "in_progress", [], None)}
        yield {"type": "response.in_progress", "response": self.response(state, "in_progress", [], None)}
        items: list[dict[str, Any]] = []  # every output item so far, the last one open
        open_kind: tuple[str, int] | None = None  # ("reasoning" | "message" | "call", call index)

        def close(status: str = "completed"):
            item = items[-1]
            item["status"] = status
            index = len(items) - 1
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                yield {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                }
            elif item["type"] == "message":
                part = item["content"][0]
                yield {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                }
                yield {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": part,
                }
            else:
                yield {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            yield {"type": "response.output_item.done", "output_index": index, "item": item}

        def switch(kind: tuple[str, int], item: dict[str, Any]):
            nonlocal open_kind
            if open_kind is not None:
                yield from close()
            open_kind = kind
            items.append(item)
            index = len(items) - 1
            shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else item
            yield {"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(shown)}
            if item["type"] == "message":
                yield {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": dict(item["content"][0]),
                }

        while True:
            finished = choice.finish_reason is not None
            if not finished:
                for item in await next_items(queue):
                    raise_for(item)
                    if item.request_id == choice.request_id and choice.finish_reason is None:
                        apply_output(state, choice, item)
                finished = choice.finish_reason is not None
            fields = choice.reply.update(choice.text.text, finished)
            if fields.get("reasoning_content"):
                if open_kind != ("reasoning", 0):
                    for event in switch(("reasoning", 0), _reasoning_item(_item_id("rs"), "", "in_progress")):
                        yield event
                items[-1]["content"][0]["text"] += fields["reasoning_content"]
                yield {
                    "type": "response.reasoning_text.delta",
                    "item_id": items[-1]["id"],
                    "output_index": len(items) - 1,
                    "content_index": 0,
                    "delta": fields["reasoning_content"],
                }
            if fields.get("content"):
                if open_kind is None or open_kind[0] != "message":
                    for event in switch(("message", 0), _message_item(_item_id("msg"), "", "in_progress")):
                        yield event
                items[-1]["content"][0]["text"] += fields["content"]
                yield {
                    "type": "response.output_text.delta",
                    "item_id": items[-1]["id"],
                    "output_index": len(items) - 1,
                    "content_index": 0,
                    "delta": fields["content"],
                    "logprobs": [],
                }
            for delta in fields.get("tool_calls", []):
                if "id" in delta:
                    item = _call_item(_item_id("fc"), delta["id"], delta["function"]["name"], "", "in_progress")
                    for event in switch(("call", delta["index"]), item):
                        yield event
                arguments = delta["function"]["arguments"]
                if arguments:
                    items[-1]["arguments"] += arguments
                    yield {
                        "type": "response.function_call_arguments.delta",
                        "item_id": items[-1]["id"],
                        "output_index": len(items) - 1,
                        "delta": arguments,
                    }
            if finished:
                break
        if open_kind is not None:
            for event in close(_status(choice)):  # (the item being written when max_output_tokens cut it: incomplete)
                yield event
        # NOTE: "completed" ends the stream either way (the status inside says "incomplete" when cut short): the
        # official client's stream helper knows no other last event
        yield {"type": "response.completed", "response": self.response(state, _status(choice), items, choice)}


def _status(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool of the request as the response repeats it: each field the spec's FunctionTool requires."""
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
