"""Abusive connections against a real server on loopback, bounded in count and time: slow headers, idle
connections, slow bodies and more connections than the server takes. Each is closed (or refused with an OpenAI
error object) within its time limit, and the server serves a normal request throughout."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from helpers.server import API_KEY, Server

LIMIT = 8


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(
        tiny_llama_dir,
        "--timeout-keep-alive",
        "1",
        "--timeout-request-body",
        "1",
        "--limit-concurrency",
        str(LIMIT),
    )
    yield s
    s.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes `sock` within `seconds`, with what it sent before."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
        return True, received
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        return True, received


def healthy(server) -> bool:
    return server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_an_idle_connection_is_closed(server):
    with connect(server) as sock:
        start = time.monotonic()
        closed, _ = closed_within(sock, 5)
        assert closed and time.monotonic() - start < 4
    assert healthy(server)


def test_a_slow_header_is_closed(server):
    """One byte at a time: the request head never comes whole within --timeout-keep-alive."""
    with connect(server) as sock:
        start = time.monotonic()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
        try:
            for byte in head:
                sock.send(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed, _ = closed_within(sock, 5)
        assert closed and time.monotonic() - start < 8
    assert healthy(server)


def test_a_slow_body_is_a_408_and_closed(server):
    with connect(server) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": ')  # and the rest never comes
        closed, reply = closed_within(sock, 5)
    assert closed and reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["type"] == "timeout"
    assert healthy(server)


def test_connections_past_the_limit_get_a_503(server):
    held = [connect(server) for _ in range(LIMIT)]
    try:
        time.sleep(0.2)
        with connect(server) as extra:
            closed, reply = closed_within(extra, 5)
        assert closed and reply.startswith(b"HTTP/1.1 503"), reply[:200]
        error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "service_unavailable" and "connections" in error["message"]
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10  # the held ones are gone: the server takes new connections again
    while not healthy(server):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_many_slow_clients_at_once_all_go_within_the_timeout(server):
    """More slow-header clients than the limit: every one is closed (or refused) in about the timeout."""
    socks = [connect(server) for _ in range(3 * LIMIT)]
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.send(b"POST /v1/completions HTTP/1.1\r\n")
    start = time.monotonic()
    assert all(closed_within(sock, 5)[0] for sock in socks)
    assert time.monotonic() - start < 6
    for sock in socks:
        sock.close()
    deadline = time.monotonic() + 10
    while not healthy(server):
        assert time.monotonic() < deadline
        time.sleep(0.2)
