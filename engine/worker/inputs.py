"""What goes into and comes out of a model-runner step: the input arena (device buffer, pinned host mirrors),
the graph plan of a step, the handle of a launched step, and its output."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kiln.engine.messages import TokenLogprobs
from kiln.engine.worker.sampler import LogprobsTensors

if TYPE_CHECKING:
    from kiln.engine.core.request import Request
    from kiln.engine.core.scheduler import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[int | None]  # per scheduled request; None where its prefill is still partial
    logprobs: list[TokenLogprobs | None]
    # per scheduled request that asked: (the first prompt position scored, the entries of the tokens after it)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] | None = None
    # speculative decoding: per scheduled request, the drafts it kept (before its sampled token), and their logprobs
    accepted_token_ids: list[list[int]] | None = None
    accepted_logprobs: list[list[TokenLogprobs | None]] | None = None


@dataclass
class StepHandle:
    """A launched step. Its sampled tokens stay on the device (the next step's inputs read them
    there); their copy to the host is in flight until `done`."""

    batch: SchedulerOutput
    sample_rows: list[int]
    sampled_cpu: torch.Tensor | None = None  # [S] int64, valid once `done` has fired
    logprobs_cpu: LogprobsTensors | None = None
    prompt_logprobs_cpu: list[tuple[int, int, LogprobsTensors]] | None = None  # (request, first position, tensors)
    # speculative decoding: each sampled request's logit rows (first, count), and each row's verdict on its draft
    draft_spans: list[tuple[int, int]] | None = None
    accepted_cpu: torch.Tensor | None = None
    logprob_requests: list[Request] | None = None  # each logit row's request (for its number of logprobs)
    done: torch.cuda.Event | None = None


@dataclass
class StepTokens:
    """What a launched step leaves on the device for the step after it and for the drafter, before the host sees it.

    Each sampled request's next input token (after the drafts it kept) and, where it verified drafts, how many it did
    not keep: a step scheduled meanwhile assumed it kept them all, and its positions are moved back by that many on
    the device (`InputWriter.write`'s shift). `rows` and `tokens`: every scored token row and its output token (the
    kept drafts', then the next token), which the drafter's first pass reads as the token after each position."""

    index: dict[str, int]  # each sampled request's index in next_ids, rejected and next_rows
    next_ids: torch.Tensor  # [S] int64
    next_rows: torch.Tensor  # [S] int64: the step's token row whose output next_ids is
    rows: torch.Tensor  # [T'] int64: token rows with an output token
    tokens: torch.Tensor  # [T'] int64
    rejected: torch.Tensor | None = None  # [S] int64; None: the step verified no drafts


MAX_VIEWS = 1024  # layouts kept: without CUDA graphs every token count is a size of its own
ALIGN = 16  # bytes: every field starts 16-byte aligned (Triton specialises kernels on 16-byte-aligned pointers)


class StepInputs(NamedTuple):
    """A step's inputs for n padded tokens and r padded requests (device tensors, or host numpy arrays)."""

    input_ids: Any  # [n] int64
    positions: Any  # [n] int64
    slot_mapping: Any  # [n] int64; with G > 1 KV groups [G, n], a row a group
    query_start_loc: Any  # [r + 1] int32
    seq_lens: Any  # [r] int32
    logits_indices: Any  # [r] int64: the rows to sample when they are not simply the first r
    carry: Any  # [2, r] int64: tokens of the previous step the host has not seen (where they go, their row there)
    state_slots: Any  # [r] int32: each request's row of the recurrent layers' states (0, the scratch row, without)
    state_folds: Any  # [2, r] int32: tokens each request folds into those states first, and whether it verifies drafts
    block_table: Any  # [r, width] int32; with G > 1 KV groups [r, G, width], a request's tables together


DTYPES = (torch.int64,) * 3 + (torch.int32,) * 2 + (torch.int64,) * 2 + (torch.int32,) * 3
# a draft token the host has not seen (EAGLE-3's and MTP's stay on the device): its step copies it from there
DRAFT_ON_DEVICE = -1


class InputArena:
    """Every input a step copies to the device, in one buffer, so a step makes one host-to-device transfer.

    The fields lie back to back (block table last) at offsets that depend only on the step's padded token and
    request counts (n, r), so the transfer covers only what the step uses, and a CUDA graph finds its inputs
    where they were at capture: a full graph (n = r = its size) all of them, a piecewise one (size n)
    input_ids at 0 and positions at 8n. Pinned host buffers (`mirrors`, two a write a step makes) take turns, so
    the host fills step N+1's while step N's copies may still be queued behind step N-1 (the runner's fences say
    when one is free). Views are made once per layout: slicing a tensor costs microseconds of host time a step.
    """

    def __init__(
        self, max_tokens: int, max_reqs: int, width: int, device: torch.device, num_groups: int = 1, mirrors: int = 2
    ) -> None:
        self.max_tokens, self.max_reqs, self.width, self.num_groups = max_tokens, max_reqs, width, num_groups
        nbytes = self._offsets(max_tokens, max_reqs)[-1]
        self.device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self.host_bytes = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(mirrors)]
        self._views: dict[tuple[int, int, int, bool], StepInputs] = {}
        self._spans: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def input_ids(self) -> torch.Tensor:
        """The device's token ids of whatever step was written last (every layout keeps them first)."""
        return self.device_bytes[: self.max_tokens * 8].view(torch.int64)

    def _shapes(self, n: int, r: int) -> list[tuple[int, ...]]:
        if self.num_groups > 1:
            g = self.num_groups
            return [(n,), (n,), (g, n), (r + 1,), (r,), (r,), (2, r), (r,), (2, r), (r, g, self.width)]
        return [(n,), (n,), (n,), (r + 1,), (r,), (r,), (2, r), (r,), (2, r), (r, self.width)]

    def _offsets(self, n: int, r: int) -> list[int]:
        """Each field's byte offset, then the end of the last."""
        offsets, at = [], 0
        for shape, dtype in zip(self._shapes(n, r), DTYPES):
            offsets.append(at)
            at += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        return offsets + [at]

    def views(self, n: int, r: int, parity: int = -1, numpy: bool = False) -> StepInputs:
        """The fields for (n, r) on the device, or in host buffer `parity` (as numpy arrays with `numpy`)."""
        key = (n, r, parity, numpy)
        fields = self._views.get(key)
        if fields is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            buf = self.device_bytes if parity < 0 else self.host_bytes[parity]
            offsets = self._offsets(n, r)
            views = [
                buf[at : at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for at, shape, dtype in zip(offsets, self._shapes(n, r), DTYPES)
            ]
            fields = self._views[key] = StepInputs(*(v.numpy() for v in views) if numpy else views)
        return fields

    def copy(self, parity: int, n: int, r: int, block_rows: int) -> None:
        """One non-blocking copy of host buffer `parity`'s fields for (n, r), the block table's first
        `block_rows` rows included."""
        key = (parity, n, r, block_rows)
        span = self._spans.get(key)
        if span is None:
            if len(self._spans) >= MAX_VIEWS:
                self._spans.clear()
            end = self._offsets(n, r)[-2] + block_rows * self.num_groups * self.width * 4
            span = self._spans[key] = (self.device_bytes[:end], self.host_bytes[parity][:end])
        span[0].copy_(span[1], non_blocking=True)


@dataclass(frozen=True)
class GraphPlan:
    mode: str  # "full", "piecewise" or "none"
    num_tokens: int  # padded token count (the capture size for graphs)
    num_reqs: int  # padded request count (a full graph pads requests too)


def logprob_lists(tensors: LogprobsTensors, requests: list[Request]) -> list[TokenLogprobs | None]:
    """For each row, the sampled token's [token_id, logprob, rank], then the row's top-N not already listed."""
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    rows: list[TokenLogprobs | None] = []
    for j, request in enumerate(requests):
        num = request.sampling_params.logprobs
        if num is None:
            rows.append(None)
            continue
        sampled = ids[j][0]
        entry = [[sampled, values[j][0], ranks[j]]]
        entry += [[ids[j][k], values[j][k], k] for k in range(1, num + 1) if ids[j][k] != sampled]
        rows.append(entry)
    return rows
