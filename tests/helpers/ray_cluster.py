"""A two-node Ray cluster on 127.0.0.1, as a user would start one (`ray start --head`, then `ray start --address`),
each node with one CPU and a resource naming it. Each `ray start` runs with --block as a child of the test, so
stopping the cluster stops exactly the processes the test started (never `ray stop`, which stops every Ray on the
machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from helpers.server import free_port


def ray_installed() -> bool:
    return shutil.which("ray") is not None


class RayCluster:
    def __init__(self, temp_dir) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = str(temp_dir)
        common = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", "80000000", "--disable-usage-stats"]
        head = [
            "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--include-dashboard",
            "false",
            "--temp-dir",
            self.temp_dir,
            "--resources",
            json.dumps({"kiln_head": 1}),
            *common,
        ]
        other = ["ray", "start", "--block", "--address", self.address, "--resources", json.dumps({"kiln_node2": 1})]
        env = {**os.environ, "RAY_ADDRESS": ""}
        self.processes = [subprocess.Popen(head, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)]
        try:
            self._wait_for_nodes(1)
            self.processes.append(
                subprocess.Popen([*other, *common], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
            )
            self._wait_for_nodes(2)
        except BaseException:
            self.stop()
            raise

    def _wait_for_nodes(self, n: int, timeout: float = 90) -> None:
        code = (
            f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
            "print(sum(1 for node in ray.nodes() if node['Alive']))"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes):
                raise RuntimeError("a `ray start` exited")
            out = subprocess.run(["python", "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
            if out and out[-1].isdigit() and int(out[-1]) >= n:
                return
            time.sleep(1)
        raise RuntimeError(f"the Ray cluster did not reach {n} nodes")

    def descendants(self) -> list[tuple[int, str]]:
        """Every process under the two `ray start`s: (pid, command line)."""
        found, frontier = [], [p.pid for p in self.processes]
        while frontier:
            out = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True).stdout
            for pid in map(int, out.split()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        found.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")))
                except FileNotFoundError:
                    continue
                frontier.append(pid)
        return found

    def stop(self) -> None:
        for process in reversed(self.processes):  # (the worker node first)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
