"""`--distributed-executor-backend ray`: tensor-parallel ranks 1..N-1 as Ray actors, placed over the Ray cluster the
engine core joins (it starts none: `ray start` made it, RAY_ADDRESS or the local node's says where it is).

    engine core (rank 0, on the driver's node) ── placement group: one bundle a rank, {"GPU": 1} or {"CPU": 1}
        bundle on this node  -> rank 0 (kept, so Ray puts no other rank's work on rank 0's device)
        the others           -> RankActor 1..N-1, each `worker_main` in its own process on its bundle's node

Each actor joins rank 0's store (this node's address, a free port) and connects back for its step headers, as a rank
on another node does (tensor_parallel.py). An actor that dies closes that connection: rank 0 fails at once.
"""

from __future__ import annotations

import logging
import os
import socket

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kiln.engine.config import EngineConfig
from kiln.engine.core.tensor_parallel import WorkerDiedError

logger = logging.getLogger("kiln")

PLACEMENT_TIMEOUT = 120.0  # seconds for the cluster to find room for every rank's bundle
PASSED_ON = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", "KILN_DISABLE_COMPILE_CACHE")


def join_cluster() -> None:
    """Connect to the running Ray cluster; never start one (a ValueError, in a line, when there is none)."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or "auto"
    missing = "--distributed-executor-backend ray joins a running Ray cluster (ray start --head ...); none at "
    missing += repr(address)
    if address != "auto" and not address.startswith("ray://"):  # (ray.init retries an address for minutes)
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise ValueError(f"{missing}: {getattr(e, 'strerror', None) or e}") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        raise ValueError(f"{missing}: {e}") from None


def node_address() -> str:
    """This node's address as the cluster knows it (where rank 0's store listens for the actors)."""
    join_cluster()
    return ray.util.get_node_ip_address()


@ray.remote
class RankActor:
    def run(self, config: EngineConfig, rank: int, host: str, port: int) -> None:
        from kiln.engine.core.tensor_parallel_worker import worker_main  # noqa: PLC0415

        worker_main(config, rank, host, port, 0)  # (Ray makes its one GPU device 0)


class RayWorkers:
    """The placement group and the actors of `ranks`, started; `release` gives them back to the cluster."""

    def __init__(self, config: EngineConfig, ranks: range, host: str, port: int) -> None:
        join_cluster()
        gpu = config.device != "cpu" and bool(ray.cluster_resources().get("GPU"))
        resource = {"GPU": 1} if gpu else {"CPU": 1}
        self.group = placement_group([resource] * (len(ranks) + 1), strategy="PACK")
        self.actors: dict[int, RankActor] = {}
        self.nodes: dict[int, str] = {}
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT)
        if not ready:
            self.release()
            raise ValueError(
                f"the Ray cluster found no room for {len(ranks) + 1} bundles of {resource} within "
                f"{PLACEMENT_TIMEOUT:.0f}s (ray status shows what it has)"
            )
        here = ray.get_runtime_context().get_node_id()
        placed = placement_group_table(self.group)["bundles_to_node_id"]
        mine = [bundle for bundle, node in placed.items() if node == here]
        if not mine:
            self.release()
            raise ValueError("the Ray placement group has no bundle on the engine core's node, where rank 0 runs")
        others = [bundle for bundle in sorted(placed) if bundle != mine[0]]
        env = {name: os.environ[name] for name in PASSED_ON if name in os.environ}
        self.runs = {}
        for rank, bundle in zip(ranks, others):
            actor = RankActor.options(
                num_cpus=resource.get("CPU", 0),
                num_gpus=resource.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": env},
                name=f"kiln-tp-rank-{rank}-{os.getpid()}",
            ).remote()
            self.actors[rank], self.nodes[rank] = actor, placed[bundle]
            self.runs[rank] = actor.run.remote(config, rank, host, port)
        logger.info(
            "tensor parallel over Ray: rank 0 on node %s, ranks %s on nodes %s",
            here,
            list(ranks),
            sorted(set(self.nodes.values())),
        )

    def describe(self, rank: int) -> str:
        return f"rank {rank} (a Ray actor on node {self.nodes.get(rank, '?')[:12]})"

    def check_started(self) -> None:
        """Raise the error of an actor that ended before joining (its import or start-up failed)."""
        done, _ = ray.wait(list(self.runs.values()), timeout=0)
        for ref in done:
            rank = next(r for r, run in self.runs.items() if run == ref)
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 (whatever ended it is the message)
                raise WorkerDiedError(f"tensor-parallel {self.describe(rank)} failed to start: {e}") from None
            raise WorkerDiedError(f"tensor-parallel {self.describe(rank)} ended before joining")

    def release(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        remove_placement_group(self.group)
