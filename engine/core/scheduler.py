"""The scheduler: each step, fill a token budget from running requests first, then waiting ones.

There are no prefill and decode phases (vLLM V1's idea): every request is `num_computed_tokens`
behind its `num_tokens`, and a step gives each scheduled request some of the tokens it lacks —
one for a decode, a chunk for a prefill. When the block pool runs dry the newest running request is
preempted: its blocks are freed and it recomputes from the start later (prefix caching often makes
that cheap).

`schedule()` advances its requests as if the step had already run; a sampled token the host has not
seen yet is an output placeholder. That is what lets the engine schedule step N+1 while step N is on
the GPU (async scheduling): a decode's next input is step N's token, still on the device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kiln.cache import KVCacheManager, StateKVCacheManager
from kiln.cache.state_cache import StateCopies
from kiln.engine.core.request import Request, RequestStatus
from kiln.engine.spec_decode.ngram import NgramProposer
from kiln.engine.worker.inputs import DRAFT_ON_DEVICE


@dataclass
class SchedulerOutput:
    requests: list[Request]  # in batch order
    num_new_tokens: list[int]  # tokens each request computes this step
    block_ids: list[list[int]]  # each request's block table after allocation
    preempted: list[Request] = field(default_factory=list)
    # Each request's computed tokens before this step (the scheduler has already advanced it), and
    # whether the step samples its next token (its last scheduled token is its last token).
    num_computed_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    # whether any unfinished request asks for prompt logprobs (else the runner looks for none)
    prompt_logprobs: bool = False
    # a model with recurrent layers: each request's state slot, and the state rows to copy around this step's forward
    state_slots: list[int] = field(default_factory=list)
    state_copies: StateCopies = ((), ())
    # ... and with speculative decoding (fold, verifies): whether its last step verified drafts (the device folds the
    # ones kept into its state first) and whether this one does (linear_attention/op.py)
    state_folds: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: each request's draft tokens this step verifies after its input token (empty: none)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # drafts the host has not seen (DRAFT_ON_DEVICE in spec_token_ids): the drafter's [requests, k] tensor on the
    # device and each request's row there
    device_drafts: Any = None
    # rows scheduled while a step in flight verifies their drafts, as if it kept them all: the device moves their
    # positions back by the drafts it did not keep (ModelRunner._shift)
    shifted_rows: list[int] = field(default_factory=list)
    # how many of each request's device drafts are real (a device n-gram lookup's; the rest are fillers): a host
    # tensor, read once this step is done, and each request's row there; None: every draft is
    draft_counts: Any = None
    # whether the drafter makes drafts after this step (for the next): below disable_by_batch_size running requests,
    # counted once the step's admissions are in, so a drafter on the device skips exactly what the host will not use
    drafting: bool = True

    def num_real_drafts(self, i: int) -> int:
        """Of row i's drafts, how many a drafter proposed (the acceptance metrics count those alone)."""
        num_drafts = len(self.spec_token_ids[i])
        if self.draft_counts is None:
            return num_drafts
        counts, row_of = self.draft_counts
        if not isinstance(counts, list):  # (the step is done by now: its copy has landed)
            counts = counts.tolist()
            self.draft_counts = (counts, row_of)
        return min(num_drafts, counts[row_of[self.requests[i].request_id]])

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def single(self, i: int) -> SchedulerOutput:
        """Row i alone, as a batch of one (to retry the rows of a failed step one at a time, once the step before it
        is collected: a row scheduled ahead of that step's verdict takes its computed count from the request, which
        the verdict corrected)."""
        computed = self.num_computed_tokens[i]
        if i in self.shifted_rows:
            computed = self.requests[i].num_computed_tokens - self.num_new_tokens[i]
        return SchedulerOutput(
            [self.requests[i]],
            [self.num_new_tokens[i]],
            [self.block_ids[i]],
            [],
            [computed],
            [self.samples[i]],
            self.prompt_logprobs,
            self.state_slots[i : i + 1],
            ((), ()),
            self.state_folds[i : i + 1],
            self.spec_token_ids[i : i + 1],
            self.device_drafts,
            draft_counts=self.draft_counts,
        )


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager | StateKVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        drafter: NgramProposer | None = None,
        draft_below: int | None = None,
        optimistic: bool = False,
    ) -> None:
        """`drafter`: speculative decoding's, which proposes tokens a decoding request's next step verifies.
        `optimistic`: async scheduling while drafting (a drafter on the device, a model whose KV can take rejected
        drafts back): a request whose step in flight verifies drafts is scheduled as if it kept them all, and the
        device moves its positions back by the ones it did not keep."""
        self.kv = kv_cache_manager
        self.drafter = drafter
        self.optimistic = optimistic
        self.draft_below = draft_below  # (speculative_config's disable_by_batch_size: no drafts from this many up)
        self.num_draft_tokens = 0  # proposed and verified, since start
        self.num_accepted_tokens = 0  # of them, kept
        self.num_spec_steps = 0  # request-steps that verified drafts
        # recurrent layers: steps end on block boundaries where they can (snapshots of the state are kept there)
        self.states = kv_cache_manager if isinstance(kv_cache_manager, StateKVCacheManager) else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_sync_requests = 0  # unfinished requests with `needs_sync`
        self.num_prompt_logprob_requests = 0  # unfinished requests asking for prompt logprobs

    # ---- requests in and out --------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.num_sync_requests += request.needs_sync
        self.num_prompt_logprob_requests += request.prompt_logprobs is not None
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
        """Pick this step's requests and advance them as if the step had run: `num_computed_tokens`
        moves on, and a request whose next token the step samples gains an output placeholder until
        `update_from_output` brings the token back. So with async scheduling the next step can be
        scheduled while this one is still on the GPU."""
        budget = self.max_num_batched_tokens
        shifted: list[int] = []
        scheduled: list[Request] = []
        num_new: list[int] = []
        preempted: list[Request] = []

        # Running requests first, oldest first; the newest are preempted when blocks run out.
        # (this loop runs for every running request every step: what its common path reads from self is read once)
        i = 0
        max_model_len = self.max_model_len
        allocate_slots = self.kv.allocate_slots
        running = self.running
        states, drafter = self.states, self.drafter
        lookahead = getattr(drafter, "lookahead", 0)  # (a drafter that writes ahead; the others skip `_lookahead`)
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            # drafts in flight count as new tokens, not computed ones: a sliding window frees no block their
            # rejection would leave inside it
            unverified = request.num_draft_placeholders
            pending = request.num_output_placeholders + unverified
            all_token_ids = request.all_token_ids
            num_tokens = len(all_token_ids) + pending
            if pending and (
                len(request.output_token_ids) + pending >= request.max_tokens or num_tokens >= max_model_len
            ):
                continue  # a length limit its tokens in flight already reach: nothing more to compute
            num_computed = request.num_computed_tokens
            n = min(num_tokens - num_computed, budget)
            if states is not None and n > 1:
                n = states.chunk_end(request.request_id, num_computed, n, len(all_token_ids))
            if drafter is not None:  # a step to its known tokens' end (no history to sync) verifies drafts
                ahead = not pending or self.optimistic  # (tokens in flight: the device corrects the positions)
                drafting = ahead and num_computed + n == num_tokens and not request.needs_sync
                # (a recurrent state records a verifying step's tokens from its first: one input, then the drafts)
                drafting = drafting and (n == 1 or states is None)
                if drafting and self._drafting():
                    request.spec_token_ids = self._draft(request, budget - n, pending)
                else:
                    request.spec_token_ids = []
                n += len(request.spec_token_ids)
            computed = num_computed - unverified
            slots_ahead = self._lookahead(num_computed + n) if lookahead else 0
            fits = allocate_slots(request.request_id, all_token_ids, computed, n + unverified, (), slots_ahead)
            if not fits and request.spec_token_ids:  # no room for the drafts: verify none
                n -= len(request.spec_token_ids)
                request.spec_token_ids = []
                fits = allocate_slots(
                    request.request_id, all_token_ids, computed, n + unverified, (), self._lookahead(num_computed + n)
                )
            if not fits and not self._preempt_for(request, n, self._lookahead(num_computed + n), preempted):
                break  # the request itself was preempted: nothing after it is left to schedule
            if unverified:
                shifted.append(len(scheduled))
            scheduled.append(request)
            num_new.append(n)
            budget -= n

        # Then waiting requests, in arrival order, while nothing had to be preempted. A preempted
        # request waits until its in-flight token is back (its prefix hashes need every token id).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break
            cached_blocks, num_cached = [], 0
            if not request.needs_prompt_logprobs:  # (a hit's positions would have no logprobs)
                cached_blocks, num_cached = self.kv.get_computed_blocks(request.all_token_ids)
            n = min(request.num_tokens - num_cached, budget)
            if self.states is not None and n > 1:
                n = self.states.chunk_end(request.request_id, num_cached, n, request.num_tokens)
            slots_ahead = self._lookahead(num_cached + n)
            if not self.kv.allocate_slots(
                request.request_id, request.all_token_ids, num_cached, n, cached_blocks, slots_ahead
            ):
                break
            self.waiting.popleft()
            request.spec_token_ids = []  # (a prefill verifies no drafts)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            num_new.append(n)
            budget -= n

        computed = [r.num_computed_tokens for r in scheduled]
        samples = []
        for request, n in zip(scheduled, num_new):
            drafted = len(request.spec_token_ids)  # (past its known tokens: the drafts it verifies)
            if states is not None and not drafted:  # (drafts' states are folded later)
                states.after_schedule(request.request_id, request.num_computed_tokens, n)
            num_computed_tokens = request.num_computed_tokens + n
            request.num_computed_tokens = num_computed_tokens
            pending = request.num_output_placeholders + request.num_draft_placeholders
            sample = num_computed_tokens - drafted == len(request.all_token_ids) + pending
            request.num_output_placeholders += sample
            request.num_draft_placeholders += drafted
            samples.append(sample)
        block_ids = self.kv.block_ids
        block_table = [block_ids(r.request_id) for r in scheduled]
        wants = self.num_prompt_logprob_requests > 0
        output = SchedulerOutput(scheduled, num_new, block_table, preempted, computed, samples, wants)
        output.shifted_rows = shifted
        if self.drafter is not None:
            output.drafting = self._drafting()
            output.spec_token_ids = [r.spec_token_ids if r.status == RequestStatus.RUNNING else [] for r in scheduled]
            output.device_drafts = getattr(self.drafter, "device_drafts", None)
            output.draft_counts = getattr(self.drafter, "draft_counts", None)
        if self.states is not None:
            slot_of = self.states.states.slot_of
            output.state_slots = [slot_of[r.request_id] for r in scheduled]
            output.state_copies = self.states.states.copies()
            if self.drafter is not None:
                output.state_folds = [
                    (int(r.folds_drafts), int(bool(d))) for r, d in zip(scheduled, output.spec_token_ids)
                ]
                for request, drafts in zip(scheduled, output.spec_token_ids):
                    request.folds_drafts = bool(drafts)
        return output

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: list[int | None],
        accepted_token_ids: list[list[int]] | None = None,
    ) -> tuple[list[tuple[Request, int]], list[Request]]:
        """Bring back a step's sampled tokens; returns (new tokens as (request, token), finished requests).

        `sampled_token_ids[i]` is None where the step sampled nothing for row i (a partial prefill).
        `accepted_token_ids[i]`: the drafts row i's request kept, which come before its sampled token; the ones it did
        not keep give back their computed positions (their KV is written over next step).
        A request that finished or was aborted after this step was scheduled drops its token.
        """
        new_tokens: list[tuple[Request, int]] = []
        finished: list[Request] = []
        live = (RequestStatus.RUNNING, RequestStatus.WAITING)
        spec_token_ids = output.spec_token_ids
        for i, (request, token) in enumerate(zip(output.requests, sampled_token_ids)):
            if token is None or request.status not in live:
                continue  # sampled nothing, or finished (aborted, stopped) after this step was scheduled
            request.num_output_placeholders -= 1
            tokens = (token,)
            drafts = spec_token_ids[i] if spec_token_ids else ()
            if drafts:
                request.num_draft_placeholders -= len(drafts)
                accepted = accepted_token_ids[i]
                real = output.num_real_drafts(i)
                self.num_spec_steps += real > 0
                self.num_draft_tokens += real
                self.num_accepted_tokens += min(len(accepted), real)
                if request.status == RequestStatus.RUNNING and len(accepted) < len(drafts):
                    # (their KV is written over next step; a recurrent state folds in only the kept ones)
                    request.num_computed_tokens -= len(drafts) - len(accepted)
                tokens = [*accepted, token]
            for token in tokens:
                request.append_output_token(token)
                new_tokens.append((request, token))
                status = None if request.grammar is None else self._advance_grammar(request, token)
                if status is None:
                    status = self._check_stop(request, token)
                if status is not None:
                    # Preempted while its token was in flight, a request finishes from the waiting queue.
                    (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
                    self._finish(request, status)
                    finished.append(request)
                    break  # (tokens past a stop inside the drafts are dropped)
        return new_tokens, finished

    def needs_sync(self) -> bool:
        """Whether the next step must see the previous step's tokens before it is scheduled. Drafts are made from
        them (n-gram), and how many drafts a step keeps moves the next step's positions: unless the device moves
        them (`optimistic`), a step with drafts in flight syncs, and so does one that may draft. A step past
        disable_by_batch_size with none in flight overlaps as any."""
        if self.drafter is None or self.optimistic or self.num_sync_requests > 0:
            return self.num_sync_requests > 0
        if getattr(self.drafter, "drafts_after_step", False) or self._drafting():
            return True
        return any(r.num_draft_placeholders for r in self.running)

    def _drafting(self) -> bool:
        """Whether this step drafts: below speculative_config's disable_by_batch_size running requests."""
        return self.draft_below is None or len(self.running) < self.draft_below

    def _lookahead(self, end: int) -> int:
        """Positions past a step's a drafter writes before the next (EAGLE-3's chain), within max_model_len."""
        return max(min(getattr(self.drafter, "lookahead", 0), self.max_model_len - end), 0)

    def _draft(self, request: Request, budget: int, pending: int) -> list[int]:
        """Draft tokens for a decoding request's next step, within the token budget and its length limits (the
        step's own token, and the one it samples after the drafts, included; `pending`: tokens in flight)."""
        room = min(
            budget,
            request.max_tokens - len(request.output_token_ids) - pending - 1,
            self.max_model_len - len(request.all_token_ids) - pending - 1,
        )
        if getattr(self.drafter, "drafts_after_step", False):  # (EAGLE-3's, MTP's: the last step left them)
            if not self.drafter.has_drafts(request.request_id):  # (a step it sat out: its drafts were replaced)
                return []
            return [DRAFT_ON_DEVICE] * max(min(room, self.drafter.k), 0)
        return self.drafter.propose(request.all_token_ids, room)

    # ---- helpers --------------------------------------------------------------------------------------

    def _advance_grammar(self, request: Request, token: int) -> RequestStatus | None:
        """Structured output: move the request's matcher past its new token. A token the grammar rejects
        fails the request alone (the mask allows only what it accepts, so this is a conflict, such as
        min_tokens holding back the one stop token allowed); a grammar that took a stop token is done."""
        grammar = request.grammar
        if grammar is None:
            return None
        if not grammar.accept_token(token):
            request.failure = f"structured output: the grammar does not allow the sampled token {token}"
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_set:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt_for(self, request: Request, n: int, lookahead: int, preempted: list[Request]) -> bool:
        """Blocks for n more tokens of a running request (and `lookahead` past them) did not fit: preempt from the
        newest end of `running` until they do; False if the request had to preempt itself."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
            unverified = request.num_draft_placeholders  # (as in `schedule`)
            computed, tokens = request.num_computed_tokens - unverified, request.all_token_ids
            if self.kv.allocate_slots(request.request_id, tokens, computed, n + unverified, (), lookahead):
                return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.spec_token_ids = []
        request.folds_drafts = False  # (its state is computed again from its tokens)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.grammar = None  # the matcher's state goes with it
        self.kv.free(request.request_id)
        self.num_sync_requests -= request.needs_sync
        self.num_prompt_logprob_requests -= request.prompt_logprobs is not None
        del self.requests[request.request_id]
