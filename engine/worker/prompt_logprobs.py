"""Prompt log-probabilities: for a request that asks (`SamplingParams.prompt_logprobs`), the log-probability of each
prompt token given the ones before it, with its rank and the top k, from the hidden states its prefill chunks
compute anyway.

Position p's logits score token p + 1, so a chunk of positions [c, c + n) gives the entries of tokens
c + 1 .. c + n (the prompt's last position scores the first generated token, which is sampled as usual). The
logits are made in slices of `CHUNK_ROWS` rows, so memory stays bounded whatever the prompt's length, and only
for the requests that ask: a batch without one runs none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.engine.messages import TokenLogprobs
from kiln.engine.worker.sampler import LogprobsTensors

if TYPE_CHECKING:
    from kiln.engine.core.scheduler import SchedulerOutput

CHUNK_ROWS = 256  # rows of full-vocabulary float32 logits at a time (128 MiB at a 128k vocabulary)


@dataclass
class PromptRows:
    """One request's share of a step: `count` positions from `start`, at hidden rows from `row`."""

    request_index: int
    row: int
    start: int
    count: int
    k: int  # top-k beside each token's own


def prompt_rows(batch: SchedulerOutput) -> list[PromptRows]:
    """The step's positions that score a prompt token, for the requests that ask for prompt logprobs."""
    spec, row = [], 0
    for i, (request, computed, new) in enumerate(zip(batch.requests, batch.num_computed_tokens, batch.num_new_tokens)):
        k = request.sampling_params.prompt_logprobs
        end = min(computed + new, request.num_prompt_tokens - 1)
        if k is not None and end > computed:
            spec.append(PromptRows(i, row, computed, end - computed, k))
        row += new
    return spec


def _slices(p: PromptRows) -> list[tuple[int, int]]:
    """The request's hidden rows in slices of at most CHUNK_ROWS, as [start, end) offsets from its first row."""
    return [(s, min(s + CHUNK_ROWS, p.count)) for s in range(0, p.count, CHUNK_ROWS)]


def logit_slices(spec: list[PromptRows]) -> list[tuple[int, int]]:
    """The hidden-row slices the LM head runs on, in `compute`'s order (tensor-parallel ranks run the same ones)."""
    return [(p.row + s, p.row + e) for p in spec for s, e in _slices(p)]


def compute(compute_logits, hidden: torch.Tensor, batch: SchedulerOutput, spec: list[PromptRows]):
    """Each request's entries as tensors on the device: (request index, first position, LogprobsTensors of the
    tokens start + 1 .. start + count: their ids then the top k's in `token_ids`, their logprobs, their ranks)."""
    results = []
    for p in spec:
        prompt = batch.requests[p.request_index].prompt_token_ids
        targets = torch.tensor(prompt[p.start + 1 : p.start + 1 + p.count], device=hidden.device)
        parts = []
        for s, e in _slices(p):
            logprobs = torch.log_softmax(compute_logits(hidden[p.row + s : p.row + e]).float(), dim=-1)
            target = targets[s:e, None]
            own = logprobs.gather(1, target)
            ranks = (logprobs > own).sum(dim=1) + 1
            ids, values = target, own
            if p.k:
                top = logprobs.topk(p.k, dim=-1)
                ids, values = torch.cat([target, top.indices], 1), torch.cat([own, top.values], 1)
            parts.append((ids, values, ranks))
        tensors = LogprobsTensors(*(torch.cat([part[j] for part in parts]) for j in range(3)))
        results.append((p.request_index, p.start, tensors))
    return results


def entries(tensors: LogprobsTensors) -> list[TokenLogprobs]:
    """Host lists: per token, [id, logprob, rank] first, then the top k not already listed, ranked 1..k."""
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    rows = []
    for row_ids, row_values, rank in zip(ids, values, ranks):
        own = row_ids[0]
        entry = [[own, row_values[0], rank]]
        entry += [[t, v, j] for j, (t, v) in enumerate(zip(row_ids[1:], row_values[1:]), 1) if t != own]
        rows.append(entry)
    return rows
