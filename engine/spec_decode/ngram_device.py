"""Prompt-lookup drafting on the device, so async scheduling stays on (vLLM's `ngram_gpu`).

The host's lookup (ngram.py) needs each step's output tokens, so a step with n-gram drafts waits for the one before
it. Here the lookup runs right after each step's sampling, as EAGLE-3's drafter does: each request's recent tokens
are kept on the device (a ring of its last MAX_LOOKBACK + k + 1 positions): what the host knows when a request's row
is new, then each step's last inputs (the drafts it kept among them) and its next token, written by the device; the
same rule picks the match: the longest suffix, prompt_lookup_max tokens down to prompt_lookup_min, at its latest
earlier occurrence.

A request verifies k tokens every step, since the host schedules the step before the lookup has run: where no match
was found (or a match ends near the text's end) the rest are fillers, the request's last token, which verification
keeps only where the model would have written them. How many were real goes back to the host with the step
(`valid_counts`), for the acceptance metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.engine.spec_decode.eagle_proposer import next_position_shift
from kiln.engine.spec_decode.ngram import MAX_LOOKBACK
from kiln.engine.worker.inputs import StepTokens
from kiln.engine.worker.sampler import to_device

if TYPE_CHECKING:
    from kiln.engine.core.request import Request
    from kiln.engine.core.scheduler import SchedulerOutput
    from kiln.engine.worker.model_runner import ModelRunner


class DeviceNgramProposer:
    drafts_after_step = True  # (the scheduler takes a request's drafts as this proposer left them)
    lookahead = 0  # (no draft KV is written past a step's positions)

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        runner: ModelRunner,
    ) -> None:
        self.k, self.runner = num_speculative_tokens, runner
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.window = min(MAX_LOOKBACK, runner.max_model_len)  # (the host's lookback: the same matches)
        self.ring = self.window + num_speculative_tokens + 1  # (a step's rejected inputs land past the window)
        # a row a request, let go of least recently drafted for first: twice the seats, so preempted ones keep theirs
        num_rows = 2 * runner.inputs.max_reqs
        self.history = torch.zeros(num_rows, self.ring, dtype=torch.int32, device=runner.device)
        # each request id's (id() of its request, row): a finished request is not kept alive by its row
        self.rows: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.free = list(range(num_rows))
        self.drafts: torch.Tensor | None = None  # [requests, k], each request's row as `draft_rows` says
        self.draft_rows: dict[str, int] = {}
        self.valid_counts: torch.Tensor | None = None  # [requests] on the host once the step is done: real drafts
        self.lengths: torch.Tensor | None = None

    @property
    def device_drafts(self) -> tuple[torch.Tensor, dict[str, int]] | None:
        return None if self.drafts is None else (self.drafts, self.draft_rows)

    @property
    def draft_counts(self) -> tuple[torch.Tensor, dict[str, int]] | None:
        """How many of each request's drafts a lookup found (the rest are fillers), read once its step is done."""
        return None if self.valid_counts is None else (self.valid_counts, self.draft_rows)

    def has_drafts(self, request_id: str) -> bool:
        """Whether the drafts the request holds are the last step's (a request that sat a step out holds older)."""
        return request_id in self.draft_rows

    def proposals(self, batch: SchedulerOutput) -> list[list[int]]:
        """Each request's real drafts as lists (a sync with the device: for tests and tools, not the engine's loop)."""
        drafts = self.drafts.tolist() if self.drafts is not None else []
        valid = self.valid_counts.tolist() if self.valid_counts is not None else []
        rows = [self.draft_rows.get(r.request_id) for r in batch.requests]
        return [drafts[row][: valid[row]] if row is not None else [] for row in rows]

    @torch.inference_mode()
    def propose(
        self, batch: SchedulerOutput, sample_rows: list[int], step: StepTokens | None, shift: torch.Tensor | None
    ) -> None:
        """Right after a step's sampling, on the device: each sampled request's tokens brought up to date, then its
        lookup. Nothing here waits for the device: where each request's text ends (how many drafts the step kept)
        is read there; `shift` is the step's own correction of its positions (`write`)."""
        self.drafts, self.draft_rows, self.valid_counts = None, {}, None
        if step is None:
            return
        device = self.runner.device
        ends = np.cumsum(batch.num_new_tokens)
        rows, new = [], []
        for i in sample_rows:
            row, fresh = self._row(batch.requests[i])
            rows.append(row)
            if fresh:
                new.append((batch.requests[i], row))
        if new:  # (from then on the device writes each of its steps' tokens itself)
            self._upload(new)
        # the step's last inputs at their positions: those only the device has (the input its previous step sampled,
        # the drafts it kept, at most k + 1); the rejected drafts' land past the text's end, where nothing reads them
        # before they are written over
        computed = np.asarray(batch.num_computed_tokens, dtype=np.int64)[sample_rows]
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)[sample_rows]
        tail = np.minimum(num_new, self.k + 1)
        owner = np.repeat(np.arange(len(sample_rows)), tail)
        offsets = np.arange(len(owner)) - np.repeat(np.cumsum(tail) - tail, tail) + (num_new - tail)[owner]
        token_rows = ends[sample_rows][owner] - num_new[owner] + offsets
        # (one copy to the device: each tail token's position, input row, owner and history row; then each sampled
        # request's text end, history row and row in the step)
        rows = np.asarray(rows, dtype=np.int64)
        packed = [computed[owner] + offsets, token_rows, owner, rows[owner]]
        packed += [computed + num_new, rows, np.asarray(sample_rows, dtype=np.int64)]
        packed = to_device(np.concatenate(packed), torch.int64, device)
        positions, token_rows, owner, history_rows, end, row_index, sample_index = packed.split(
            [len(owner)] * 4 + [len(sample_rows)] * 3
        )
        if shift is not None:
            positions = positions + shift.index_select(0, sample_index)[owner]
        tokens = self.runner.inputs.input_ids.index_select(0, token_rows).to(torch.int32)
        self.history.index_put_((history_rows, positions % self.ring), tokens)
        # each request's next input token closes its text
        correction = next_position_shift(sample_index, step, shift)
        if correction is not None:
            end = end + correction
        self.history.index_put_((row_index, end % self.ring), step.next_ids.to(torch.int32))
        self.lengths = end + 1  # (each text's length, on the device: for tests)
        if not batch.drafting:  # (past disable_by_batch_size: the texts above stay up to date, nothing is looked up)
            return  # (none then: a step that drops below the size verifies none, the one after it drafts again)
        self.drafts, self.valid_counts = self._lookup(row_index, self.lengths, int((computed + num_new).max()) + 1)
        self.draft_rows = {batch.requests[i].request_id: j for j, i in enumerate(sample_rows)}

    def _row(self, request: Request) -> tuple[int, bool]:
        """The request's history row, and whether it is new (the least recently used, if none is free): empty."""
        held = self.rows.get(request.request_id)
        if held is not None and held[0] == id(request):
            self.rows.move_to_end(request.request_id)
            return held[1], False
        if held is not None:  # (a request id used again: another request's tokens)
            self.free.append(self.rows.pop(request.request_id)[1])
        row = self.free.pop() if self.free else self.rows.popitem(last=False)[1][1]
        self.rows[request.request_id] = (id(request), row)
        return row, True

    def _upload(self, new: list[tuple[Request, int]]) -> None:
        """New rows' tokens within the window, as the host has them (a request's first lookup: its prompt, or all it
        had when it lost its row; the step's own inputs and next token are written after them)."""
        at, where, tokens = [], [], []
        for request, row in new:
            all_token_ids = request.all_token_ids
            start = max(len(all_token_ids) - self.window, 0)
            at.append(np.full(len(all_token_ids) - start, row))
            where.append(np.arange(start, len(all_token_ids)) % self.ring)
            tokens.append(all_token_ids[start:])
        flat = [np.concatenate(at), np.concatenate(where), np.concatenate(tokens)]
        row_index, slot, token = to_device(np.stack(flat), torch.int64, self.runner.device).unbind()
        self.history.index_put_((row_index, slot), token.to(torch.int32))

    def _lookup(self, rows: torch.Tensor, lengths: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's k drafts (fillers past what a match found) and how many are real, for texts of `lengths`
        tokens (at most `longest`, as the host knows it) in history `rows`."""
        device = rows.device
        width = min(self.window, 1 << max(longest - 1, 1).bit_length())  # (a power of two: few shapes)
        start = lengths - width  # (the window's first position; negative where the text is shorter)
        positions = start[:, None] + torch.arange(width, device=device)
        window = self.history[rows[:, None], positions % self.ring].masked_fill(positions < 0, -1)
        # run[e]: how many tokens, ending at window place e, equal the text's last ones (its own end excluded)
        alive = torch.ones_like(window[:, :-1], dtype=torch.bool)
        run = torch.zeros_like(window[:, :-1])
        for j in range(min(self.max_n, width - 1)):  # (a longer suffix than the text has matches nothing)
            suffix_token = window[:, width - 1 - j : width - j]
            earlier = torch.nn.functional.pad(window[:, : width - 1 - j], (j, 0), value=-1)
            alive &= (earlier == suffix_token) & (earlier >= 0)
            run += alive
        # the longest match, its latest end: as the host's lookup chooses
        score = torch.where(run >= self.min_n, run * width + torch.arange(width - 1, device=device), -1)
        best = score.max(dim=1)
        found = best.values >= 0
        follow = start + best.indices + 1  # (the match's next token's position)
        at = follow[:, None] + torch.arange(self.k, device=device)
        real = (at < lengths[:, None]) & found[:, None]
        filler = window[:, -1:]  # (the text's last token)
        drafts = torch.where(real, self.history[rows[:, None], at % self.ring], filler).long()
        valid = real.sum(dim=1)
        if device.type == "cuda":
            valid = valid.to("cpu", non_blocking=True)
        return drafts, valid
