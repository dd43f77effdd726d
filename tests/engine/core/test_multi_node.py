"""One model over two nodes, both on this machine: tensor parallelism of 2 with one rank a node, through
torch.distributed's rendezvous (`kiln serve --nnodes 2 --node-rank 0` and a `--headless` node 1) and through a
two-node Ray cluster (`--distributed-executor-backend ray`), collectives over gloo. Greedy tokens equal TP=1's; a node
or rank that dies ends the engine with a clear error in /health, idle or not, and nothing hangs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kiln.engine import LLM, SamplingParams
from kiln.engine.config import EngineConfig

from helpers.ray_cluster import RayCluster, ray_installed
from helpers.server import GREEDY, Server, free_port

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], list(range(20, 61))]
SMALL = ["--kv-cache-memory-bytes", "50000000"]


@pytest.fixture(scope="module")
def tp1(tiny_llama_dir) -> list[str]:
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def completions(server: Server) -> list[str]:
    client = server.client()
    return [client.completions.create(model=server.model, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]


def wait_for_death(server: Server, pattern: str, timeout: float = 20) -> str:
    """The reason /health gives once the engine is dead (it must say `pattern`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = server.get("/health", key=None)
        if status == 503:
            reason = json.loads(body)["reason"]
            assert re.search(pattern, reason), reason
            return reason
        time.sleep(0.2)
    raise AssertionError("the engine did not notice")


def headless(model_dir, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln.engine.cli", "serve", str(model_dir), "--enforce-eager", "--max-model-len"]
    cmd += ["128", *SMALL, "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
    return subprocess.Popen([*cmd, "--master-port", str(port), "--headless"], stdout=subprocess.DEVNULL)


def test_two_nodes_through_the_rendezvous_equal_one_rank_and_a_dead_node_is_said(tiny_llama_dir, tp1):
    port = free_port()
    node1 = headless(tiny_llama_dir, port)
    leader = None
    try:
        args = ["-tp", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port"]
        leader = Server(tiny_llama_dir, *SMALL, *args, str(port))
        assert completions(leader) == tp1
        node1.send_signal(signal.SIGKILL)  # the node is gone: its rank goes with it (the parent-death signal)
        node1.wait(10)
        wait_for_death(leader, r"tensor-parallel rank 1 on 127\.0\.0\.1 is gone \(its connection closed\)")
        status, _ = leader.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503
    finally:
        if leader is not None:
            leader.stop()
        if node1.poll() is None:
            node1.kill()
        node1.wait(10)


def test_the_headless_node_exits_when_the_leader_stops(tiny_llama_dir):
    port = free_port()
    node1 = headless(tiny_llama_dir, port)
    args = ["-tp", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    leader = Server(tiny_llama_dir, *SMALL, *args)
    try:
        leader.stop()
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(tensor_parallel_size=3, nnodes=2), "not a whole number of ranks"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), r"node_rank must be in \[0, 2\)"),
        (dict(tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray"), "Ray places the ranks"),
        (dict(distributed_executor_backend="slurm"), "unknown distributed_executor_backend"),
        (dict(master_port=70000), "master_port must be a port number"),
    ],
)
def test_wrong_node_settings_are_one_error(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_headless_is_for_the_other_nodes(tiny_llama_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kiln.engine.cli", "serve", str(tiny_llama_dir), "--headless"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "--headless runs node 1.." in result.stderr


# ---- Ray ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    if not ray_installed():
        pytest.skip("ray is not installed")
    cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    yield cluster
    cluster.stop()


def test_tp2_over_a_two_node_ray_cluster_equals_one_rank_and_a_dead_actor_is_said(tiny_llama_dir, tp1, ray_cluster):
    env = {"RAY_ADDRESS": ray_cluster.address}
    server = Server(tiny_llama_dir, *SMALL, "-tp", "2", "--distributed-executor-backend", "ray", env=env)
    try:
        assert completions(server) == tp1
        actors = [pid for pid, cmd in ray_cluster.descendants() if cmd.startswith("ray::RankActor")]
        assert len(actors) == 1
        os.kill(actors[0], signal.SIGKILL)
        wait_for_death(server, r"tensor-parallel rank 1 \(a Ray actor on node \w+\) is gone")
    finally:
        server.stop()
    log = server.proc.stdout.read()
    placed = re.search(r"rank 0 on node (\w+), ranks \[1\] on nodes \['(\w+)'\]", log)
    assert placed and placed.group(1) != placed.group(2), "the two ranks ran on one Ray node"


def test_without_a_ray_cluster_the_start_fails_in_a_line(tiny_llama_dir, tmp_path):
    if not ray_installed():
        pytest.skip("ray is not installed")
    env = {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"}  # (nothing listens there)
    with pytest.raises(RuntimeError, match="joins a running Ray cluster"):
        Server(tiny_llama_dir, *SMALL, "-tp", "2", "--distributed-executor-backend", "ray", env=env)
