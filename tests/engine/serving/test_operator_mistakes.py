"""An operator's mistakes and an unlucky machine, against real `kiln serve` processes: a port in use, SIGTERM while
the engine starts, a step longer than --engine-timeout, an engine that dies, a server killed outright. Each ends in
a clear line or a clear status, and leaves no engine core and no IPC folder behind."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

from helpers.server import API_KEY, Server, alive, assert_all_gone, free_port

SLOW_TOKEN = 77  # a step holding this token sleeps TEST_SLOW_SECONDS (tests/helpers/fault_injection)


def serve_command(model_dir, port: int) -> list[str]:
    return [sys.executable, "-m", "kiln.engine.cli", "serve", str(model_dir), "--enforce-eager", "--port", str(port)]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_port_in_use_is_one_line_at_once_and_starts_no_engine(tiny_llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        run = subprocess.run(serve_command(tiny_llama_dir, port), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("kiln: error:")]
    assert f"127.0.0.1:{port}" in line and "Traceback" not in run.stderr
    assert time.monotonic() - start < 20  # said before the engine would have started, not after


def test_sigterm_while_the_engine_starts_stops_the_engine_too(tiny_llama_dir, tmp_path):
    proc = subprocess.Popen(
        serve_command(tiny_llama_dir, free_port()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    deadline = time.monotonic() + 60
    while not (engine := children(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine, "no engine core started"
    proc.send_signal(signal.SIGTERM)  # the tiny model's start-up takes seconds: this lands inside it
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-2000:]
    assert "serving" not in out  # it never got as far as serving
    assert_all_gone(engine)
    assert not glob.glob(str(tmp_path / "kiln-ipc-*"))


def test_a_step_longer_than_the_engine_timeout_is_not_a_death(tiny_llama_dir):
    """The engine core's heartbeat thread speaks while a step runs (here a prefill made to take 4 s against a 2 s
    --engine-timeout): the request is served, the engine lives."""
    server = Server(tiny_llama_dir, "--engine-timeout", "2", slow_token=SLOW_TOKEN, env={"TEST_SLOW_SECONDS": "4"})
    try:
        code, raw = server.post("/v1/completions", {"prompt": [5, SLOW_TOKEN, 9], "max_tokens": 3})
        assert code == 200, raw
        assert server.get("/health")[0] == 200
        assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
    finally:
        server.stop()


def test_after_an_engine_death_health_says_why_and_metrics_show_it(tiny_llama_dir):
    server = Server(tiny_llama_dir)
    try:
        code, raw = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 200, raw
        metrics = server.get("/metrics")[1].decode()
        assert 'kiln_engine_alive{model_name="' in metrics and server.metric("kiln_kv_cache_free_blocks") > 0
        os.kill(server.engine_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server.get("/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        code, raw = server.get("/health")
        assert code == 503 and json.loads(raw) == {
            "status": "engine dead",
            "reason": "the engine core process was killed by signal 9",
        }
        assert server.metric("kiln_engine_alive") == 0 and server.metric("kiln_kv_cache_free_blocks") == 0
        code, raw = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 503 and json.loads(raw)["error"]["message"] == "the engine is not running"
    finally:
        server.stop()


def test_a_server_killed_outright_leaves_no_engine_and_no_ipc_folder(tiny_llama_dir, tmp_path):
    """The engine core sees its server gone within a second or two, stops, and removes the IPC folder the server
    could not."""
    server = Server(tiny_llama_dir, env={"TMPDIR": str(tmp_path)})
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=API_KEY)[0] == 200
    (ipc_dir,) = glob.glob(str(tmp_path / "kiln-ipc-*"))
    engine = server.descendants()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    assert_all_gone(engine, timeout=20)
    assert not os.path.exists(ipc_dir) and not [pid for pid in engine if alive(pid)]
