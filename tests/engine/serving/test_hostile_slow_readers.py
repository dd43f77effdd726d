"""Slow readers beside a normal stream, on a real server: three clients reading ~20 KB/s of streams of 48 choices with
top-20 log-probabilities pile up a backlog of tokens in the API server; the event loop must keep answering /health
and feeding the normal stream without long stalls (the collector walking the backlog once held it ~0.5 s)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from helpers.server import API_KEY, Server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--max-model-len", "512")
    yield s
    s.stop()


def slow_reader(server: Server, stop: threading.Event) -> None:
    """A stream of 48 choices with top-20 log-probabilities, read 2 KB every 0.1 s."""
    body = {"messages": HI, "max_tokens": 450, "ignore_eos": True, "stream": True, "n": 48}
    raw = json.dumps({**body, "logprobs": True, "top_logprobs": 20}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n"
        )
        sock.sendall(head.encode() + raw)
        while not stop.is_set() and sock.recv(2048):
            time.sleep(0.1)


def test_a_normal_stream_and_health_beside_slow_readers(server):
    stop = threading.Event()
    readers = [threading.Thread(target=slow_reader, args=(server, stop)) for _ in range(3)]
    for thread in readers:
        thread.start()
    time.sleep(2)  # their backlogs grow
    health: list[float] = []

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            server.get("/health")
            health.append(time.monotonic() - start)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    body = {"messages": HI, "max_tokens": 450, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {API_KEY}")
    gaps, last, start = [], time.monotonic(), time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            for line in r:
                if line.startswith(b"data:"):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                if now - start > 6:
                    break
    finally:
        stop.set()
        prober.join()
        for thread in readers:
            thread.join()
    health.sort()
    assert len(gaps) > 20
    assert max(gaps[1:]) < 0.4, f"the normal stream waited {max(gaps[1:]):.2f} s between two events"
    assert health[int(len(health) * 0.99) - 1] < 0.3, f"/health p99 {health[int(len(health) * 0.99) - 1]:.2f} s"
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200
