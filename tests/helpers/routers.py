"""The routers Kiln's replicas sit behind, as processes on 127.0.0.1: vllm-router (`pip install vllm-router`) and SMG
(`pip install smg`), started on free ports and ready once every worker is registered and healthy."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import openai

from helpers.server import free_port

ROUTERS = {"vllm-router": ["vllm-router"], "smg": ["smg", "launch"]}


def installed(kind: str) -> bool:
    return shutil.which(ROUTERS[kind][0]) is not None


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Router:
    """`kind` ("vllm-router" or "smg") in front of `workers` (base URLs), with `policy` and the router's own `extra`
    flags. Health is probed each second and one failure marks a worker down (so a dead one is seen fast)."""

    def __init__(self, kind: str, workers: list[str], policy: str, *extra: str, model: str = "tiny") -> None:
        self.kind, self.workers, self.model = kind, workers, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            *ROUTERS[kind],
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *workers,
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-startup-check-interval",
            "1",
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            *extra,
        ]
        # (a file, not a pipe: a pipe nobody reads would block a router that logs a lot; closed by `stop`)
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited: {self.output()[-3000:]}")
            if self._ready():
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{kind} did not become ready")

    def _ready(self) -> bool:
        try:
            models = get_json(self.url + "/v1/models")
            if self.model not in [m["id"] for m in models.get("data", [])]:
                return False
            if self.kind == "smg":  # (it serves before every worker has registered)
                workers = get_json(self.url + "/workers")["workers"]
                return len(workers) == len(self.workers) and all(w["is_healthy"] for w in workers)
            return True
        except (OSError, ValueError, KeyError):
            return False

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
