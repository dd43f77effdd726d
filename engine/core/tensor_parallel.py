"""Tensor parallelism over torch.distributed: rank 0 in the engine core, ranks 1..N-1 in worker processes.

    engine core (rank 0)                               worker (rank r)
    schedule, prepare inputs into the persistent       build_executor(config, r): the same model
    buffers (previous step's tokens carried in on      shard, KV cache shard, compiled model and graphs;
    the device)                                        no scheduler, no sampler
      -- StepHeader (msgpack, over a pipe) -------->   wait for a header
      -- dist.broadcast: input_ids, positions, ---->   into its own persistent buffers
         slot_mapping, query_start_loc, seq_lens,
         block_table (the used prefixes)
    forward  <----- all-reduce in every layer ----->   forward (same graph plan)
    logits   <----- all-gather of vocab slices ---->   logits (dropped)
    sample; next step                                  next header, or SHUTDOWN: exit

Workers keep no state about requests. The header travels over a pipe, not a collective, so an idle
worker waits on a pipe (no collective timeout while the engine has nothing to do) and learns at once
when rank 0's process is gone (end of file). Transport is torch.distributed's own: gloo on CPU, NCCL
for CUDA tensors (gloo for the few host-side collectives of start-up).

Failure: rank 0 checks its workers are alive before every step; a worker that dies mid-collective
breaks gloo's connections at once, and `raise_if_dead` turns that into `WorkerDiedError` naming the
worker. Workers are stopped and reaped by `close()`, by a failed start-up, when the engine is garbage
collected, and at exit. Every rank drops its CUDA graphs (each one that captured a collective holds its
NCCL communicator) and then leaves the group by aborting it, so no rank waits for another.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing.connection
import multiprocessing.util
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING

import msgpack
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import _abort_process_group

from kiln.backends.attention import AttentionMetadata
from kiln.engine.worker.inputs import GraphPlan

if TYPE_CHECKING:
    from kiln.engine.config import EngineConfig
    from kiln.engine.worker.model_runner import ModelRunner

logger = logging.getLogger("kiln")

# NOTE: collectives wait this long for a live but slow peer: start-up compiles on one rank while another
# already waits in the first all-reduce. A dead peer is caught far sooner (liveness checks, closed sockets).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STARTUP_TIMEOUT = 300.0  # seconds for a worker to import and reach the rendezvous
SHUTDOWN_GRACE = 5.0  # seconds a worker gets to exit by itself before it is killed
LEAVE_TIMEOUT = 30.0  # seconds a rank waits for its group's teardown before it gives up on it
SHUTDOWN = "shutdown"


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot run another step."""


class RanksOutOfStepError(WorkerDiedError):
    """A step failed on rank 0 after the workers had started it: they may be waiting inside its
    collectives, so a retry would pair collectives wrongly. As fatal as a dead worker."""


@dataclass
class StepHeader:
    """What a worker needs, besides the broadcast buffers, to run rank 0's step: the graph plan, the
    metadata's sizes and its host-side copies, and which rows to score (None: no sampling this step)."""

    mode: str  # the GraphPlan mode ("full", "piecewise", "none"), or SHUTDOWN
    num_tokens: int  # padded
    num_reqs: int  # padded
    num_scheduled_reqs: int  # block-table rows rank 0 filled
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: list[int]
    seq_lens: list[int]
    logits_indices: list[int] | None
    prompt_logit_rows: list[list[int]]  # the hidden-row slices [start, end) prompt logprobs run the LM head on
    state_copies: list[list[list[int]]]  # recurrent-state rows to copy before and after the forward: [from, to] pairs

    def encode(self) -> bytes:
        return msgpack.packb(list(astuple(self)), use_bin_type=True)

    @classmethod
    def decode(cls, frame: bytes) -> StepHeader:
        values = msgpack.unpackb(frame, raw=False)
        if len(values) != len(fields(cls)):
            raise ValueError(f"a step header has {len(fields(cls))} fields, got {len(values)}")
        return cls(*values)


def _shutdown_header() -> StepHeader:
    return StepHeader(SHUTDOWN, 0, 0, 0, 0, 0, 0, [], [], None, [], [[], []])


def step_tensors(runner: ModelRunner, header: StepHeader) -> list[torch.Tensor]:
    """The step's inputs in the runner's input arena, in broadcast order (the same layout on every rank)."""
    inputs = runner.inputs.views(header.num_tokens, header.num_reqs)
    # (several KV groups' slot mappings go whole, [G, n]: a slice of each row would not be one contiguous tensor)
    several = runner.inputs.num_groups > 1
    return [
        inputs.input_ids,
        inputs.positions,
        inputs.slot_mapping if several else inputs.slot_mapping[: header.num_actual_tokens],
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.state_slots,
        inputs.state_folds,
        inputs.block_table[: header.num_scheduled_reqs],
    ]


def _backend(device: torch.device) -> str:
    # CUDA tensors over NCCL; host tensors (start-up's KV sizing) over gloo, which notices a dead peer at once.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def cpu_threads_per_rank(tp_size: int) -> int:
    """On CPU the ranks share the cores. NOTE: OpenMP threads spin after each parallel region, so ranks
    that together oversubscribe the cores starve each other inside every collective (25x slower steps)."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


def min_across_ranks(value: int) -> int:
    """The smallest of every rank's `value` (KV blocks: each rank's cache must hold them all)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


# ---- rank 0 -----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class WorkerLink:
    """One of ranks 1..N-1 as rank 0 sees it: the connection its step headers go over and, for a rank this process
    started, its process. A rank elsewhere (another node's, a Ray actor) sends nothing once it has joined, so its
    connection turning readable means it closed: the rank is gone."""

    rank: int
    conn: multiprocessing.connection.Connection
    where: str  # how messages name it
    process: multiprocessing.Process | None = None

    def waitable(self):
        return self.process.sentinel if self.process is not None else self.conn

    def death(self) -> str | None:
        if self.process is not None:
            alive = self.process.is_alive()
            return None if alive else f"tensor-parallel {self.where} exited with code {self.process.exitcode}"
        try:
            if self.conn.poll(0):
                self.conn.recv_bytes()
        except (EOFError, OSError):
            return f"tensor-parallel {self.where} is gone (its connection closed)"
        return None


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, announces each step, watches them, stops them.

    Where the ranks run (config.distributed_executor_backend, config.nnodes):
        mp, one node       ranks 1..N-1 are processes spawned here, headers over pipes, the store on loopback
        mp, --nnodes M     this node's ranks 1..N/M-1 spawned here; the other nodes' ranks are started there
                           (`kiln serve --headless`), find the store at --master-addr:--master-port and connect
                           back for their headers
        ray                ranks 1..N-1 are Ray actors in a placement group over the cluster Kiln joined
                           (ray_workers.py), connecting back as another node's ranks do
    """

    def __init__(
        self, config: EngineConfig, device: torch.device, release_graphs: Callable[[], None] | None = None
    ) -> None:
        """Start ranks 1..N-1 and join their group. `release_graphs` drops rank 0's CUDA graphs: it runs before rank 0
        leaves the group (a graph that captured a collective holds its communicator)."""
        self.size = config.tensor_parallel_size
        ray = config.distributed_executor_backend == "ray"
        local = 1 if ray else self.size // config.nnodes  # ranks on this node, rank 0 among them
        if device.type == "cuda":  # local rank r runs on GPU first + r
            first, visible = device.index or 0, torch.cuda.device_count()
            if first + local > visible:
                raise ValueError(
                    f"tensor_parallel_size {self.size} needs GPUs {first}..{first + local - 1}, "
                    f"but {visible} are visible"
                )
        if dist.is_initialized():
            gc.collect()  # an engine dropped without close() gives its process group back in its finalizer
            if dist.is_initialized():
                raise RuntimeError("a tensor-parallel engine is already running in this process; close() it first")
        # NOTE: NVLink multicast (NVLS) stays off: the GPU machines require it, and workers inherit the setting.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        if local == self.size:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share one host: loopback only
        host, port = _store_address(config, ray)
        # NOTE: the store's server binds every interface when it makes its own socket, and it takes no address:
        # it is handed one listening on the address given, which it then owns
        try:
            listener = socket.create_server((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} for the tensor-parallel ranks ({e.strerror})") from None
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            self.size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT),
            master_listen_fd=listener.detach(),
        )
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(self.size if ray else local))
        self.links: list[WorkerLink] = []
        self._failure: str | None = None
        self._ray = None  # the placement group and its actors, with backend ray
        self._held: list = []  # what is let go of after the workers stop (the Ray placement group)
        # Stops the workers when this object is collected, and at exit (also in a spawned engine-core process,
        # where atexit handlers do not run but multiprocessing's finalizers do).
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_workers, args=(self.links, threads, release_graphs, self._held), exitpriority=10
        )
        try:
            remote = _HeaderListener(host, store) if local < self.size else None
            self._start_local(config, host, store.port, range(1, local))
            if ray:
                from kiln.engine.core.ray_workers import RayWorkers  # noqa: PLC0415  (ray only where asked for)

                self._ray = RayWorkers(config, range(1, self.size), host, store.port)
                self._held.append(self._ray)
            self._wait_for_rendezvous(remote, self.size - local)
            dist.init_process_group(
                _backend(device), store=store, rank=0, world_size=self.size, timeout=COLLECTIVE_TIMEOUT
            )
        except BaseException:
            # NOTE: the traceback keeps this object, and so the finalizer, alive: the workers that did start
            # would wait at the rendezvous until its timeout.
            self.close()
            raise
        logger.info("tensor parallel: %d ranks (%s)", self.size, ", ".join(link.where for link in self.links))

    @property
    def processes(self) -> list[multiprocessing.Process]:
        """The worker processes this process started (ranks on this node)."""
        return [link.process for link in self.links if link.process is not None]

    def _start_local(self, config: EngineConfig, host: str, port: int, ranks: range) -> None:
        # (the worker's module imports this one)
        from kiln.engine.core.tensor_parallel_worker import worker_main  # noqa: PLC0415

        spawn = mp.get_context("spawn")
        for rank in ranks:
            ours, theirs = spawn.Pipe()
            process = spawn.Process(
                target=worker_main, args=(config, rank, host, port, rank, theirs), name=f"kiln-tp-worker-{rank}"
            )
            process.start()
            theirs.close()
            self.links.append(WorkerLink(rank, ours, f"worker {process.name} (pid {process.pid})", process))

    def _wait_for_rendezvous(self, remote: _HeaderListener | None, num_remote: int) -> None:
        """Every worker says it has imported and is joining (one elsewhere by connecting back); one that dies first
        fails start-up at once."""
        waiting = {link.conn: link for link in self.links}
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while waiting or num_remote:
            if time.monotonic() > deadline:
                missing = num_remote + len(waiting)
                raise WorkerDiedError(f"{missing} tensor-parallel ranks did not start within {STARTUP_TIMEOUT:.0f}s")
            sources = [*waiting, *(link.process.sentinel for link in waiting.values())]
            if remote is not None and num_remote:
                sources.append(remote.socket)
            ready = multiprocessing.connection.wait(sources, timeout=1.0)
            self.check_alive()
            if self._ray is not None:
                self._ray.check_started()
            for pipe in [p for p in ready if p in waiting]:
                pipe.recv_bytes()
                del waiting[pipe]
            if remote is not None and remote.socket in ready:
                link = remote.accept(self._ray)
                if link is not None:
                    self.links.append(link)
                    num_remote -= 1
        if remote is not None:
            remote.close()

    # ---- each step --------------------------------------------------------------------------------------

    def broadcast_step(
        self,
        runner: ModelRunner,
        metadata: AttentionMetadata,
        plan: GraphPlan,
        num_scheduled_reqs: int,
        sample_rows: list[int],
        prompt_logit_rows: list[tuple[int, int]] = (),
        state_copies: tuple = ((), ()),
        logit_rows: list[int] | None = None,
    ) -> None:
        """Announce the step rank 0 has just prepared and send its inputs; every rank then runs the forward."""
        self.check_alive()
        logits_indices = None
        if logit_rows is not None:  # (speculative decoding: every row of the requests verifying drafts)
            logits_indices = logit_rows
        elif sample_rows:  # the last token of each sampled request
            logits_indices = (metadata.query_start_loc_cpu[1:][sample_rows] - 1).tolist()
        header = StepHeader(
            plan.mode,
            plan.num_tokens,
            plan.num_reqs,
            num_scheduled_reqs,
            metadata.num_actual_tokens,
            metadata.max_query_len,
            metadata.max_seq_len,
            metadata.query_start_loc_cpu.tolist(),
            metadata.seq_lens_cpu.tolist(),
            logits_indices,
            [list(r) for r in prompt_logit_rows],
            [[list(pair) for pair in copies] for copies in state_copies],
        )
        frame = header.encode()
        for link in self.links:
            link.conn.send_bytes(frame)
        for tensor in step_tensors(runner, header):
            dist.broadcast(tensor, src=0)

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for a step's device work, checking the workers meanwhile: a collective with a dead peer
        never completes, and `event.synchronize()` would wait for it forever."""
        while not event.query():
            self.check_alive()
            time.sleep(20e-6)

    def check_alive(self) -> None:
        if self._failure is None:
            dead = [death for link in self.links if (death := link.death()) is not None]
            if dead:
                self._failure = ", ".join(dead)
        if self._failure is not None:
            raise WorkerDiedError(f"{self._failure}; the engine cannot continue")

    def raise_if_dead(self, error: BaseException, grace: float = 0.5) -> None:
        """After a failed step or start-up: if a worker died (a collective with it broke), raise that instead
        of the collective's own error. Its exit may lag its closed sockets by a moment, hence the grace.

        Only a RuntimeError can be a broken collective: any other error is this rank's own (a ValueError
        every rank raises at start-up, say), and it is the one to report."""
        if isinstance(error, WorkerDiedError) or not isinstance(error, RuntimeError):
            return
        links = {link.waitable(): link for link in self.links}
        for ready in multiprocessing.connection.wait(list(links), timeout=grace):
            # NOTE: a killed process closes its sockets and sentinel before it can be reaped (its threads still
            # exiting), and `is_alive` is true until then: wait for that too.
            if links[ready].process is not None:
                links[ready].process.join(grace)
        try:
            self.check_alive()
        except WorkerDiedError as died:
            raise died from error

    def close(self) -> None:
        """Tell the workers to exit, reap them (killing any that do not go), and leave the process group."""
        self._finalizer()


def _stop_workers(links: list[WorkerLink], threads: int, release_graphs: Callable[[], None] | None, held: list) -> None:
    frame = _shutdown_header().encode()
    for link in links:
        with contextlib.suppress(OSError):  # a worker already gone
            link.conn.send_bytes(frame)
    deadline = time.monotonic() + SHUTDOWN_GRACE
    for link in links:
        if link.process is not None:
            link.process.join(max(deadline - time.monotonic(), 0))
        else:  # (a rank elsewhere closes its connection as it exits)
            multiprocessing.connection.wait([link.conn], timeout=max(deadline - time.monotonic(), 0))
    for link in links:
        if link.process is not None and link.process.is_alive():
            logger.warning("tensor-parallel %s did not exit; killing it", link.where)
            link.process.kill()
            link.process.join()
    for link in links:
        link.conn.close()
    for thing in held:  # (Ray's actors and placement group, once the ranks are out)
        thing.release()
    if release_graphs is not None:
        release_graphs()
    leave_group()
    torch.set_num_threads(threads)


def _store_address(config: EngineConfig, ray: bool) -> tuple[str, int]:
    """Where rank 0's store listens: loopback when every rank is on this host, --master-addr:--master-port for
    several nodes, this node's address (a free port) for Ray's actors."""
    if ray:
        from kiln.engine.core.ray_workers import node_address  # noqa: PLC0415

        return node_address(), 0
    if config.nnodes > 1:
        return config.master_addr, config.master_port
    return "127.0.0.1", 0


class _HeaderListener:
    """Where ranks on other nodes (or Ray actors) connect for their step headers: a socket on the store's address,
    its port and key in the store; each connection authenticated with the key (multiprocessing's challenge) and
    naming its rank."""

    def __init__(self, host: str, store: dist.TCPStore) -> None:
        self.socket = socket.create_server((host, 0))
        self.key = secrets.token_bytes(32)
        store.set("kiln/header_address", f"{host}:{self.socket.getsockname()[1]}")
        store.set("kiln/header_key", self.key.hex())

    def accept(self, ray) -> WorkerLink | None:
        """The rank that connected, or None for a connection that failed the challenge."""
        sock, peer = self.socket.accept()
        # NOTE: an OS-level receive timeout (the connection reads its file descriptor itself, blocking): a peer that
        # connects and says nothing fails its challenge instead of holding rank 0's start-up
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 30, 0))
        conn = multiprocessing.connection.Connection(sock.detach())
        try:
            multiprocessing.connection.deliver_challenge(conn, self.key)
            multiprocessing.connection.answer_challenge(conn, self.key)
            rank = int(conn.recv_bytes().decode().removeprefix("joining "))
            with socket.socket(fileno=os.dup(conn.fileno())) as view:  # (no timeout once joined: idle is normal)
                view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        except (OSError, EOFError, ValueError, multiprocessing.AuthenticationError) as e:
            logger.warning("a connection from %s to the tensor-parallel header socket failed: %s", peer[0], e)
            conn.close()
            return None
        where = ray.describe(rank) if ray is not None else f"rank {rank} on {peer[0]}"
        return WorkerLink(rank, conn, where)

    def close(self) -> None:
        self.socket.close()


def leave_group(timeout: float = LEAVE_TIMEOUT) -> None:
    """Tear down this process's group without waiting for the other ranks; the caller has dropped its CUDA
    graphs first (an NCCL communicator's teardown waits for every graph that captured one of its collectives).

    NOTE: `destroy_process_group` flushes NCCL communicators (ncclCommFinalize since torch 2.6), which waits
    on peers that may be gone or tearing down themselves; an abort is local. It runs in a daemon thread: if it
    still does not return, the group is given up on (logged) rather than the process hung."""
    if not dist.is_initialized():
        return
    thread = threading.Thread(target=_abort_process_group, name="kiln-tp-leave", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.error("leaving the tensor-parallel group did not finish within %.0f s; going on without it", timeout)


# ---- ranks 1..N-1 -----------------------------------------------------------------------------------------
