"""Structured-output requests between their arrival and the scheduler.

A constrained request's grammar compiles on a worker thread (the engine loop must not wait for it); the
request waits here meanwhile. Each step, `admit` hands the requests whose grammar is ready to the scheduler
and fails, alone, those whose schema is bad or whose compile ran out of time.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kiln.engine.messages import RequestFailed

if TYPE_CHECKING:
    from kiln.engine.core.request import Request
    from kiln.engine.core.scheduler import Scheduler
    from kiln.engine.structured_output.grammar import GrammarCache

logger = logging.getLogger("kiln")


class GrammarAdmission:
    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int], cache_bytes: int
    ) -> None:
        self._load_tokenizer = load_tokenizer  # the tokenizer grammars are compiled for, loaded when first needed
        self._vocab_size, self._eos_token_ids = vocab_size, eos_token_ids
        self._cache_bytes = cache_bytes
        self._cache: GrammarCache | None = None
        self.waiting: dict[str, Request] = {}  # request id -> request whose grammar is compiling

    def cache(self) -> GrammarCache:
        """The compiled-grammar cache, made (and xgrammar loaded) at the first constrained request."""
        if self._cache is None:
            from kiln.engine.structured_output.grammar import GrammarCache  # noqa: PLC0415  (xgrammar loads on first use)

            self._cache = GrammarCache(
                self._load_tokenizer, self._vocab_size, self._eos_token_ids, max_bytes=self._cache_bytes
            )
        return self._cache

    def add(self, request: Request) -> None:
        # NOTE: nothing is compiled here (the engine thread must not wait): a worker compiles, `admit` admits.
        request.grammar = self.cache().request_grammar(request.sampling_params.structured_output)
        self.waiting[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """A waiting request is gone: its compile is cancelled if nobody else waits for it."""
        request = self.waiting.pop(request_id, None)
        if request is not None:
            self.cache().release(request.grammar)

    def admit(self, scheduler: Scheduler, idle: bool) -> list[RequestFailed]:
        """Requests whose grammar has compiled go to the scheduler; those whose compile failed or ran out of
        time are returned, failed. With nothing else to run (`idle`), wait a moment for a compile rather than
        spin."""
        failed = []
        if idle:
            compiles = [request.grammar.compiled for request in self.waiting.values()]
            concurrent.futures.wait(compiles, timeout=0.01, return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        for request_id, request in list(self.waiting.items()):
            try:
                if not request.grammar.poll(now):
                    continue
                scheduler.add_request(request)
            except ValueError as e:  # the schema's problem (GrammarError), in words its client can act on
                failed.append(RequestFailed(request_id, str(e)))
            except Exception:  # NOTE: kept waiting, it would raise again at every step and fail every batch
                logger.exception("request %s: its grammar could not be set up", request_id)
                failed.append(RequestFailed(request_id, "internal error while setting up the grammar"))
            del self.waiting[request_id]
            self.cache().release(request.grammar)
        return failed
