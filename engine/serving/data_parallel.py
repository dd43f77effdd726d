"""`--data-parallel-size N`: N engine cores behind the one API server, each a whole copy of the model on devices of
its own, as vLLM's data parallelism on one host runs them.

    API server ── DataParallelClient ──┬── AsyncEngineClient 0 ── engine core 0   (GPUs 0 .. t-1)
                                        ├── AsyncEngineClient 1 ── engine core 1   (GPUs t .. 2t-1)
                                        └── ...                                     t = --tensor-parallel-size

A request goes to the core that holds most of its prompt's prefix (the cores it sent each prefix's blocks to, as
far as the API server knows), unless that core has more requests in hand than the least loaded one by more than
`AFFINITY_SLACK`; then, and for a prompt no core has seen, to the least loaded (vLLM's queue-length balance). The n
choices of one request are independent requests: each is placed on its own.

A core that dies is reported (/health says which, its requests fail at once, `death`) and the others serve on: the
server is degraded, and an orchestrator that reads /health replaces it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections import OrderedDict
from typing import Any

from kiln.engine import messages
from kiln.engine.config import EngineConfig
from kiln.engine.serving.engine_client import AsyncEngineClient, EngineDeadError, Inbox

AFFINITY_SLACK = 4  # requests in hand a core may have past the least loaded one and still get its prefixes
AFFINITY_BLOCKS = 64  # a prompt's first blocks remembered (a long shared prefix is told apart from the rest by then)
AFFINITY_ENTRIES = 200_000  # block prefixes remembered in all, least recently used forgotten first
SUMMED = ("running", "waiting", "free_blocks", "prefix_queries", "prefix_hits", "preemptions")


def visible_devices(rank: int, per_rank: int) -> str:
    """The GPUs (CUDA_VISIBLE_DEVICES) of data-parallel rank `rank`: its slice of what the server may use."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in given.split(",") if d] if given else [str(i) for i in range(per_rank * (rank + 1))]
    mine = devices[rank * per_rank : (rank + 1) * per_rank]
    if len(mine) < per_rank:
        raise ValueError(f"data-parallel rank {rank} needs {per_rank} GPUs, and CUDA_VISIBLE_DEVICES holds too few")
    return ",".join(mine)


class PrefixAffinity:
    """Which core each prompt prefix (whole blocks, hashed as a chain) was last sent to."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.owner: OrderedDict[int, int] = OrderedDict()

    def chain(self, token_ids: list[int]) -> list[int]:
        size, keys, key = self.block_size, [], 0
        for i in range(min(len(token_ids) // size, AFFINITY_BLOCKS)):
            key = hash((key, *token_ids[i * size : (i + 1) * size]))
            keys.append(key)
        return keys

    def holder(self, keys: list[int]) -> tuple[int | None, int]:
        """The core holding the longest of these prefixes, and how many blocks long it is."""
        for n in range(len(keys), 0, -1):
            if (engine := self.owner.get(keys[n - 1])) is not None:
                return engine, n
        return None, 0

    def record(self, keys: list[int], engine: int) -> None:
        for key in keys:
            self.owner[key] = engine
            self.owner.move_to_end(key)
        while len(self.owner) > AFFINITY_ENTRIES:
            self.owner.popitem(last=False)


class DataParallelClient:
    """What the API server sees of N engine cores: `AsyncEngineClient`'s interface, requests placed on cores."""

    def __init__(self, config: EngineConfig, engine_timeout: float = 60.0) -> None:
        self.size = config.data_parallel_size
        per_rank = config.tensor_parallel_size
        if config.device.startswith("cuda:"):
            raise ValueError("with --data-parallel-size, give --device cuda or auto: each core takes its own GPUs")
        one = dataclasses.replace(config, data_parallel_size=1)
        self.engines = []
        for rank in range(self.size):
            env = None if config.device == "cpu" else {"CUDA_VISIBLE_DEVICES": visible_devices(rank, per_rank)}
            self.engines.append(AsyncEngineClient(one, engine_timeout, rank, env))
        self.affinity = PrefixAffinity(config.block_size)
        self.engine_of: dict[str, int] = {}  # each request in hand: its core
        self.in_hand = [0] * self.size  # requests each core has, as this server counts them
        self.ready: messages.Ready | None = None

    async def start(self, timeout: float = 3600.0) -> messages.Ready:
        """Start every core at once; one that fails stops the others and raises its error."""
        starts = [asyncio.ensure_future(engine.start(timeout)) for engine in self.engines]
        try:
            readies = await asyncio.gather(*starts)
        except BaseException:
            for task in starts:
                task.cancel()
            results = await asyncio.gather(*starts, return_exceptions=True)
            for engine, result in zip(self.engines, results):
                if isinstance(result, messages.Ready):
                    await engine.shutdown()
            raise
        self.ready = readies[0]
        return self.ready

    # ---- what the API server reads -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Some core can serve."""
        return any(engine.alive for engine in self.engines)

    @property
    def death(self) -> str | None:
        """Which cores died and why (None while all run)."""
        dead = [f"engine core {r} of {self.size}: {e.death}" for r, e in enumerate(self.engines) if e.death]
        return "; ".join(dead) or None

    @property
    def engine_stats(self) -> dict[int, dict[str, float]]:
        return {r: engine.stats for r, engine in enumerate(self.engines)}

    @property
    def stats(self) -> dict[str, float]:
        """All cores' stats in one: counts summed, KV usage averaged over the live cores."""
        live = [engine.stats for engine in self.engines if engine.alive]
        if not live:
            return {}
        total: dict[str, float] = {key: sum(s.get(key, 0) for s in live) for key in live[0]}
        total["kv_usage"] = sum(s.get("kv_usage", 0.0) for s in live) / len(live)
        return total

    # ---- requests --------------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any], q: Inbox | None = None
    ) -> Inbox:
        live = [r for r, engine in enumerate(self.engines) if engine.alive]
        if not live:
            raise EngineDeadError("no engine core is running")
        keys = self.affinity.chain(prompt_token_ids)
        least = min(live, key=lambda r: self.in_hand[r])
        holder, _ = self.affinity.holder(keys)
        chosen = least
        if holder is not None and holder in live and self.in_hand[holder] <= self.in_hand[least] + AFFINITY_SLACK:
            chosen = holder
        q = self.engines[chosen].add_request(request_id, prompt_token_ids, params, q)
        self.affinity.record(keys, chosen)
        self.engine_of[request_id] = chosen
        self.in_hand[chosen] += 1
        return q

    def engine_index(self, request_id: str) -> int:
        return self.engine_of.get(request_id, 0)

    def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            if (engine := self.engine_of.get(rid)) is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, rids in by_engine.items():
            self.engines[engine].abort(rids)

    def release(self, request_id: str) -> None:
        if (engine := self.engine_of.pop(request_id, None)) is not None:
            self.in_hand[engine] -= 1
            self.engines[engine].release(request_id)

    def fail_all(self, error: Exception) -> None:
        for engine in self.engines:
            engine.fail_all(error)

    async def shutdown(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.engines), return_exceptions=True)


def engine_client(config: EngineConfig, engine_timeout: float) -> AsyncEngineClient | DataParallelClient:
    """One engine core's client, or the data-parallel one over --data-parallel-size cores."""
    if config.data_parallel_size == 1:
        return AsyncEngineClient(config, engine_timeout)
    return DataParallelClient(config, engine_timeout)
