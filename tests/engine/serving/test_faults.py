"""Faults against real server processes: the engine core SIGKILLed under load, SIGTERM with no drain
time, and no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from helpers.server import API_KEY, Server, assert_all_gone

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"prompt": "x", "max_tokens": 450, "ignore_eos": True}


async def wait_running(server: Server, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(server.metric, "kiln_num_requests_running") < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests ever ran"
        await asyncio.sleep(0.05)


async def open_stream(session: aiohttp.ClientSession, server: Server) -> aiohttp.ClientResponse:
    resp = await session.post(server.url + "/v1/completions", json={**LONG, "stream": True}, headers=HEADERS)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: {")  # the first token: the request runs
    return resp


async def rest_of_stream(resp: aiohttp.ClientResponse, since: float) -> tuple[list[bytes], float]:
    """Every `data:` payload until the server closes the stream, and when it closed (seconds after `since`)."""
    events = []
    async for raw in resp.content:
        if raw.startswith(b"data: "):
            events.append(raw[6:].strip())
    return events, time.monotonic() - since


async def timed_completion(session: aiohttp.ClientSession, server: Server) -> tuple[int, dict, float]:
    async with session.post(server.url + "/v1/completions", json=LONG, headers=HEADERS) as resp:
        body = await resp.json()
        return resp.status, body, time.monotonic()


def assert_ended_with_error(events: list[bytes]) -> str:
    """The stream's last two events are an OpenAI error object and [DONE]; returns the error's message."""
    assert len(events) >= 2 and events[-1] == b"[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["message"] and error["type"]
    return error["message"]


def test_engine_killed_under_load(tiny_llama_dir):
    """SIGKILL the engine core with 6 streams and 3 plain requests running: every stream ends within 2 s
    with an error event and [DONE], the plain ones get a 5xx error object as fast, /health says 503, new
    requests fail at once, and once the server stops no process of it is left."""
    server = Server(tiny_llama_dir, "--max-model-len", "512")
    try:
        engine = server.engine_pid()
        descendants = server.descendants()
        assert engine in descendants

        async def run():
            async with aiohttp.ClientSession() as session:
                streams = [await open_stream(session, server) for _ in range(6)]
                plain = [asyncio.create_task(timed_completion(session, server)) for _ in range(3)]
                await wait_running(server, 9)
                os.kill(engine, signal.SIGKILL)
                killed = time.monotonic()
                ended = await asyncio.gather(*(rest_of_stream(r, killed) for r in streams))
                answered = await asyncio.gather(*plain)
                return killed, ended, answered

        killed, ended, answered = asyncio.run(run())
        for events, seconds in ended:
            assert "engine" in assert_ended_with_error(events)
            assert seconds < 2.0, seconds
        for status, body, done in answered:
            assert 500 <= status < 600 and body["error"]["message"], (status, body)
            assert done - killed < 2.0
        assert server.get("/health")[0] == 503
        start = time.monotonic()
        status, raw = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and json.loads(raw)["error"]["message"]
        assert time.monotonic() - start < 1.0
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert_all_gone(descendants)


def test_sigterm_without_drain_time_ends_requests_and_exits_zero(tiny_llama_dir):
    """`--shutdown-timeout 0`: SIGTERM ends a running stream with an error event and [DONE] and a plain
    request with a 503 error object, at once; the server exits 0 and leaves no process behind."""
    server = Server(tiny_llama_dir, "--max-model-len", "512", "--shutdown-timeout", "0")
    descendants = server.descendants()

    async def run():
        async with aiohttp.ClientSession() as session:
            stream = await open_stream(session, server)
            plain = asyncio.create_task(timed_completion(session, server))
            await wait_running(server, 2)
            server.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            events, stream_seconds = await rest_of_stream(stream, sent)
            status, body, done = await plain
            return events, stream_seconds, status, body, done - sent

    try:
        events, stream_seconds, status, body, plain_seconds = asyncio.run(run())
        assert "shut down" in assert_ended_with_error(events)
        assert status == 503 and "shut down" in body["error"]["message"], body
        assert stream_seconds < 5.0 and plain_seconds < 5.0, (stream_seconds, plain_seconds)
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    assert_all_gone(descendants)
