"""One completion request, from token ids to the response: engine requests for each choice, outputs
merged as they arrive, text through incremental detokenization and stop strings, then OpenAI's JSON or
SSE shapes (with logprobs and usage)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiln.engine import protocol
from kiln.engine.async_client import AsyncEngineClient, EngineDeadError, Inbox
from kiln.engine.detokenizer import TextStream
from kiln.engine.metrics import ServerMetrics
from kiln.engine.openai_requests import APIError, ParsedRequest
from kiln.engine.sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    from kiln.engine.gateway import KeyState

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class ServerState:
    client: AsyncEngineClient
    tokenizer: Any
    served_model_name: str
    api_key: str | None
    max_model_len: int
    metrics: ServerMetrics
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="tokenize"))
    max_num_seqs: int = 256
    max_num_queued_requests: int | None = None  # admission limit beyond the running batch; None = no limit
    draining: bool = False
    in_flight: int = 0  # HTTP requests being served
    engine_requests: int = 0  # requests (choices) they have in the engine
    write_timeout: float = 30.0  # seconds a stream may sit unread before it is aborted


# ---- tokenization (off the event loop) -----------------------------------------------------------------


async def encode(state: ServerState, text: str) -> list[int]:
    return await asyncio.get_running_loop().run_in_executor(state.pool, state.tokenizer.encode, text)


async def encode_prompt(state: ServerState, text: str) -> list[int]:
    """A prompt string's token ids. NOTE: tokenizing megabytes costs seconds of CPU and hundreds of MiB;
    a string whose head alone overflows the context is refused after tokenizing just the head."""
    head_chars = 32 * state.max_model_len
    if len(text) > head_chars:
        head = await encode(state, text[:head_chars])
        if len(head) > state.max_model_len + 16:  # merges across the cut change a few tokens at most
            raise APIError(400, f"the prompt has more than {state.max_model_len} tokens, this model's context",
                           "prompt", code="context_length_exceeded")  # fmt: skip
    return await encode(state, text)


async def encode_chat(state: ServerState, messages: list[dict[str, Any]]) -> list[int]:
    def render() -> list[int]:
        template = None if getattr(state.tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
        try:
            text = state.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                       add_generation_prompt=True)  # fmt: skip
        except Exception as e:  # a template may reject roles or orderings
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        return state.tokenizer.encode(text, add_special_tokens=False)

    return await asyncio.get_running_loop().run_in_executor(state.pool, render)


async def check_structured_output(state: ServerState, constraint: StructuredOutputParams) -> None:
    """A schema, regex or grammar that does not parse is a 400 before the engine sees it, streaming or not.
    (Parsing builds no token masks, so it is quick; the engine's compile, with its time limit, is the backstop.)"""
    param = {"regex": "guided_regex", "grammar": "guided_grammar"}.get(constraint.kind, "response_format")
    check = asyncio.get_running_loop().run_in_executor(state.pool, _grammar_problem, constraint)
    try:
        problem = await asyncio.wait_for(check, timeout=10.0)
    except TimeoutError:
        raise APIError(400, f"the {param} constraint took too long to parse", param) from None
    if problem is not None:
        raise APIError(400, problem, param)


def _grammar_problem(constraint: StructuredOutputParams) -> str | None:
    # xgrammar is imported on first use, here on a worker thread: a server that never sees a constraint never loads it.
    from kiln.engine.structured_output import GrammarError, check_grammar  # noqa: PLC0415

    try:
        check_grammar(constraint)
    except GrammarError as e:
        return str(e)
    return None


def check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.served_model_name:
        # NOTE: the served name defaults to the model's directory: an error message never shows it (see /v1/models)
        message = f"the model {str(model)[:100]!r} does not exist; GET /v1/models lists the one served"
        raise APIError(404, message, "model", type_="not_found_error", code="model_not_found")


@dataclass
class _Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[list[float]]] = field(default_factory=list)
    finish_reason: str | None = None
    start_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    key: KeyState | None = None  # the API key charged for generated tokens (--api-keys-file)


async def run_request(request: web.Request, state: ServerState, parsed: ParsedRequest, prompts: list[list[int]],
                      texts: list[str | None], chat: bool,
                      key: KeyState | None = None) -> web.StreamResponse:  # fmt: skip
    if state.draining:
        raise APIError(503, "the server is shutting down", type_="service_unavailable")
    if not state.client.alive:
        raise APIError(503, "the engine is not running", type_="service_unavailable")
    vocab = state.client.ready.vocab_size
    params = parsed.params
    new = len(prompts) * params.n
    if (state.max_num_queued_requests is not None
            and state.engine_requests + new > state.max_num_seqs + state.max_num_queued_requests):  # fmt: skip
        raise APIError(503, "too many requests are queued; retry later", type_="service_unavailable")
    for ids in prompts:
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        if len(ids) >= state.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {state.max_model_len}",
                           "prompt", code="context_length_exceeded")  # fmt: skip
        if params.max_tokens is not None and len(ids) + params.max_tokens > state.max_model_len:
            message = (f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the context "
                       f"of {state.max_model_len}")  # fmt: skip
            raise APIError(400, message, "max_tokens", code="context_length_exceeded")
    try:
        params.verify_vocab(vocab)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    if params.structured_output is not None:
        await check_structured_output(state, params.structured_output)

    base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    queue = Inbox()
    choices: dict[str, _Choice] = {}
    wire = {k: v for k, v in dataclasses.asdict(params).items() if k != "n"}  # plain data, as msgpack needs
    for i, ids in enumerate(prompts):
        for j in range(params.n):
            index = i * params.n + j
            rid = f"{base}-{index}"
            stream = TextStream(state.tokenizer, ids, params.stop, params.skip_special_tokens,
                                params.include_stop_str_in_output)  # fmt: skip
            choices[rid] = _Choice(index, rid, ids, stream, key=key)
    if key is not None:
        key.admit(sum(len(p) for p in prompts))  # 429 here: the engine never sees a rejected request
    state.in_flight += 1
    state.engine_requests += len(choices)
    state.metrics.request_started(sum(len(p) for p in prompts) * params.n)
    start = time.monotonic()
    try:
        for rid, choice in choices.items():
            j = choice.index % params.n
            # each of the n choices draws its own stream; a seed's range is that of a torch.Generator
            seed = None if params.seed is None else (params.seed + j) % 2**64
            state.client.add_request(rid, choice.prompt_ids, dict(wire, seed=seed), queue)
        if parsed.stream:
            return await _stream(request, state, parsed, choices, queue, base, created, chat, texts)
        await _collect(state, choices, queue)
        return web.json_response(_final_body(state, parsed, choices, base, created, chat, texts))
    finally:
        if key is not None:
            key.release()
        state.in_flight -= 1
        state.engine_requests -= len(choices)
        unfinished = [rid for rid, c in choices.items() if c.finish_reason is None]
        state.client.abort(unfinished)  # a disconnect, an error (even midway through adding): free the blocks
        for rid in choices:
            state.client.release(rid)
        state.metrics.request_finished(time.monotonic() - start, choices.values())


async def _next_items(queue: Inbox) -> list[Any]:
    """Everything queued for this request (waiting for one item), the outputs of each request that queued up
    behind each other joined into one (one detokenization and one event for all of them, so a reader that
    falls behind catches up in fewer, larger steps)."""
    items = await queue.take_all()
    if len(items) == 1:
        return items
    merged: list[Any] = []
    latest: dict[str, protocol.RequestOutput] = {}  # since the last non-output item (an error ends it all)
    for item in items:
        if not isinstance(item, protocol.RequestOutput):
            merged.append(item)
            latest.clear()
        elif (first := latest.get(item.request_id)) is None:
            merged.append(item)
            latest[item.request_id] = item
        else:  # NOTE: a queued output belongs to this request alone: joined in place
            first.new_token_ids = first.new_token_ids + item.new_token_ids
            if item.new_logprobs:
                first.new_logprobs = (first.new_logprobs or []) + item.new_logprobs
            first.finish_reason, first.stop_reason = item.finish_reason, item.stop_reason
    return merged


def _apply(state: ServerState, choice: _Choice, out: protocol.RequestOutput) -> str:
    now = time.monotonic()
    if choice.first_token_time is None:
        choice.first_token_time = now
    elif out.new_token_ids:
        state.metrics.inter_token(now - choice.last_token_time, len(out.new_token_ids))
    choice.last_token_time = now
    choice.token_ids.extend(out.new_token_ids)
    if choice.key is not None and out.new_token_ids:
        choice.key.charge(len(out.new_token_ids))
    if out.new_logprobs:
        choice.logprobs.extend(out.new_logprobs)
    finished = out.finish_reason is not None
    delta, stop = choice.text.update(out.new_token_ids, finished)
    if stop is not None:
        choice.finish_reason = "stop"
        state.client.abort([choice.request_id])
    elif finished:
        choice.finish_reason = out.finish_reason if out.finish_reason != "abort" else "stop"
    return delta


class ServerShutdown(RuntimeError):
    """Put in a request's queue when SIGTERM's drain time is up: the request ends with a 503 error."""


def _raise_for(item: Any) -> None:
    if isinstance(item, EngineDeadError):
        raise APIError(500, "the engine core died while running this request", type_="internal_error")
    if isinstance(item, ServerShutdown):
        raise APIError(503, "the server shut down before this request finished", type_="service_unavailable")
    if isinstance(item, protocol.RequestFailed):
        internal = item.message.startswith("internal error")
        raise APIError(500 if internal else 400, item.message, type_="internal_error" if internal else
                       "invalid_request_error")  # fmt: skip


async def _collect(state: ServerState, choices: dict[str, _Choice], queue: Inbox) -> None:
    while any(c.finish_reason is None for c in choices.values()):
        for item in await _next_items(queue):
            _raise_for(item)
            choice = choices.get(item.request_id)
            if choice is not None and choice.finish_reason is None:
                _apply(state, choice, item)


async def _stream(request, state, parsed, choices, queue, base, created, chat, texts) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    # NOTE: a client that stops reading blocks a write once the socket buffers fill; after write_timeout
    # seconds it is dropped (and its request aborted) instead of holding a seat forever.
    watch = _WriteWatch(state.write_timeout)

    async def send(payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        await watch.run(response.write(f"data: {data}\n\n".encode()))

    try:
        try:
            async for payload in _events(state, parsed, choices, queue, base, created, chat, texts):
                await send(payload)
        except APIError as e:
            await send(e.body())
        await send("[DONE]")
        await watch.run(response.write_eof())
    except (TimeoutError, ConnectionResetError):
        pass  # the client is gone or not reading: run_request aborts what is left
    finally:
        watch.close()
    return response


async def _events(state, parsed, choices, queue, base, created, chat, texts) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks: a first one (the role, or the echoed prompt), then whatever arrived since the last
    event merged into one entry per choice, then the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice_bodies: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": base, "object": kind, "created": created, "model": state.served_model_name,
                "choices": choice_bodies}  # fmt: skip
        if parsed.include_usage:
            body["usage"] = usage
        return body

    if chat:
        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for c in choices.values()])  # fmt: skip
    elif parsed.echo:
        n = parsed.params.n
        yield chunk([{"index": c.index, "text": _prompt_text(state, c, texts, n), "logprobs": None,
                      "finish_reason": None} for c in choices.values()])  # fmt: skip
    while any(c.finish_reason is None for c in choices.values()):
        deltas: dict[str, tuple[str, int]] = {}  # request id -> (text, first new token)
        for item in await _next_items(queue):
            _raise_for(item)
            choice = choices.get(item.request_id)
            if choice is None or choice.finish_reason is not None:
                continue
            text, start = deltas.get(item.request_id, ("", len(choice.token_ids)))
            deltas[item.request_id] = (text + _apply(state, choice, item), start)
        bodies = []
        for rid, (delta, start) in deltas.items():
            choice = choices[rid]
            new_lp = choice.logprobs[start:] if parsed.logprobs is not None else None
            if not delta and choice.finish_reason is None and not new_lp:
                continue
            lp = _logprobs_body(state, choice.token_ids[start:], new_lp, chat, parsed.logprobs) if new_lp else None
            if chat:
                bodies.append({"index": choice.index, "delta": {"content": delta} if delta else {},
                               "logprobs": lp, "finish_reason": choice.finish_reason})  # fmt: skip
            else:
                bodies.append({"index": choice.index, "text": delta, "logprobs": lp,
                               "finish_reason": choice.finish_reason})  # fmt: skip
        if bodies:
            yield chunk(bodies)
    if parsed.include_usage:
        yield chunk([], _usage(choices))


class _WriteWatch:
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


def _prompt_text(state: ServerState, choice: _Choice, texts: list[str | None], n: int) -> str:
    text = texts[choice.index // n]
    return text if text is not None else state.tokenizer.decode(choice.prompt_ids)


def _usage(choices: dict[str, _Choice]) -> dict[str, int]:
    seen: set[int] = set()
    prompt = 0
    for c in choices.values():
        if id(c.prompt_ids) not in seen:
            seen.add(id(c.prompt_ids))
            prompt += len(c.prompt_ids)
    completion = sum(len(c.token_ids) for c in choices.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprobs_body(state: ServerState, token_ids: list[int], entries: list[list[list[float]]], chat: bool, k: int):
    """OpenAI's logprobs shapes. Each engine entry holds [token id, logprob, rank] for the sampled
    token and the top k (ranks 1..k)."""
    decode = state.tokenizer.decode
    sampled, tops = [], []
    for token, entry in zip(token_ids, entries):
        sampled.append(next(lp for t, lp, _ in entry if int(t) == token))
        tops.append([(decode([int(t)]), lp) for t, lp, _ in sorted(entry, key=lambda e: e[2])[:k]])
    texts = [decode([t]) for t in token_ids]
    if chat:
        return {"content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()),
             "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in top]}
            for text, lp, top in zip(texts, sampled, tops)
        ]}  # fmt: skip
    tokens, token_logprobs, top = texts, sampled, [dict(t) for t in tops]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _final_body(state, parsed, choices, base, created, chat, texts) -> dict[str, Any]:
    bodies = []
    for c in sorted(choices.values(), key=lambda c: c.index):
        lp = None
        if parsed.logprobs is not None:
            lp = _logprobs_body(state, c.token_ids, c.logprobs, chat, parsed.logprobs)
        if chat:
            bodies.append({"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                           "logprobs": lp, "finish_reason": c.finish_reason})  # fmt: skip
        else:
            text = (_prompt_text(state, c, texts, parsed.params.n) if parsed.echo else "") + c.text.text
            bodies.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": base, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.served_model_name, "choices": bodies, "usage": _usage(choices)}  # fmt: skip


