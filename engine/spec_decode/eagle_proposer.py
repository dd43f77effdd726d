"""EAGLE-3 and MTP drafting: right after each step's sampling, on the device, the draft runs over what the target
just computed, then k - 1 more times one token a request, and each decoding request's next step verifies what it
proposed.

For request i whose step covered positions c .. c + n - 1 and kept `valid` of them (a verifying step's rejected
drafts' positions are dropped), the first pass reads, at each position p, the token after it (the step's output
token where it has one) and the target's states at p (three layers', from `kiln::save_hidden`), and writes the
draft's KV there:

    target step:   positions  c    c+1   ...  c+valid-1          (tokens t_c .. ; states s_c ..)
    first pass:    tokens     t_c+1 ...        t_c+valid  (the newest)   ->  draft 1 (predicts t_c+valid+1)
    pass j > 1:    token      draft j-1 at position c + valid + j - 2      ->  draft j

The first pass runs over all n positions, since how many are valid is known on the device only: the draft KV it
writes past c + valid - 1 is written over by the chain and the next first pass before any pass reads it. The draft's
KV cache is a tensor of its own over the target's blocks (the scheduler allocates k positions of lookahead, so the
chain's positions have blocks; at the end of max_model_len, where no lookahead fits, the chain's positions are held at
the last one, and the request finishes before its drafts are used). Drafts are greedy (the draft head's argmax), as
vLLM's are; the rejection sampler keeps the output exact whatever they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.backends.attention import ForwardContext, set_forward_context
from kiln.engine.models.layers import use_fused_kernels
from kiln.engine.spec_decode.draft_graphs import ChainGraphs, chain_sizes
from kiln.engine.spec_decode.eagle3 import Eagle3Draft
from kiln.engine.spec_decode.mtp import MtpDraft
from kiln.engine.worker.inputs import GraphPlan, StepTokens
from kiln.engine.worker.sampler import to_device

if TYPE_CHECKING:
    from kiln.engine.core.scheduler import SchedulerOutput
    from kiln.engine.worker.model_runner import ModelRunner


class EagleProposer:
    drafts_after_step = True  # (the scheduler takes a request's drafts as this proposer left them)

    def __init__(
        self, draft: Eagle3Draft | MtpDraft, num_speculative_tokens: int, runner: ModelRunner, num_blocks: int
    ) -> None:
        """`draft`: an EAGLE-3 head or a model's MTP layer (mtp.py): `forward(ids, positions, hidden)`,
        `first_hidden(runner, rows)`, `draft_tokens(normed)`."""
        self.draft, self.k, self.runner = draft, num_speculative_tokens, runner
        dtype = next(draft.parameters()).dtype
        shape = (2, num_blocks, runner.block_size, draft.num_kv_heads, draft.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=runner.device)
        self.lookahead = num_speculative_tokens  # positions the chain writes past a step's
        # with sliding and full KV groups (gpt-oss), the draft's blocks are a full group's: it attends the whole context
        self.layer_groups = ()
        if runner.layer_groups:
            windows = runner.windows or (0,) * len(runner.layer_groups)
            self.layer_groups = (next(g for g, w in zip(runner.layer_groups, windows, strict=True) if not w),)
        cuda = runner.device.type == "cuda"
        if cuda:  # (its eager passes take the Triton kernels an eager target takes: norms, rotary, SwiGLU, experts)
            use_fused_kernels(draft, True)
        # the chain's one-token passes in CUDA graphs (draft_graphs.py), where the target has full graphs
        sizes = chain_sizes(runner) if cuda and num_speculative_tokens > 1 else []
        self.graphs = ChainGraphs(draft, self.context, runner, sizes) if sizes else None
        # the last step's drafts stay on the device ([requests, k]; each request's row): the next step's inputs copy
        # them from there, and the host schedules it meanwhile rather than wait for the chain
        self.drafts: torch.Tensor | None = None
        self.draft_rows: dict[str, int] = {}

    @property
    def device_drafts(self) -> tuple[torch.Tensor, dict[str, int]] | None:
        return None if self.drafts is None else (self.drafts, self.draft_rows)

    def has_drafts(self, request_id: str) -> bool:
        """Whether the drafts the request holds are the last step's (a request that sat a step out holds older)."""
        return request_id in self.draft_rows

    def proposals(self, batch: SchedulerOutput) -> list[list[int]]:
        """Each request's drafts as lists (a sync with the device: for tests and tools, not the engine's loop)."""
        drafts = self.drafts.tolist() if self.drafts is not None else []
        rows = [self.draft_rows.get(r.request_id) for r in batch.requests]
        return [drafts[row] if row is not None else [] for row in rows]

    @torch.inference_mode()
    def propose(
        self, batch: SchedulerOutput, sample_rows: list[int], step: StepTokens | None, shift: torch.Tensor | None
    ) -> None:
        """Right after a step's sampling, on the device: the draft's first pass over every position the step
        computed, then the chain from each sampled request's last kept position; its drafts stay on the device
        (`drafts`) for the request's next step. Nothing here waits for the device: which drafts the step kept, and
        so where each chain starts, is read there (`step`: None when the step sampled nothing, a partial prefill's),
        and `shift` is the step's own correction (`write`)."""
        ends = np.cumsum(batch.num_new_tokens)
        num_tokens = int(ends[-1])
        # each position's next token where the host has it (a prompt's); the step's output tokens on the device
        ids = np.zeros(num_tokens, dtype=np.int64)
        for request, c, n, end in zip(batch.requests, batch.num_computed_tokens, batch.num_new_tokens, ends):
            known = request.all_token_ids[c + 1 : c + n + 1]
            ids[end - n : end - n + len(known)] = known
        computed = np.asarray(batch.num_computed_tokens, dtype=np.int64)
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        hidden = self.draft.first_hidden(self.runner, slice(0, num_tokens))
        normed, prenorm = self._pass(ids, computed, num_new, batch.block_ids, hidden, shift, step)
        self.drafts, self.draft_rows = None, {}
        if step is None:
            return
        if not batch.drafting:  # (past disable_by_batch_size: the first pass above keeps the draft's KV whole)
            return  # (a step that drops below the size verifies none, the one after it drafts again)
        tokens = [self.draft.draft_tokens(normed.index_select(0, step.next_rows))]
        hidden = prenorm.index_select(0, step.next_rows)
        position = computed[sample_rows] + num_new[sample_rows]  # (the chain's first, as the host wrote the step)
        chain_shift = next_position_shift(sample_rows, step, shift)
        chain_tables = [batch.block_ids[i] for i in sample_rows]
        last = self.runner.max_model_len - 1  # (a request whose chain would pass it finishes: its drafts go unused)
        for j in range(1, self.k):  # (the chain's tokens stay on the device)
            positions = np.minimum(position + j - 1, last)
            drafted, hidden = self._chain_pass(tokens[-1], positions, chain_tables, hidden, chain_shift)
            tokens.append(drafted)
        self.drafts = torch.stack(tokens, dim=1)
        self.draft_rows = {batch.requests[i].request_id: j for j, i in enumerate(sample_rows)}

    def _chain_pass(
        self, ids: torch.Tensor, positions: np.ndarray, tables: list, hidden: torch.Tensor, shift: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass of one token a request (`ids` on the device, at `positions` moved by `shift`): (draft tokens, next
        states), from a graph padded to the nearest captured request count where there is one."""
        ones = np.ones(len(positions), dtype=np.int64)
        size = self.graphs.size_for(len(positions)) if self.graphs is not None else None
        if size is None:
            normed, hidden = self._pass(ids, positions, ones, tables, hidden, shift)
            return self.draft.draft_tokens(normed), hidden
        self._write_inputs(ids, positions, ones, tables, GraphPlan("full", size, size), shift)
        return self.graphs.replay(size, hidden)

    def _pass(
        self,
        ids: np.ndarray | torch.Tensor,
        computed: np.ndarray,
        num_new: np.ndarray,
        tables: list,
        hidden: torch.Tensor,
        shift: torch.Tensor | None = None,
        step: StepTokens | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager forward of the draft over these tokens (each request's new ones at its computed positions);
        `step`: a first pass, whose rows with an output token read that token."""
        plan = GraphPlan("none", len(ids), len(num_new))
        metadata = self._write_inputs(ids, computed, num_new, tables, plan, shift)
        if step is not None:
            self.runner.inputs.input_ids.index_copy_(0, step.rows, step.tokens)
        inputs = self.runner.inputs.views(plan.num_tokens, plan.num_reqs)
        with set_forward_context(self.context(metadata)):
            return self.draft(inputs.input_ids, inputs.positions, hidden)

    def context(self, metadata) -> ForwardContext:
        """The draft's forward context: its own KV cache, as layer 0, over the blocks of a full group."""
        return ForwardContext(metadata, [self.kv_cache], self.runner.backend, layer_groups=self.layer_groups)

    def _write_inputs(self, ids, computed: np.ndarray, num_new: np.ndarray, tables: list, plan: GraphPlan, shift):
        """The pass's inputs in the runner's persistent buffers; `ids` on the device (the chain's last drafts) are
        copied in there, as a step's carried tokens are."""
        writer_args = (computed.astype(np.int64), num_new, tables, plan)
        if isinstance(ids, torch.Tensor):
            rows = list(range(len(ids)))
            placeholders = np.zeros(len(ids), dtype=np.int64)
            metadata, _ = self.runner.writer.write(placeholders, *writer_args, (), (rows, rows), ids, ((), ()), shift)
        else:
            metadata, _ = self.runner.writer.write(ids.astype(np.int64), *writer_args, shift=shift)
        return metadata


def next_position_shift(
    sample_rows: list[int] | torch.Tensor, step: StepTokens, shift: torch.Tensor | None
) -> torch.Tensor | None:
    """Each sampled request's correction, on the device, of the position after its step as the host wrote it
    (computed + new tokens): back by the step's own shift and by the drafts it did not keep; None where neither.
    `sample_rows` the sampled requests' rows in the step (on the device already, or a list)."""
    if shift is None and step.rejected is None:
        return None
    correction = torch.zeros(len(sample_rows), dtype=torch.int64, device=step.next_ids.device)
    if shift is not None:
        if not isinstance(sample_rows, torch.Tensor):
            sample_rows = to_device(sample_rows, torch.int64, shift.device)
        correction += shift.index_select(0, sample_rows)
    if step.rejected is not None:
        correction -= step.rejected
    return correction
