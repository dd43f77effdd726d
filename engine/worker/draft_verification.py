"""Speculative decoding's side of the model runner: every query row of the requests that verify drafts is scored,
the rejection sampler (spec_decode/rejection.py) says which drafts the model keeps and the token after them, and each
request gets its kept drafts and that token, with their logprobs; a step scheduled before that verdict has its
positions moved back on the device by the drafts not kept (`_shift`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.engine.spec_decode.rejection import verify
from kiln.engine.worker.inputs import ModelRunnerOutput, StepHandle, StepTokens, logprob_lists
from kiln.engine.worker.sampler import gather_logprobs, to_device

if TYPE_CHECKING:
    from kiln.engine.core.scheduler import SchedulerOutput

Head = tuple[torch.Tensor, torch.Tensor]  # a full graph's logits [rows, V] and their argmax [rows]


class DraftVerification:
    """Mixed into ModelRunner (model_runner.py), whose model, grammar mask and sampling state it uses."""

    @property
    def shifts_positions(self) -> bool:
        """Whether a step's positions can be moved back on the device (async scheduling while drafting): not with an
        attention backend that reads sequence lengths on the host (off the CPU, where the host's copy is corrected
        too). (Recurrent layers fold in a step's kept tokens on the device: `kept_tokens`.)"""
        host_lens = not self.backend.cudagraph_safe and self.device.type != "cpu"
        return not host_lens

    def _shift(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Each request's correction of its computed count on the device: minus the drafts the step in flight did
        not keep, for the requests scheduled as if it kept them all (`batch.shifted_rows`); None when there are none."""
        if not batch.shifted_rows:
            return None
        prev = self._prev
        src = [prev.index[batch.requests[i].request_id] for i in batch.shifted_rows]
        dst, src = to_device([batch.shifted_rows, src], torch.int64, self.device)
        shift = torch.zeros(len(batch.requests), dtype=torch.int64, device=self.device)
        return shift.index_copy_(0, dst, prev.rejected.index_select(0, src).neg())

    def _uniform_drafts(self, batch: SchedulerOutput) -> bool:
        """Whether every request verifies k drafts (with 1 + k tokens a request in all: each exactly that)."""
        k = self.verify_len - 1
        return len(batch.spec_token_ids) == len(batch.requests) and all(len(d) == k for d in batch.spec_token_ids)

    def _verify_drafts(
        self,
        batch: SchedulerOutput,
        handle: StepHandle,
        hidden: torch.Tensor,
        head: Head | None,
        rows: list[int],
        spans: list[tuple[int, int]],
    ) -> None:
        """Speculative decoding's sampling: every query row of a request with drafts is scored, and the rejection
        sampler (spec_decode/rejection.py) says which drafts the model keeps and the token after them. A full graph
        (`head`) has run the LM head over every row already."""
        row_requests = [batch.requests[i] for i, (_, count) in zip(handle.sample_rows, spans) for _ in range(count)]
        # Each row's draft is the token after it in the step's inputs (on the device: EAGLE-3's and MTP's are not on
        # the host), none (-1) on a request's last row; each row's span and place in it, each span's first row and
        # last place. One pinned, asynchronous copy: the host goes on enqueueing while the forward runs.
        firsts, counts = np.array(spans, dtype=np.int64).reshape(-1, 2).T
        span_of = np.repeat(np.arange(len(spans)), counts)
        place = np.arange(len(rows)) - firsts[span_of]
        following = np.asarray(rows) + 1
        following[firsts + counts - 1] = -1
        # (and with recurrent layers each sampled request's state slot, for its kept tokens below)
        slots = [batch.state_slots[i] for i in handle.sample_rows] if self.draft_records else []
        packed = np.concatenate([rows, following, span_of, place, firsts, counts - 1, slots])
        packed = to_device(packed, torch.int64, self.device)
        sizes = [len(rows)] * 4 + [len(spans)] * 2 + [len(slots)]
        rows_index, following, span_of, place, firsts, lasts, slots = packed.split(sizes)
        logits = self.model.compute_logits(hidden[rows_index]) if head is None else head[0][rows_index]
        grammars = [None] * len(rows)  # (a constrained request verifies no drafts: its one row takes its mask)
        for (first, count), i in zip(spans, handle.sample_rows):
            if count == 1:
                grammars[first] = batch.requests[i].grammar
        constrained = any(g is not None for g in grammars)
        if constrained:
            self.grammar_bitmask().apply(logits, grammars)
        sampling = self.sampling_metadata(row_requests)  # (a row a query token: a steady batch's serves again)
        drafts = torch.where(following < 0, -1, self.inputs.input_ids[following.clamp(min=0)])
        argmax = head[1][rows_index] if head is not None and not constrained else None
        accepted, token = verify(logits, drafts, sampling, argmax)
        emitted = torch.where(accepted, drafts, token)
        # each request keeps its drafts up to its first row not accepted (its last row accepts none): that row's
        # token is its next input, and what it kept moves the next step's positions (StepTokens)
        stops = torch.where(accepted, lasts.index_select(0, span_of), place)
        kept = torch.full_like(firsts, len(rows)).scatter_reduce_(0, span_of, stops, "amin")
        next_at = firsts + kept
        if self.draft_records:  # each recurrent-state slot's kept tokens: the input and drafts kept (op.py folds them)
            self.writer.kept_tokens.index_copy_(0, slots, (kept + 1).to(torch.int32))
        index = {batch.requests[i].request_id: j for j, i in enumerate(handle.sample_rows)}
        next_rows = rows_index.index_select(0, next_at)
        self._prev = StepTokens(index, emitted.index_select(0, next_at), next_rows, rows_index, emitted, lasts - kept)
        handle.draft_spans = spans
        handle.sampled_cpu = emitted.to("cpu", non_blocking=True)
        handle.accepted_cpu = accepted.to("cpu", non_blocking=True)
        if sampling.max_num_logprobs is not None:
            raw = logits.to(torch.float32).log_softmax(dim=-1)
            handle.logprobs_cpu = gather_logprobs(raw, emitted, sampling.max_num_logprobs).to_host()
            handle.logprob_requests = row_requests

    def _collect_drafts(self, handle: StepHandle, sampled: list, logprobs: list, prompt) -> ModelRunnerOutput:
        """Each request's kept drafts (up to its first row whose draft the model did not keep) and the token of that
        row, with their logprobs."""
        emitted, accepted = handle.sampled_cpu.tolist(), handle.accepted_cpu.tolist()
        row_logprobs = None
        if handle.logprobs_cpu is not None:
            row_logprobs = logprob_lists(handle.logprobs_cpu, handle.logprob_requests)
        kept_tokens: list[list[int]] = [[] for _ in sampled]
        kept_logprobs: list[list] = [[] for _ in sampled]
        for (first, count), row in zip(handle.draft_spans, handle.sample_rows):
            kept = 0
            while kept < count - 1 and accepted[first + kept]:
                kept += 1
            kept_tokens[row] = emitted[first : first + kept]
            sampled[row] = emitted[first + kept]
            if row_logprobs is not None:
                kept_logprobs[row] = row_logprobs[first : first + kept]
                logprobs[row] = row_logprobs[first + kept]
        return ModelRunnerOutput(sampled, logprobs, prompt, kept_tokens, kept_logprobs)


def draft_rows(batch: SchedulerOutput, sample_rows: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """A step with drafts: the hidden rows to score (each sampled request's input token and drafts) and each
    request's (first row, rows)."""
    ends = np.cumsum(batch.num_new_tokens)
    rows, spans = [], []
    for i in sample_rows:
        num_drafts = len(batch.spec_token_ids[i])
        spans.append((len(rows), num_drafts + 1))
        rows += range(int(ends[i]) - 1 - num_drafts, int(ends[i]))
    return rows, spans
