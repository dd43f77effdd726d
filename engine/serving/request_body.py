"""A request's body: read within its time limit, its Content-Encoding undone, parsed as strict JSON."""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from kiln.engine.serving.api_errors import APIError

MAX_BODY_BYTES = 16 << 20
PARSE_ON_LOOP_BYTES = 256 << 10  # larger bodies are parsed in a worker process (body_parsers), checked on a thread
LARGE_BODY = "kiln.large_body"  # on a request: its body is larger than that
T = TypeVar("T")


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def decoded(raw: bytes, encoding: str, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The body as sent before its Content-Encoding: gzip and deflate are undone here (aiohttp's own decoding is off:
    its failures were a 500 or a text/plain 400), with the result held to the body limit (a small bomb stays small).
    With a `limit` under that, None for a body larger than it (decoded no further)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw if len(raw) <= limit else None
    if encoding not in ("gzip", "x-gzip", "deflate"):
        message = f"Content-Encoding {encoding[:40]!r} is not supported: send the body as is, gzip or deflate"
        raise APIError(415, message, type_="invalid_request_error")
    # gzip's header, or zlib's (deflate as HTTP means it); a raw deflate stream is tried last
    for wbits in (47,) if encoding != "deflate" else (15, -15):
        decoder = zlib.decompressobj(wbits)
        try:
            body = decoder.decompress(raw, limit + 1)
        except zlib.error:
            continue
        if len(body) > limit or decoder.unconsumed_tail:
            if limit < MAX_BODY_BYTES:
                return None
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes once decoded")
        if decoder.eof and decoder.unused_data:  # NOTE: zlib stops at a member's end; what follows would be lost
            what = "a second gzip member" if decoder.unused_data[:2] == b"\x1f\x8b" else "bytes"
            raise APIError(400, f"the body is not valid {encoding} data: {what} after the end of its data")
        if decoder.eof:
            return body
    raise APIError(400, f"the body is not valid {encoding} data")


async def read_json(request: web.Request) -> Any:
    timeout = request.app["state"].body_timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", type_="timeout") from None
    encoding = request.headers.get("Content-Encoding", "")
    body = decoded(raw, encoding, PARSE_ON_LOOP_BYTES)
    request[LARGE_BODY] = body is None
    if body is None:  # NOTE: parsing megabytes holds the interpreter for up to a second: it is done in a worker
        state = request.app["state"]
        return await state.body_parsers.parse(raw, encoding, state.max_model_len, state.max_sequences_per_request)
    return parsed(body)


async def checked(request: web.Request, check: Callable[..., T], *args: Any) -> T:
    """`check(*args)` (a request parser), on a thread when the request's body was large: checking a body of millions
    of token ids or messages, field by field, takes the best part of a second, which the event loop (every other
    stream) must not wait."""
    if request.get(LARGE_BODY):
        return await asyncio.get_running_loop().run_in_executor(None, check, *args)
    return check(*args)


def parsed(raw: bytes) -> Any:
    try:
        # strict UTF-8 first: json.loads(bytes) would let an encoded lone surrogate (ED A0 80) through
        body = json.loads(raw.decode("utf-8-sig"))  # (a leading byte-order mark is allowed, as json.loads allows it)
    except UnicodeDecodeError:
        raise APIError(400, "the body is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:  # ValueError: also an integer of more than 4300 digits
        raise APIError(400, f"the body is not valid JSON: {type(e).__name__}") from None
    # NOTE: JSON may escape a lone UTF-16 surrogate (`"\ud800"`); it decodes to a str that neither the
    # tokenizer nor a UTF-8 encoder takes. Pairs (emoji) are fine; only bodies with such an escape are checked.
    if _ESCAPED_SURROGATE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except (UnicodeEncodeError, RecursionError):
            raise APIError(400, "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return body


def nested_json(text: str) -> Any:
    """JSON held in one of the body's strings (a past tool call's arguments, `guided_json`), held to the body's own
    rules. Raises ValueError when it is not JSON, nests past the parser's limit, or holds a lone UTF-16 surrogate
    (`"\\ud800"` escaped inside the string: the body's check cannot see it, and the tokenizer cannot take it)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("it nests too deeply") from None
    if "\\u" in text:  # (a surrogate can come only from an escape)
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except (UnicodeEncodeError, RecursionError):
            raise ValueError("it holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return value
