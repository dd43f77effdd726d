"""A request's constraint (JSON schema, regex, grammar) checked before it is admitted, in worker processes of the
API server's own: xgrammar's parse of a hostile schema can take minutes, and neither the tokenizer pool nor the
event loop may wait on it. A thread cannot be stopped; a worker past its time limit is killed (and another started
when next needed), so the capacity it held comes back at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
from collections import OrderedDict
from typing import Any

from kiln.engine.sampling_params import StructuredOutputParams

WORKERS = 2
TIMEOUT_S = 10.0
MAX_REMEMBERED = 256


class _Worker:
    """One process answering checks over a pipe, one at a time."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # (fork: a copy of a process with an event loop and threads)
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), name="kiln-grammar-check", daemon=True)
        self.process.start()
        theirs.close()

    def ask(self, constraint: dict[str, Any], timeout: float) -> tuple[bool, str | None]:
        """(answered, the problem or None); not answered within `timeout`: the worker is killed."""
        self.conn.send(constraint)
        if self.conn.poll(max(timeout, 0.0)):
            return True, self.conn.recv()
        self.kill()
        return False, None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


def _serve(conn) -> None:
    os.nice(10)  # a check yields the CPU to the server and the engine: a flood of them slows only each other
    from kiln.engine.structured_output.constraints import GrammarError, check_grammar  # noqa: PLC0415

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


class ChecksBusy(Exception):
    """Every worker stayed busy through the time limit (with other requests' constraints)."""


class OwnerBusy(Exception):
    """The owner (an API key) has as many checks in flight as it may: one, so a key flooding the workers with
    slow constraints takes one of them at most."""


class GrammarChecks:
    """At most `workers` checks at once, each (its wait for a free worker included) within `timeout` seconds."""

    def __init__(self, workers: int = WORKERS, timeout: float = TIMEOUT_S, remembered: int = MAX_REMEMBERED) -> None:
        self.timeout = timeout
        self._slots: asyncio.Queue | None = None  # a free worker each (None: not started yet)
        self._workers = workers
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
            return await self._ask(constraint, key)
        finally:
            self._owners.discard(owner)

    async def _ask(self, constraint: StructuredOutputParams, key: tuple[str, str]) -> str | None:
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Queue()
            for _ in range(self._workers):
                self._slots.put_nowait(None)
        deadline = loop.time() + self.timeout
        try:
            worker = await asyncio.wait_for(self._slots.get(), self.timeout)
        except TimeoutError:
            raise ChecksBusy from None
        if worker is None or not worker.process.is_alive():
            worker = _Worker()
        asked = loop.run_in_executor(None, worker.ask, dataclasses.asdict(constraint), deadline - loop.time())
        # the worker goes back once its answer is in (or it is killed), even when this request is gone first
        asked.add_done_callback(lambda done: self._slots.put_nowait(worker if done.result()[0] else None))
        answered, problem = await asyncio.shield(asked)
        if not answered:
            raise TimeoutError
        self._answers[key] = problem
        if len(self._answers) > self._remembered:
            self._answers.popitem(last=False)
        return problem

    def close(self) -> None:
        while self._slots is not None and not self._slots.empty():
            if (worker := self._slots.get_nowait()) is not None:
                worker.kill()
