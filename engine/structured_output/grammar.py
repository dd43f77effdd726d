"""Structured output: a request's JSON schema, regex or EBNF grammar as a mask on its logits (xgrammar).

    add_request ─► GrammarCache.get ─► Future[CompiledGrammar]       (LRU by (kind, spec), bounded by bytes;
                      │                                                 worker processes)
                      │ each step: RequestGrammar.poll() until compiled, failed, or past its time limit
                      ▼
    runner:    enqueue forward + logits ─► GrammarBitmask.apply: fill rows on the host (the device is
               busy meanwhile), copy them over, mask the constrained rows in place ─► sampler
    scheduler: RequestGrammar.accept_token(token) for each token the request gets

A grammar is compiled once per constraint for the engine's tokenizer, in worker processes, so a
pathological schema costs its own request a time-out (its process killed) and never stalls a step. A batch without a
constrained request never reaches this module. The mask is applied before the sampler, so a constrained
request's logprobs are those of the masked distribution (as in vLLM).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar as xgr

from kiln.engine.sampling_params import StructuredOutputParams
from kiln.engine.structured_output.compile_queue import FIRST_TRY_S, CompileJob, CompileQueue
from kiln.engine.structured_output.compile_worker import CompileCancelled, CompileProcess, CompileTimedOut
from kiln.engine.structured_output.constraints import WHAT, GrammarError, check_grammar

__all__ = ["GrammarBitmask", "GrammarCache", "GrammarError", "RequestGrammar", "check_grammar"]

DEFAULT_COMPILE_TIMEOUT_S = 30.0
DEFAULT_MAX_CACHED_GRAMMARS = 128  # failed compiles are remembered too: they cost next to no memory
DEFAULT_MAX_CACHED_BYTES = 512 << 20  # vLLM's VLLM_XGRAMMAR_CACHE_MB
GRAMMARS_PER_BUDGET = 4  # one grammar may take a quarter of the budget: a larger one fails its request


class RequestGrammar:
    """One request's grammar: its compile (shared with other requests through the cache), then its own
    matcher, which follows the request's tokens. The engine admits the request once `poll` says ready, and
    hands it back to the cache (`GrammarCache.release`) when it stops waiting, admitted or not."""

    def __init__(
        self, params: StructuredOutputParams, compiled: Future, timeout_s: float, job: CompileJob | None = None
    ) -> None:
        self.params = params
        self.compiled = compiled
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.matcher: xgr.GrammarMatcher | None = None
        self.job = job  # the compile it waits for, until released
        self.timed_out = False

    def poll(self, now: float | None = None) -> bool:
        """True once compiled (the matcher exists from then on), False while compiling; raises
        `GrammarError` if the compile failed or is still running past the time limit."""
        if self.matcher is not None:
            return True
        if not self.compiled.done():
            if (time.monotonic() if now is None else now) >= self.deadline:
                self.timed_out = True
                raise GrammarError(f"compiling the {WHAT[self.params.kind]} took longer than {self.timeout_s:g} s")
            return False
        self.matcher = xgr.GrammarMatcher(self.compiled.result())  # result() re-raises a GrammarError
        return True

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False (state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()


class GrammarCache:
    """Compiled grammars by (kind, spec); beyond `max_bytes` of compiled grammars (or `max_entries` entries) the least
    recently used are dropped.

    NOTE: a grammar's size is its serialized form's, which is what it holds here once read back (xgrammar 0.2.9's
    `memory_size_bytes` says 2.5 MB of a 600-property schema that holds 117 MB). One grammar larger than
    `max_bytes / GRAMMARS_PER_BUDGET` fails its requests in the compile process, before it reaches this one (an
    18 KB schema made 118 MB). Running requests keep their grammars after the cache has let go of them.

    The cache holds futures, so requests with one schema share one compile, finished or not, and a
    failed compile is remembered too (a bad schema sent again fails at once, a slow one too). The
    tokenizer is loaded, and xgrammar's view of it built, on the first compile. Call `get` from one
    thread (the engine's).

    Each of the `num_workers` threads of the general lanes, and one of the first-try lane, takes compiles from a
    queue in a fair order (compile_queue.py), hands each to a process of its own (compile_worker.py) and waits; a
    compile past its time limit, or one whose requests have all gone (`release`), gets its process killed, so the
    capacity it held comes back at once, and the thread starts another process for its next compile.
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_entries: int = DEFAULT_MAX_CACHED_GRAMMARS,
        num_workers: int = 2,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_CACHED_BYTES,
    ) -> None:
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's vocabulary
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.sizes: dict[tuple[str, str], int] = {}  # the bytes of each compiled grammar in `entries`
        self.cached_bytes = 0
        self._lock = threading.Lock()  # `entries` and the sizes: the engine thread gets, workers add compiled ones
        self.num_compiles = 0
        self._compiling: dict[tuple[str, str], CompileJob] = {}  # by key, the compiles not finished
        self._queue = CompileQueue(self._lock)
        self._workers = [
            threading.Thread(target=self._work, args=(i == 0,), name=f"kiln-grammar-{i}", daemon=True)
            for i in range(num_workers + 1)
        ]
        for worker in self._workers:
            worker.start()
        self._tokenizer_info: tuple[xgr.TokenizerInfo, str] | None = None  # and its JSON, for the processes
        self._tokenizer_lock = threading.Lock()

    def get(self, params: StructuredOutputParams) -> Future:
        """The compile of `params` (a `Future` of an xgrammar `CompiledGrammar`), started if not cached."""
        key = (params.kind, params.spec)
        with self._lock:
            future = self.entries.get(key)
            if future is not None:
                self.entries.move_to_end(key)
                return future
            future = Future()
            self.num_compiles += 1
            self.entries[key] = future
            self._compiling[key] = job = CompileJob(params, future)
            if len(self.entries) > self.max_entries:
                self._drop(next(iter(self.entries)))  # a compile still running goes on for the requests waiting
            self._queue.put(job)
        return future

    def request_grammar(self, params: StructuredOutputParams) -> RequestGrammar:
        """A request's grammar, counted as waiting for its compile until `release`d."""
        future = self.get(params)
        with self._lock:
            job = self._compiling.get((params.kind, params.spec))
            if job is None or job.future is not future or future.done():
                job = None
            else:
                job.waiters += 1
        return RequestGrammar(params, future, self.timeout_s, job)

    def release(self, grammar: RequestGrammar) -> None:
        """`grammar`'s request waits no more (admitted, failed or aborted). A compile left with nobody waiting is
        cancelled: taken off the queue, or its process killed. One whose requests ran out of time is remembered as
        failed (the same schema sent again fails at once); one they left is forgotten."""
        job, grammar.job = grammar.job, None
        if job is None:
            return
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            self._compiling.pop(job.key, None)
            job.timed_out = grammar.timed_out
            job.cancelled.set()  # running: its worker kills its process
            if not job.running:
                job.future.cancel()
            if (not job.running or not job.timed_out) and self.entries.get(job.key) is job.future:
                self._drop(job.key)

    def _drop(self, key: tuple[str, str]) -> None:
        del self.entries[key]
        self.cached_bytes -= self.sizes.pop(key, 0)

    def _keep(self, job: CompileJob, size: int) -> None:
        """Count a compiled grammar's bytes (if it is still cached), then drop the least recently used others until
        the cache is within `max_bytes`."""
        key = job.key
        with self._lock:
            if self.entries.get(key) is not job.future:
                return  # dropped while it compiled: only its requests hold it
            self.sizes[key] = size
            self.cached_bytes += size
            for old in list(self.entries):
                if self.cached_bytes <= self.max_bytes:
                    break
                if old != key:
                    self._drop(old)

    def shutdown(self) -> None:
        """Stop the workers once their compiles are done (without waiting for them); those queued are cancelled."""
        self._queue.close()

    def _work(self, first_try: bool) -> None:
        # NOTE: this thread reads compiled grammars back (a 600-property schema's: 118 MiB of JSON, seconds of CPU,
        # mostly outside the interpreter's lock): at nice 10, as the compile processes, it yields the cores to the
        # engine's loop (Linux sets a thread's priority by its id)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        process: CompileProcess | None = None
        while (job := self._queue.take(first_try)) is not None:
            future, params = job.future, job.params
            try:
                info, info_json = self._xgrammar_tokenizer()
                if process is None or not process.alive:
                    process = CompileProcess(info_json)
                limit = min(FIRST_TRY_S, self.timeout_s) if first_try else self.timeout_s
                compiled = process.compile(params, limit, self.max_bytes // GRAMMARS_PER_BUDGET, job.cancelled)
                grammar = xgr.CompiledGrammar.deserialize_json(compiled, info)
                size, compiled = len(compiled), None
                self._keep(job, size)
                future.set_result(grammar)
                grammar = None
                _give_back_freed_memory()
            except CompileCancelled:
                what = WHAT[params.kind]
                reason = f"took longer than {self.timeout_s:g} s" if job.timed_out else "was cancelled"
                future.set_exception(GrammarError(f"compiling the {what} {reason}"))
            except CompileTimedOut as e:
                if first_try and limit < self.timeout_s and self._queue.demote(job):
                    continue  # a general lane tries it again with the full time
                future.set_exception(e)
            except GrammarError as e:
                future.set_exception(e)
            except Exception as e:  # a bug, not the schema's fault: still only its requests fail
                future.set_exception(
                    GrammarError(f"internal error while compiling the grammar: {type(e).__name__}: {e}")
                )
            finally:
                with self._lock:
                    if future.done() and self._compiling.get(job.key) is job:  # (not one gone back to the queue)
                        del self._compiling[job.key]
        if process is not None:
            process.kill()

    def _xgrammar_tokenizer(self) -> tuple[xgr.TokenizerInfo, str]:
        with self._tokenizer_lock:
            if self._tokenizer_info is None:
                try:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                    )
                except Exception as e:
                    raise GrammarError(
                        f"internal error: structured output needs the model's tokenizer: {type(e).__name__}: {e}"
                    ) from None
                self._tokenizer_info = info, info.serialize_json()
            return self._tokenizer_info


def _give_back_freed_memory() -> None:
    """glibc keeps the pages freed after reading a grammar back (its JSON parse peaks at several times the text) and
    after the cache drops one: without this, the engine's resident memory stays at its peak long after."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class GrammarBitmask:
    """The step's token mask: for sampling row i, ceil(V / 32) int32 words, bit t set when token t is
    allowed (V the logits' width; ids past the tokenizer's vocabulary are never allowed).

    The runner calls `apply` after it has enqueued the forward pass and the logits: the rows are filled
    on the host while the device computes, copied over from pinned memory, and applied in place to the
    constrained rows only, just before sampling.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, fill_threads: int | str = "auto") -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.host = torch.zeros(0, 0, dtype=torch.int32)
        self.on_device = self.host
        self._resize(max_rows)
        self._batch_matcher = xgr.BatchGrammarMatcher(fill_threads)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last host-to-device copy

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> list[int]:
        """Mask the rows of `logits` ([rows, V], one row per entry of `grammars`) whose request has a
        grammar; returns those rows. A row without a grammar is left as it is."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return rows
        if logits.shape != (len(grammars), self.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(grammars)} rows of {self.vocab_size} tokens"
            )
        if self._copied is not None:
            self._copied.synchronize()  # NOTE: the last step's copy may still be reading these host rows
        if len(grammars) > self.host.shape[0]:
            self._resize(1 << (len(grammars) - 1).bit_length())  # pinned allocations are slow: grow by doubling
        self.fill([grammars[i] for i in rows], rows)
        num_rows = len(grammars)
        mask = self.on_device[:num_rows]
        if self._copied is not None:  # on a GPU: the rows travel from pinned memory
            mask.copy_(self.host[:num_rows], non_blocking=True)
            self._copied.record()
        indices = None if len(rows) == num_rows else rows
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=indices)
        return rows

    def fill(self, grammars: Sequence[RequestGrammar], rows: Sequence[int]) -> None:
        """Host rows `rows` get the next-token masks of `grammars`; several are filled in parallel."""
        if len(rows) == 1:
            grammars[0].matcher.fill_next_token_bitmask(self.host, rows[0])
        else:
            self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], self.host, list(rows))

    def _resize(self, num_rows: int) -> None:
        shape = (num_rows, -(-self.vocab_size // 32))
        on_cuda = self.device.type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.int32, pin_memory=on_cuda)
        self.on_device = torch.zeros(shape, dtype=torch.int32, device=self.device) if on_cuda else self.host
