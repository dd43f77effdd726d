"""Who may get in and what may get out, against one real server process: the API key on every route
(path tricks included), HTTP on loopback only, no pickle on the engine socket, a private IPC directory,
error messages without file paths or memory addresses, a bad model path refused at start, and no
engine core left behind when the API server is killed."""

from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from helpers.server import API_KEY, LEAK, Server, assert_all_gone

FAULT_TOKEN = 499  # a prompt holding this token id fails inside the engine (test-only hook)


@pytest.fixture(scope="module")
def ipc_parent(tmp_path_factory):
    # NOTE: the server's TMPDIR, so its IPC directory is found there and not mixed up with other servers'
    return tmp_path_factory.mktemp("ipc")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, ipc_parent):
    s = Server(tiny_llama_dir, env={"TMPDIR": str(ipc_parent)}, fault_token=FAULT_TOKEN)
    yield s
    s.stop()


ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/usage"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


def path_tricks(path: str) -> list[str]:
    rest = path.lstrip("/")
    return [
        path,
        "/" + path,
        f"/./{rest}",
        f"/v1/../{rest}",
        f"/health/../{rest}",
        f"/metrics/..//{rest}",
        f"/%2e%2e/{rest}",
        f"/{rest}/",
        f"/{rest}?x=/health",
        f"/{rest}%00",
        f"/health%2f..%2f{rest}",
    ]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_but_health_and_metrics_needs_the_key(server, method, path):
    body = b"{}" if method == "POST" else None
    for trick in path_tricks(path):
        for key in (None, "wrong", API_KEY + "x", API_KEY[:-1]):
            status, raw = server.request(method, trick, body, key=key)
            assert status == 401, (trick, key, status, raw[:200])
            assert json.loads(raw)["error"]["type"] == "authentication_error"
    assert server.request(method, path, body)[0] != 401  # the right key gets past the door


@pytest.mark.parametrize("given", [b"Bearer \xff\xfe", b"Bearer " + API_KEY.encode() + b"\xe9", b"\xe9"])
def test_a_key_of_non_utf8_bytes_is_refused(server, given):
    """A header that is not UTF-8 is a wrong key (401), not a server error."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + given + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status, body = int(raw.split(b" ", 2)[1]), raw.partition(b"\r\n\r\n")[2]
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error", raw[:300]


def test_health_and_metrics_are_open_and_nothing_else_is(server):
    """The documented rule (README, api_server): exactly GET /health and GET /metrics need no key."""
    assert server.get("/health", key=None)[0] == 200
    assert server.get("/metrics", key=None)[0] == 200
    for path in ("/", "/v1", "/v1/", "/docs", "/health/x", "/metricsx", "/v1/health"):
        assert server.get(path, key=None)[0] == 401, path


def test_http_listens_on_loopback_only(server):
    """No --host: every listening socket on the server's port is bound to 127.0.0.1 (or ::1)."""
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    bound = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.split(":")
                if state == "0A" and int(port, 16) == server.port:  # 0A: LISTEN
                    bound.append(address)
    assert bound and set(bound) <= loopback, bound


def test_engine_socket_rejects_pickle_and_ipc_dir_is_private(server, ipc_parent, tmp_path):
    (ipc_dir,) = glob.glob(str(ipc_parent / "kiln-ipc-*"))
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # unpickling this creates the marker file

    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"ipc://{ipc_dir}/input")
    push.send(pickle.dumps(Payload()))
    push.send(pickle.dumps(Payload(), protocol=0))
    # our messages in shapes the engine would have choked on: dropped with a warning, the engine goes on
    push.send(msgpack.packb(["AbortRequests", {"request_ids": 5}]))
    push.send(msgpack.packb(["AddRequest", {"request_id": ["x"], "prompt_token_ids": [1], "params": {}}]))
    push.send(msgpack.packb(["AddRequest", {"request_id": "x", "prompt_token_ids": [1], "params": {"n": "many"}}]))
    push.close(linger=1000)
    context.term()
    time.sleep(1.0)
    assert not marker.exists()  # never unpickled
    assert server.get("/health")[0] == 200
    assert server.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type", "$ref": "#/nowhere"}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ERRORS = [
    ("POST", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("POST", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404),
    ("POST", "/v1/completions", {"prompt": "hi", "guided_regex": "(["}, 400),
    ("POST", "/v1/completions", {"prompt": "hi", "guided_grammar": "root ::= ("}, 400),
    ("POST", "/v1/chat/completions", {**CHAT, "response_format": BAD_SCHEMA}, 400),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"1": "x"}}, 400),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": [{}]}, 400),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("POST", "/v1/completions", b"[" * 100000, 400),
    ("POST", "/detokenize", {"tokens": [10**9]}, 400),
    ("POST", "/tokenize", {"messages": [{"role": 5}]}, 400),
    ("GET", "/v1/nothing", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", {"prompt": [5, FAULT_TOKEN, 7], "max_tokens": 3}, 500),
    ("POST", "/v1/completions", {"prompt": [5, FAULT_TOKEN, 7], "max_tokens": 3, "stream": True}, 200),
]


@pytest.mark.parametrize("method,path,payload,status", ERRORS)
def test_error_messages_leak_no_paths_or_addresses(server, tiny_llama_dir, method, path, payload, status):
    body = payload if payload is None or isinstance(payload, bytes) else json.dumps(payload).encode()
    code, raw = server.request(method, path, body)
    assert code == status, raw[:300]
    if payload is not None and isinstance(payload, dict) and payload.get("stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        raw = events[-2].encode()  # the error event
    error = json.loads(raw)["error"]
    message = error["message"]
    assert message and not LEAK.search(message), message
    assert str(tiny_llama_dir) not in raw.decode() and os.getcwd() not in raw.decode(), message


def test_a_bad_model_path_fails_at_start_with_a_clear_message(tmp_path):
    """Neither a directory, a GGUF file, a Hub id nor a preset; a file; a directory without config.json: `kiln serve`
    exits 2 with one clear line, before any engine starts."""
    (tmp_path / "file").write_text("{}")
    (tmp_path / "empty").mkdir()
    expected = {
        "missing": "neither a local directory or GGUF file, a Hub id",
        "file": "a file but not a .gguf file",
        "empty": "no config.json",
    }
    start = time.monotonic()
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "kiln.engine.cli", "serve", str(tmp_path / name), "--port", "9"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in expected
    }
    for name, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, stderr[-2000:]
        assert "kiln: error:" in stderr and expected[name] in stderr, stderr[-2000:]
        assert "Traceback" not in stderr + stdout
        assert "serving" not in stdout and "engine core" not in stderr  # refused before anything started
    assert time.monotonic() - start < 90


def test_engine_core_exits_when_the_api_server_is_killed(server):
    """Last in this module: it kills the module's server. The engine core (and every other child)
    notices its parent is gone and exits within seconds; nothing is left running."""
    descendants = server.descendants()
    assert server.engine_pid() in descendants
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    assert_all_gone(descendants)
