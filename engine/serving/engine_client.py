"""The API server's handle on the engine-core process: start it, send requests, route outputs back.

The engine core runs as a program of its own (`python -m kiln.engine.core`), so this process never imports it (nor
torch): it writes the engine's `EngineCoreArgs` to the program's standard input and talks `kiln.engine.messages` to
it over two ZMQ sockets.

Outputs for each request land in that request's inbox as they arrive; a handler takes all that is
waiting at once (so a slow reader gets its tokens merged, never stalls anyone). If the engine
process dies, every open request gets `EngineDeadError` and `alive` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any

import zmq
import zmq.asyncio

from kiln.engine import messages
from kiln.engine.config import EngineConfig

logger = logging.getLogger("kiln")


class EngineDeadError(RuntimeError):
    pass


class Inbox:
    """What the engine sent for one HTTP request (its n engine requests share it), until the handler takes
    it. Lighter than asyncio.Queue, whose per-item bookkeeping and wake-up add up at hundreds of outputs a
    step: a put is an append, and a future exists only while the handler waits."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take_all(self) -> list[Any]:
        """Everything waiting; waits for at least one item."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def _decoded(frame: bytes) -> Any:
    """An engine message, its outputs' log-probabilities as tuples.

    NOTE: a slow reader's tokens wait in its queue, each with top-k [id, logprob, rank] lists: a list is watched by
    the garbage collector for as long as it lives, and three readers of n = 48 with top-20 kept a million and a half
    of them, every full collection walking them all (0.3-0.5 s, on the event loop). A tuple of numbers is let go of by
    the collector the first time it is seen, so the backlog costs the collections one object a token, not 22."""
    message = messages.decode(frame)
    if isinstance(message, messages.EngineOutputs):
        for out in message.outputs:
            if out.new_logprobs:
                out.new_logprobs = [tuple(map(tuple, token)) for token in out.new_logprobs]
            if out.prompt_logprobs:
                out.prompt_logprobs = [None if t is None else tuple(map(tuple, t)) for t in out.prompt_logprobs]
    return message


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        engine_timeout: float = 60.0,
        data_parallel_rank: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        """`data_parallel_rank` and `env` (set in the engine core's environment): one of --data-parallel-size cores."""
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.env = env
        # NOTE: the engine core's heartbeat thread sends a word each second, however long its step; this long
        # without one means the process has stopped (e.g. SIGSTOP)
        self.engine_timeout = engine_timeout
        self.death: str | None = None  # why the engine is gone, once it is (for /health)
        self.last_heard = 0.0
        self.queues: dict[str, Inbox] = {}
        self.alive = False
        self.ready: messages.Ready | None = None
        self.stats: dict[str, float] = {}
        self._ipc_dir = tempfile.mkdtemp(prefix="kiln-ipc-")  # mode 0700: only this user can connect
        os.chmod(self._ipc_dir, 0o700)
        self.input_address = f"ipc://{self._ipc_dir}/input"
        self.output_address = f"ipc://{self._ipc_dir}/output"
        self._tasks: list[asyncio.Task] = []

    async def start(self, timeout: float = 3600.0) -> messages.Ready:
        args = messages.EngineCoreArgs(
            dataclasses.asdict(self.config),
            self.input_address,
            self.output_address,
            os.getpid(),
            self.data_parallel_rank,
        )
        # -P: the working directory does not go first on the engine core's module path (nothing there can shadow
        # a package it imports)
        command = [sys.executable, "-P", "-m", "kiln.engine.core"]
        env = None if self.env is None else {**os.environ, **self.env}
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, text=True, env=env)
        self.process.stdin.write(args.to_json())
        self.process.stdin.close()
        self.context = zmq.asyncio.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.connect(self.input_address)
        self.output = self.context.socket(zmq.PULL)
        self.output.connect(self.output_address)
        recv = asyncio.ensure_future(self.output.recv())
        died = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self.process.wait))
        try:
            done, _ = await asyncio.wait({recv, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                raise RuntimeError(f"the engine core failed to start (exit code {self.process.poll()})")
            message = messages.decode(recv.result())
            if isinstance(message, messages.StartupFailed):
                await asyncio.wait({died}, timeout=30)  # it exits by itself; `_close` kills it if not
                raise ValueError(message.message)
        except BaseException:
            await self._close()
            raise
        self.ready = message
        self.stats = self.ready.stats
        self.alive = True
        self.last_heard = asyncio.get_running_loop().time()
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog()), died]
        died.add_done_callback(lambda _: self._on_death())
        return self.ready

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any], q: Inbox | None = None
    ) -> Inbox:
        """Several requests (the n choices of one HTTP request) may share one queue."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        q = q if q is not None else Inbox()
        self.queues[request_id] = q
        self.input.send(messages.encode(messages.AddRequest(request_id, prompt_token_ids, params)))
        return q

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.queues.pop(rid, None)
        if self.alive and request_ids:
            self.input.send(messages.encode(messages.AbortRequests(request_ids)))

    def release(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def engine_index(self, request_id: str) -> int:
        """The engine core a request runs on (always 0: one core)."""
        return 0

    @property
    def engine_stats(self) -> dict[int, dict[str, float]]:
        """Each core's latest stats, by index."""
        return {0: self.stats}

    def fail_all(self, error: Exception) -> None:
        """End every open request with `error` (its handler turns it into an error response)."""
        for q in self.queues.values():
            q.put(error)

    async def _output_loop(self) -> None:
        # NOTE: a frame is decoded on a thread of its own (one: frames stay in order). On the loop, a step's outputs
        # for a hundred streams with top-20 log-probabilities took tens of ms, and frames waiting after a busy moment
        # were read in one go (a ready frame comes without a pass through the loop): /health waited up to 0.5 s
        # beside three slow readers of n = 48. On the thread, the loop gets the interpreter every few ms.
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-decode") as decoder:
            while True:
                frame = await self.output.recv()
                try:
                    message = await loop.run_in_executor(decoder, _decoded, frame)
                except messages.ProtocolError as e:
                    logger.warning("dropped a frame from the engine: %s", e)
                    continue
                self._dispatch(message)

    def _dispatch(self, message: Any) -> None:
        self.last_heard = asyncio.get_running_loop().time()  # (its heartbeat, `Alive`, says no more than that)
        if isinstance(message, messages.EngineFailed):  # it exits next: dead from now on, and /health says why
            self.death = self.death or message.message
            self._on_death()
        if not isinstance(message, messages.EngineOutputs):
            return
        self.stats = message.stats
        for out in message.outputs:
            if (q := self.queues.get(out.request_id)) is not None:
                q.put(out)
        for failure in message.failed:
            if (q := self.queues.get(failure.request_id)) is not None:
                q.put(failure)

    async def _watchdog(self) -> None:
        """Kill an engine core that has said nothing for `engine_timeout` seconds of this loop's running time.

        NOTE: the silence counts only while this event loop runs: a loop stalled by the API server's own work has
        read nothing either, and the engine's heartbeats wait in the socket meanwhile. A stall is forgiven (and
        logged), so the server never blames a healthy engine for its own stall."""
        loop = asyncio.get_running_loop()
        interval = min(1.0, self.engine_timeout / 4)
        while self.alive:
            asleep = loop.time()
            await asyncio.sleep(interval)
            now = loop.time()
            stalled = now - asleep - interval
            if stalled > interval:
                logger.warning("the API server's event loop stalled for %.1f s", stalled)
                self.last_heard += stalled  # (the output loop reads what waited in the socket next)
                continue
            if now - self.last_heard > self.engine_timeout:
                logger.error("the engine core has not answered for %.0f s; killing it", self.engine_timeout)
                self.death = f"the engine core stopped answering for {self.engine_timeout:g} s and was killed"
                self.process.kill()  # its wait then fails every open request
                return

    def _on_death(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.stats = {}  # its last gauges are no longer true: /metrics shows an empty engine
        if self.death is not None:  # (it said why before exiting)
            logger.error("the engine core is stopping: %s", self.death)
        else:
            logger.error("the engine core process exited (code %s)", self.process.returncode)
            code = self.process.returncode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            self.death = f"the engine core process {how}"
        for q in self.queues.values():
            q.put(EngineDeadError("the engine core process died"))

    async def shutdown(self) -> None:
        if self.alive:
            self.input.send(messages.encode(messages.Shutdown()))
        self.alive = False
        await self._close(grace=10)

    async def _close(self, grace: float = 0.0) -> None:
        """Reap the engine-core process (killed if it has not exited within `grace` seconds), close the sockets and
        remove the IPC directory."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.process.wait, grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await loop.run_in_executor(None, self.process.wait, 5)
        for task in self._tasks:
            task.cancel()
        self.context.destroy(linger=0)
        for name in ("input", "output"):  # (the engine core may have died before making them)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._ipc_dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._ipc_dir)
