"""Large request bodies (over `request_body.PARSE_ON_LOOP_BYTES` decoded) decoded, parsed and held to the engine's
limits in worker processes of the API server's own. `json.loads` holds the interpreter's lock throughout: 5 million
token ids in a 15 KB gzip body take ~0.8 s to parse, which on a thread still stalls the event loop and every
stream. In a worker only what could be served comes back: a body its worker refuses (token ids past
--max-model-len, more prompts than a request may hold, more messages than the context has tokens) is answered with
the error alone, and the millions of items never reach the server.

The workers run at a lower priority (nice 10): a flood of large bodies slows each other, not the server or the
engine. With `MAX_WAITING` bodies waiting already, another is a 429.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from kiln.engine.serving.api_errors import APIError, context_overflow
from kiln.engine.serving.api_keys import RateLimited
from kiln.engine.serving.request_body import decoded, parsed

WORKERS = 2
MAX_WAITING = 16  # bodies in or waiting for a worker; past them, a 429


@dataclass(frozen=True)
class BodyLimits:
    """What a body may hold and still be served."""

    max_model_len: int  # token ids a prompt (or /detokenize), messages a conversation
    max_sequences: int  # prompts a completion request


def refusal(body: Any, limits: BodyLimits) -> APIError | None:
    """The 400 a body gets for its item counts alone, or None: a prompt of token ids longer than the context, more
    prompts than a request may hold, more messages and content parts than the context has tokens (each renders to
    one token at least)."""
    if not isinstance(body, dict):
        return None
    max_len = limits.max_model_len
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if not isinstance(prompt[0], (str, list)):  # one prompt of token ids
            if len(prompt) > max_len:
                return context_overflow(max_len, "prompt", len(prompt))
        elif len(prompt) > limits.max_sequences:
            message = f"this request holds {len(prompt)} prompts; at most {limits.max_sequences} are allowed"
            return APIError(400, message, "prompt")
        else:
            for ids in prompt:
                if isinstance(ids, list) and len(ids) > max_len:
                    return context_overflow(max_len, "prompt", len(ids))
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_len:  # /detokenize
        return APIError(400, f"at most {max_len} token ids (--max-model-len) are detokenized", "tokens")
    for field in ("messages", "input"):  # (chat, Anthropic's messages; the Responses API's input)
        turns = body.get(field)
        if not isinstance(turns, list):
            continue
        parts = len(turns) + sum(len(t["content"]) for t in turns if isinstance(t, dict) and _is_list(t, "content"))
        if parts > max_len:
            return context_overflow(max_len, field, f"more than {max_len}")
    return None


def _is_list(turn: dict, key: str) -> bool:
    return isinstance(turn.get(key), list)


def _parse(raw: bytes, encoding: str, limits: BodyLimits) -> tuple:
    """In a worker: ("body", the body) or ("error", the APIError's fields)."""
    try:
        body = parsed(decoded(raw, encoding))
        error = refusal(body, limits)
    except APIError as e:
        error = e
    if error is not None:
        return ("error", error.status, error.message, error.param, error.type, error.code)
    return ("body", body)


class BodyParsers:
    """A pool of `WORKERS` processes, started at the first large body."""

    def __init__(self, workers: int = WORKERS, max_waiting: int = MAX_WAITING) -> None:
        self._workers, self._max_waiting = workers, max_waiting
        self._pool: ProcessPoolExecutor | None = None
        self._waiting = 0

    async def parse(self, raw: bytes, encoding: str, max_model_len: int, max_sequences: int) -> Any:
        """The body `raw` (as sent, before its Content-Encoding) holds, or the APIError it gets."""
        limits = BodyLimits(max_model_len, max_sequences)
        if self._waiting >= self._max_waiting:
            raise RateLimited("too many large request bodies are being parsed; retry later", "rate_limit_exceeded", 2)
        self._waiting += 1
        try:
            answer = await asyncio.wrap_future(self._started().submit(_parse, raw, encoding, limits))
        except BrokenProcessPool:  # a worker died (killed, out of memory): the next body gets a new pool
            self._pool = None
            raise APIError(413, "the request body could not be parsed within the server's memory") from None
        finally:
            self._waiting -= 1
        if answer[0] == "error":
            _, status, message, param, type_, code = answer
            raise APIError(status, message, param, type_, code)
        return answer[1]

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # (fork: a copy of a process with an event loop and threads)
            self._pool = ProcessPoolExecutor(self._workers, context, initializer=os.nice, initargs=(10,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
