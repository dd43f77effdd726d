"""The scheduler: each step, fill a token budget from running requests first, then waiting ones.

There are no prefill and decode phases (vLLM V1's idea): every request is `num_computed_tokens`
behind its `num_tokens`, and a step gives each scheduled request some of the tokens it lacks —
one for a decode, a chunk for a prefill. When the block pool runs dry the newest running request is
preempted: its blocks are freed and it recomputes from the start later (prefix caching often makes
that cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.cache import KVCacheManager
from kiln.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request]  # in batch order
    num_new_tokens: list[int]  # tokens each request computes this step
    block_ids: list[list[int]]  # each request's block table after allocation
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class FinishedRequest:
    request: Request
    new_token_ids: list[int]


class Scheduler:
    def __init__(
        self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- requests in and out --------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        num_new: list[int] = []
        preempted: list[Request] = []

        # Running requests first, oldest first; the newest are preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, n, preempted):
                break  # the request itself was preempted: nothing after it is left to schedule
            scheduled.append(request)
            num_new.append(n)
            budget -= n
            i += 1

        # Then waiting requests, in arrival order, while nothing had to be preempted.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            cached_blocks, num_cached = self.kv.get_computed_blocks(request.all_token_ids)
            n = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request.request_id, request.all_token_ids, num_cached, n, cached_blocks):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            num_new.append(n)
            budget -= n

        block_ids = [self.kv.block_ids(r.request_id) for r in scheduled]
        return SchedulerOutput(scheduled, num_new, block_ids, preempted)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: list[int | None]
    ) -> tuple[list[tuple[Request, int]], list[Request]]:
        """Advance each scheduled request; returns (new tokens as (request, token), finished requests).

        `sampled_token_ids[i]` is None for a request whose prefill is still partial after this step.
        """
        new_tokens: list[tuple[Request, int]] = []
        finished: list[Request] = []
        for request, n, token in zip(output.requests, output.num_new_tokens, sampled_token_ids):
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += n
            if token is None:
                continue
            request.append_output_token(token)
            new_tokens.append((request, token))
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return new_tokens, finished

    # ---- helpers --------------------------------------------------------------------------------------

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]) -> bool:
        """Find blocks for n more tokens of a running request, preempting from the newest end of
        `running` until they fit; False if the request had to preempt itself."""
        while not self.kv.allocate_slots(request.request_id, request.all_token_ids, request.num_computed_tokens, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
