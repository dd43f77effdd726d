"""`kiln serve` as a real process on a real port, for the server tests, and what they check of its processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

FAULT_INJECTION = Path(__file__).parent / "fault_injection"  # its sitecustomize.py breaks steps on request

API_KEY = "test-key"
# What no error message may show: a file path, a module, an address
LEAK = re.compile(
    r"/(?:tmp|home|root|usr|var|opt|work|proc|etc|lib|srv|mnt|private)/|site-packages|\w\.py\b"
    r"|\w\.(?:so|cc|cpp|h)\b|0x[0-9a-fA-F]{5,}|object at |Traceback|File \""
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`kiln serve MODEL_DIR --enforce-eager --max-model-len 128` on a free port, started and healthy. `fault_token`: a
    step of the engine core fails when a prompt holds this token id; `slow_token`: such a step first sleeps
    (TEST_SLOW_SECONDS in `env`, default 5); `stall_seconds`: POST /tokenize with an `X-Test-Stall` header blocks the
    API server's event loop that long; `server_fault_token`: the API server raises a bug of its own when a request is
    handed that token id (`fault_injection/sitecustomize.py`)."""

    def __init__(
        self,
        model_dir,
        *extra: str,
        auth: tuple[str, ...] = ("--api-key", API_KEY),
        env: dict[str, str] | None = None,
        fault_token: int | None = None,
        slow_token: int | None = None,
        stall_seconds: float | None = None,
        server_fault_token: int | None = None,
    ) -> None:
        env = dict(env or {})
        hooks = (fault_token, slow_token, stall_seconds, server_fault_token)
        if any(hook is not None for hook in hooks):
            path = os.environ.get("PYTHONPATH")
            env["PYTHONPATH"] = str(FAULT_INJECTION) + (os.pathsep + path if path else "")
        if fault_token is not None:
            env["TEST_FAULT_TOKEN"] = str(fault_token)
        if slow_token is not None:
            env["TEST_SLOW_TOKEN"] = str(slow_token)
        if stall_seconds is not None:
            env["TEST_STALL_SECONDS"] = str(stall_seconds)
        if server_fault_token is not None:
            env["TEST_SERVER_FAULT_TOKEN"] = str(server_fault_token)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        cmd = [
            sys.executable,
            "-m",
            "kiln.engine.cli",
            "serve",
            self.model,
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--port",
            str(self.port),
            *auth,
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()[-3000:]}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not start")

    def request(self, method: str, path: str, body: bytes | None = None, key: str | None = API_KEY):
        req = urllib.request.Request(self.url + path, data=body, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, path: str, key: str | None = API_KEY):
        return self.request("GET", path, key=key)

    def post(self, path: str, payload, key: str | None = API_KEY):
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.request("POST", path, body, key)

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1].decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def engine_pid(self) -> int:
        """The engine-core process: the server's child running `python -m kiln.engine.core`."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "-f", "kiln.engine.core"], capture_output=True, text=True
        ).stdout.split()
        return int(out[0])

    def descendants(self) -> list[int]:
        """The server's child processes and theirs (the engine core, TP workers and their resource tracker)."""
        found, frontier = [], [self.proc.pid]
        while frontier:
            out = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True).stdout
            children = [int(pid) for pid in out.split()]
            found += children
            frontier += children
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_gone(pids: list[int], timeout: float = 10) -> None:
    """Each pid exits (the resource tracker, for one, goes a moment after the server)."""
    deadline = time.monotonic() + timeout
    while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)]
