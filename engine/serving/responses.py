"""A request's engine outputs into OpenAI's shapes: each choice's state as outputs arrive (joined when they
queued up behind a slow reader), the SSE stream with its stalled-reader watch, and the final JSON body."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiln.engine import messages
from kiln.engine.serving.engine_client import EngineDeadError, Inbox
from kiln.engine.serving.logprobs import echo_logprobs_body, end_offset, joined, logprobs_body, vllm_prompt_logprobs
from kiln.engine.serving.openai_requests import APIError
from kiln.engine.serving.reasoning import ChatReply
from kiln.engine.text.detokenizer import TextStream

if TYPE_CHECKING:
    from kiln.engine.serving.api_keys import KeyState
    from kiln.engine.serving.completion import ServerState

logger = logging.getLogger("kiln")
STREAM = "kiln.stream"  # a request's SSE response once it has begun: nothing else may be sent for it


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[list[float]]] = field(default_factory=list)
    prompt_logprobs: list | None = None  # the engine's entries, one a prompt token, when the request asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's field)
    start_time: float = field(default_factory=time.monotonic)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (the engine says so with the first output)
    first_token_time: float | None = None
    last_token_time: float | None = None
    key: KeyState | None = None  # the API key charged for generated tokens (--api-keys-file)
    engine: int = 0  # the engine core it runs on (--data-parallel-size)
    reply: ChatReply | None = None  # chat whose text is read for reasoning or tool calls

    def reply_finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a reply that ended on its own after calling tools."""
        if self.finish_reason == "stop" and self.reply is not None and self.reply.called_tools:
            return "tool_calls"
        return self.finish_reason


async def next_items(queue: Inbox) -> list[Any]:
    """Everything queued for this request (waiting for one item), the outputs of each request that queued up
    behind each other joined into one (one detokenization and one event for all of them, so a reader that
    falls behind catches up in fewer, larger steps)."""
    items = await queue.take_all()
    if len(items) == 1:
        return items
    merged: list[Any] = []
    latest: dict[str, messages.EngineCoreOutput] = {}  # since the last non-output item (an error ends it all)
    for item in items:
        if not isinstance(item, messages.EngineCoreOutput):
            merged.append(item)
            latest.clear()
        elif (first := latest.get(item.request_id)) is None:
            merged.append(item)
            latest[item.request_id] = item
        else:  # NOTE: a queued output belongs to this request alone: joined in place
            first.new_token_ids.extend(item.new_token_ids)
            if item.new_logprobs:
                if first.new_logprobs is None:
                    first.new_logprobs = []
                first.new_logprobs.extend(item.new_logprobs)
            first.finish_reason, first.stop_reason = item.finish_reason, item.stop_reason
            first.prompt_logprobs = first.prompt_logprobs or item.prompt_logprobs
    return merged


def apply_output(state: ServerState, choice: Choice, out: messages.EngineCoreOutput) -> str:
    now = time.monotonic()
    if choice.first_token_time is None:
        choice.first_token_time = now
    elif out.new_token_ids:
        state.metrics.inter_token(now - choice.last_token_time, len(out.new_token_ids), choice.engine)
    choice.last_token_time = now
    choice.token_ids.extend(out.new_token_ids)
    choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
    if choice.key is not None and out.new_token_ids:
        choice.key.charge(len(out.new_token_ids))
    if out.new_logprobs:
        choice.logprobs.extend(out.new_logprobs)
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    finished = out.finish_reason is not None
    # the engine stops a request with "stop" only on a stop token (EOS, stop_token_ids, a grammar's end)
    delta, stop = choice.text.update(out.new_token_ids, finished, stop_token=out.finish_reason == "stop")
    if stop is not None:
        choice.finish_reason, choice.stop_reason = "stop", stop
        state.client.abort([choice.request_id])
    elif finished:
        choice.finish_reason = out.finish_reason if out.finish_reason != "abort" else "stop"
        choice.stop_reason = out.stop_reason
    return delta


class ServerShutdown(RuntimeError):
    """Put in a request's queue when SIGTERM's drain time is up: the request ends with a 503 error."""


def raise_for(item: Any) -> None:
    if isinstance(item, EngineDeadError):
        raise APIError(500, "the engine core died while running this request", type_="internal_error")
    if isinstance(item, ServerShutdown):
        raise APIError(503, "the server shut down before this request finished", type_="service_unavailable")
    if isinstance(item, messages.RequestFailed):
        internal = item.message.startswith("internal error")
        raise APIError(
            500 if internal else 400, item.message, type_="internal_error" if internal else "invalid_request_error"
        )


async def collect(state: ServerState, choices: dict[str, Choice], queue: Inbox) -> None:
    while any(c.finish_reason is None for c in choices.values()):
        for item in await next_items(queue):
            raise_for(item)
            choice = choices.get(item.request_id)
            if choice is not None and choice.finish_reason is None:
                apply_output(state, choice, item)


async def stream_response(request, state, parsed, choices, queue, base, created, chat, texts) -> web.StreamResponse:
    async def frames() -> AsyncIterator[bytes]:
        async for payload in _events(state, parsed, choices, queue, base, created, chat, texts):
            yield f"data: {payload}\n\n".encode()

    return await sse_response(
        request, state, frames(), lambda e: f"data: {_json(e.body())}\n\n".encode(), b"data: [DONE]\n\n"
    )


async def sse_response(
    request: web.Request,
    state: ServerState,
    frames: AsyncIterator[bytes],
    error_frame: Callable[[APIError], bytes],
    last_frame: bytes = b"",
) -> web.StreamResponse:
    """An SSE stream of `frames`; an error midway is sent as `error_frame(error)` and ends it (any exception but an
    APIError as a 500: the stream has begun, so no second response can say it), then `last_frame`, always.
    NOTE: a client that stops reading blocks a write once the socket buffers fill; after write_timeout seconds it is
    dropped (and its request aborted) instead of holding a seat forever."""
    headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}  # (OpenAI's type)
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    request[STREAM] = response
    watch = WriteWatch(state.write_timeout)
    try:
        try:
            async for frame in frames:
                await watch.run(response.write(frame))
        except APIError as e:
            await watch.run(response.write(error_frame(e)))
        except (asyncio.CancelledError, TimeoutError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("unhandled error in the stream of %s %s", request.method, request.path)
            await watch.run(response.write(error_frame(APIError(500, "internal server error", type_="internal_error"))))
        if last_frame:
            await watch.run(response.write(last_frame))
        await watch.run(response.write_eof())
    except (TimeoutError, ConnectionResetError):
        pass  # the client is gone or not reading: run_request aborts what is left
    finally:
        watch.close()
    return response


_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


async def _events(state, parsed, choices, queue, base, created, chat, texts) -> AsyncIterator[str]:
    """The stream's chunks as JSON text, one choice each: a first one a choice (the role, or the echoed prompt), then
    for each choice whatever arrived for it since the last event, merged into one chunk, then the usage.

    NOTE: the text is put together from pieces: the chunk's constant head is encoded once per stream, and a
    plain choice entry (no logprobs) from a template around its encoded text, since encoding the whole dict
    at every event was a large share of the API process's CPU."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = (
        f'{{"id":{_json(base)},"object":"{kind}","created":{created},"model":{_json(state.served_model_name)},'
        '"choices":['
    )
    null_usage = ',"usage":null' if parsed.include_usage else ""

    def chunk(choice_bodies: list[str], usage: dict | None = None) -> str:
        tail = null_usage if usage is None else f',"usage":{_json(usage)}'
        return f"{head}{','.join(choice_bodies)}]{tail}}}"

    def reason(choice: Choice) -> str:
        if choice.finish_reason is None:
            return "null"
        if parsed.prompt_only:  # max_tokens 0: the prompt alone, its one generated token dropped
            return '"length","stop_reason":null'
        return f'{_json(choice.reply_finish_reason())},"stop_reason":{_json(choice.stop_reason)}'

    # one choice a chunk (as OpenAI and vLLM send n > 1: clients index choices[0])
    if chat:
        for c in choices.values():
            yield chunk(
                [
                    f'{{"index":{c.index},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}'
                ]
            )
    # an echo with logprobs waits for the prompt's logprobs, which come with the choice's first output
    echo_pending = set(choices) if parsed.echo and parsed.logprobs is not None else set()
    if parsed.echo and not echo_pending:
        for c in choices.values():
            text = _json(_prompt_text(state, c, texts, parsed.params.n))
            yield chunk([f'{{"index":{c.index},"text":{text},"logprobs":null,"finish_reason":null}}'])
    text_offsets = dict.fromkeys(choices, 0)  # completions' logprobs: where the next token's text starts
    while any(c.finish_reason is None for c in choices.values()):
        deltas: dict[str, tuple[str, int]] = {}  # request id -> (text, first new token)
        for item in await next_items(queue):
            raise_for(item)
            choice = choices.get(item.request_id)
            if choice is None or choice.finish_reason is not None:
                continue
            text, start = deltas.get(item.request_id, ("", len(choice.token_ids)))
            deltas[item.request_id] = (text + apply_output(state, choice, item), start)
        bodies = []
        for rid, (delta, start) in deltas.items():
            choice = choices[rid]
            new_lp = choice.logprobs[start:] if parsed.logprobs is not None else None
            if rid in echo_pending:
                echo_pending.discard(rid)
                text = _json(_prompt_text(state, choice, texts, parsed.params.n))
                lp = "null"
                if choice.prompt_logprobs is not None:
                    body = echo_logprobs_body(state, choice.prompt_ids, choice.prompt_logprobs, parsed.logprobs)
                    text_offsets[rid], lp = end_offset(body), _json(body)
                bodies.append(f'{{"index":{choice.index},"text":{text},"logprobs":{lp},"finish_reason":null}}')
            if parsed.prompt_only:
                delta, new_lp = "", None
            fields = None
            if choice.reply is not None:  # the text read again as reasoning, content and calls
                fields = choice.reply.update(choice.text.text, choice.finish_reason is not None)
            if not (fields if fields is not None else delta) and choice.finish_reason is None and not new_lp:
                continue
            lp = "null"
            if new_lp:
                body = logprobs_body(state, choice.token_ids[start:], new_lp, chat, parsed.logprobs, text_offsets[rid])
                if not chat:  # text_offset counts from the completion's start, across chunks
                    text_offsets[rid] = body["text_offset"][-1] + len(body["tokens"][-1])
                lp = _json(body)
            if chat:
                content = f'{{"content":{_json(delta)}}}' if delta else "{}"
                if fields is not None:
                    content = _json(fields)
                bodies.append(
                    f'{{"index":{choice.index},"delta":{content},"logprobs":{lp},"finish_reason":{reason(choice)}}}'
                )
            else:
                bodies.append(
                    f'{{"index":{choice.index},"text":{_json(delta)},"logprobs":{lp},"finish_reason":{reason(choice)}}}'
                )
        for body in bodies:
            yield chunk([body])
    if parsed.include_usage:
        yield chunk([], _usage(choices, parsed.prompt_only))


class WriteWatch:
    """Times out a stream's write that has been blocked for `timeout` seconds, with one timer per stream that
    re-arms itself rarely (a timer armed and cancelled around every write cost more than the write)."""

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.timeout = timeout
        self.since: float | None = None  # when the write in progress began
        self.fired = False
        self.handle = self.loop.call_later(timeout, self._check)

    async def run(self, write: Coroutine[Any, Any, None]) -> None:
        self.since = self.loop.time()
        try:
            await write
        except asyncio.CancelledError:
            if self.fired and self.task.uncancel() == 0:  # our cancel, nobody else's: a timeout
                raise TimeoutError from None
            raise
        finally:
            self.since = None

    def _check(self) -> None:
        if self.since is not None and self.loop.time() - self.since >= self.timeout:
            self.fired = True
            self.task.cancel()
            return
        delay = self.timeout if self.since is None else self.since + self.timeout - self.loop.time()
        self.handle = self.loop.call_later(delay, self._check)

    def close(self) -> None:
        self.handle.cancel()


def _prompt_text(state: ServerState, choice: Choice, texts: list[str | None], n: int) -> str:
    text = texts[choice.index // n]
    return text if text is not None else state.tokenizer.decode(choice.prompt_ids)


def _usage(choices: dict[str, Choice], prompt_only: bool = False) -> dict[str, int]:
    seen: set[int] = set()
    prompt = 0
    for c in choices.values():
        if id(c.prompt_ids) not in seen:
            seen.add(id(c.prompt_ids))
            prompt += len(c.prompt_ids)
    completion = 0 if prompt_only else sum(len(c.token_ids) for c in choices.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def final_body(state, parsed, choices, base, created, chat, texts) -> dict[str, Any]:
    bodies = []
    for c in sorted(choices.values(), key=lambda c: c.index):
        if chat:
            lp = (
                None
                if parsed.logprobs is None
                else logprobs_body(state, c.token_ids, c.logprobs, True, parsed.logprobs)
            )
            message: dict[str, Any] = {"role": "assistant", "content": c.text.text, "refusal": None}
            if c.reply is not None:
                message.update(c.reply.message(c.text.text))
            bodies.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": c.reply_finish_reason(),
                    "stop_reason": c.stop_reason,
                }
            )
            continue
        text = (_prompt_text(state, c, texts, parsed.params.n) if parsed.echo else "") + (
            "" if parsed.prompt_only else c.text.text
        )
        body = {
            "index": c.index,
            "text": text,
            "logprobs": _completion_logprobs(state, parsed, c),
            "finish_reason": "length" if parsed.prompt_only else c.finish_reason,
            "stop_reason": None if parsed.prompt_only else c.stop_reason,
        }
        if parsed.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(state, c.prompt_logprobs)
        bodies.append(body)
    response = {
        "id": base,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": state.served_model_name,
        "choices": bodies,
        "usage": _usage(choices, parsed.prompt_only),
    }
    if chat and parsed.prompt_logprobs is not None:  # (vLLM's place for them on chat: the prompt is shared)
        response["prompt_logprobs"] = vllm_prompt_logprobs(state, next(iter(choices.values())).prompt_logprobs)
    return response


def _completion_logprobs(state: ServerState, parsed, c: Choice) -> dict[str, list] | None:
    """A completion's legacy logprobs: with `echo`, the prompt's tokens first (the first with none)."""
    if parsed.logprobs is None:
        return None
    echo = None
    if parsed.echo and c.prompt_logprobs is not None:
        echo = echo_logprobs_body(state, c.prompt_ids, c.prompt_logprobs, parsed.logprobs)
        if parsed.prompt_only:
            return echo
    offset = 0 if echo is None else end_offset(echo)
    body = logprobs_body(state, c.token_ids, c.logprobs, False, parsed.logprobs, offset)
    return body if echo is None else joined(echo, body)
