"""A request's constraint (JSON schema, regex, grammar) checked before it is admitted, in worker processes of the
API server's own: xgrammar's parse of a hostile schema can take minutes, and neither the tokenizer pool nor the
event loop may wait on it. A thread cannot be stopped; a worker past its time limit, or whose request has gone, is
killed (and another started when next needed), so the capacity it held comes back at once.

How long a check will take is not known before it runs (a 300-byte schema can take a minute), so one user's slow
constraints must not make another's quick one wait out its time: with no general worker free, a check is tried
first in the first-try lane, which gives it FIRST_TRY_S; one past that waits for a general worker, which gives it
the rest of its time. Waiters of a lane are served shortest constraint first. A worker's start is not counted in
any check's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import multiprocessing
import os
from collections import OrderedDict
from typing import Any

from kiln.engine.sampling_params import StructuredOutputParams

WORKERS = 2  # general lanes; the first-try lane has one more
TIMEOUT_S = 10.0
FIRST_TRY_S = 1.0  # a plain schema parses in milliseconds
START_TIMEOUT_S = 60.0
MAX_REMEMBERED = 256


class _Worker:
    """One process answering checks over a pipe, one at a time."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # (fork: a copy of a process with an event loop and threads)
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), name="kiln-grammar-check", daemon=True)
        self.process.start()
        theirs.close()
        self.started = False

    def ask(self, constraint: dict[str, Any], timeout: float) -> tuple[bool, str | None]:
        """(answered, the problem or None); not answered within `timeout` (its start not counted), or killed from
        outside meanwhile: the worker is killed."""
        try:
            if not self.started:
                if not self.conn.poll(START_TIMEOUT_S):
                    raise EOFError
                self.conn.recv()  # it has imported xgrammar
                self.started = True
            self.conn.send(constraint)
            if self.conn.poll(max(timeout, 0.0)):
                return True, self.conn.recv()
        except (EOFError, OSError):
            pass
        self.kill()
        return False, None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


def _serve(conn) -> None:
    os.nice(10)  # a check yields the CPU to the server and the engine: a flood of them slows only each other
    from kiln.engine.structured_output.constraints import GrammarError, check_grammar  # noqa: PLC0415

    conn.send(None)  # ready
    while True:
        try:
            constraint = conn.recv()
        except EOFError:  # the server is gone
            return
        try:
            check_grammar(StructuredOutputParams(**constraint))
            conn.send(None)
        except (GrammarError, ValueError) as e:
            conn.send(str(e))


class _Lane:
    """Workers (None: one to start) handed to their waiters shortest constraint first. With `spare`, a worker is
    kept started beside them and takes a killed one's place at once (a start takes ~2 s, more on busy cores)."""

    def __init__(self, size: int, spare: bool = False) -> None:
        self.free: list[_Worker | None] = [None] * size
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._keeps_spare = spare
        self.spare: _Worker | None = None

    async def acquire(self, length: int, timeout: float) -> _Worker | None:
        """A worker slot; TimeoutError if none comes within `timeout`."""
        if self._keeps_spare and self.spare is None:
            self.spare = _Worker()
        if self.free:
            return self.free.pop()
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (length, next(self._order), waiter))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), max(timeout, 0.0))
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # handed one just as it gave up: it goes on to the next
                self.release(waiter.result())
            waiter.cancel()
            raise

    def release(self, worker: _Worker | None) -> None:
        if worker is None and self.spare is not None:
            worker, self.spare = self.spare, _Worker()
        while self._waiters:
            waiter = heapq.heappop(self._waiters)[2]
            if not waiter.done():
                waiter.set_result(worker)
                return
        self.free.append(worker)


class ChecksBusy(Exception):
    """Every worker stayed busy through the time limit (with other requests' constraints)."""


class OwnerBusy(Exception):
    """The owner (an API key) has as many checks in flight as it may: one, so a key flooding the workers with
    slow constraints takes one of them at most."""


class GrammarChecks:
    """At most `workers` + 1 checks at once, each (its wait for a worker included) within `timeout` seconds."""

    def __init__(self, workers: int = WORKERS, timeout: float = TIMEOUT_S, remembered: int = MAX_REMEMBERED) -> None:
        self.timeout = timeout
        self.first_try_s = FIRST_TRY_S
        self._general = _Lane(workers)
        self._first_try = _Lane(1, spare=True)
        # the answers for recent constraints (an agent sends one schema again and again), newest last
        self._answers: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._remembered = remembered
        self._owners: set[str] = set()  # those with a check in flight

    async def problem(self, constraint: StructuredOutputParams, owner: str | None = None) -> str | None:
        """What is wrong with `constraint`, or None. Raises TimeoutError when its check takes too long, ChecksBusy
        when no worker came free in time, OwnerBusy when `owner` has a check in flight already."""
        key = (constraint.kind, constraint.spec)
        if key in self._answers:
            self._answers.move_to_end(key)
            return self._answers[key]
        if owner is not None:
            if owner in self._owners:
                raise OwnerBusy
            self._owners.add(owner)
        try:
            problem = await self._ask(dataclasses.asdict(constraint), len(constraint.spec))
        finally:
            self._owners.discard(owner)
        self._answers[key] = problem
        if len(self._answers) > self._remembered:
            self._answers.popitem(last=False)
        return problem

    async def _ask(self, constraint: dict[str, Any], length: int) -> str | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        if not self._general.free:  # NOTE: a try of its own first, however long others' checks hold the workers
            try:
                worker = await self._first_try.acquire(length, deadline - loop.time())
            except TimeoutError:
                raise ChecksBusy from None
            limit = min(self.first_try_s, deadline - loop.time())
            answered, problem = await self._run(self._first_try, worker, constraint, limit)
            if answered:
                return problem
        try:
            worker = await self._general.acquire(length, deadline - loop.time())
        except TimeoutError:
            raise ChecksBusy from None
        answered, problem = await self._run(self._general, worker, constraint, deadline - loop.time())
        if not answered:
            raise TimeoutError
        return problem

    @staticmethod
    async def _run(
        lane: _Lane, worker: _Worker | None, constraint: dict[str, Any], timeout: float
    ) -> tuple[bool, str | None]:
        if worker is None or not worker.process.is_alive():
            worker = _Worker()
        asked = asyncio.get_running_loop().run_in_executor(None, worker.ask, constraint, timeout)
        # the worker goes back once its answer is in, or once it is killed
        asked.add_done_callback(lambda done: lane.release(worker if done.result()[0] else None))
        try:
            return await asyncio.shield(asked)
        except asyncio.CancelledError:  # its request is gone: so is the check (`ask` sees the pipe close)
            with contextlib.suppress(OSError):
                worker.process.kill()
            raise

    def close(self) -> None:
        for lane in (self._general, self._first_try):
            for worker in [*lane.free, lane.spare]:
                if worker is not None:
                    worker.kill()
            lane.free.clear()
            lane.spare = None
