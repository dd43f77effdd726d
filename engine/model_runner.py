"""The model runner: turn a scheduled batch into flat tensors, run the model, sample.

Inputs are written into persistent device buffers (sized for the largest batch at start-up) so the
addresses never change from step to step: what CUDA-graph replay needs, and one allocation fewer
per step besides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from kiln.backends import AttentionBackend, AttentionMetadata, ForwardContext, set_forward_context
from kiln.compile import CompiledModel
from kiln.engine.outputs import Logprob
from kiln.engine.sampler import Sampler, SamplingMetadata
from kiln.engine.scheduler import SchedulerOutput

# Test-only fault injection: a step fails when any request's prompt holds this token id.
_FAULT_TOKEN = int(os.environ["KILN_TEST_FAULT_TOKEN"]) if os.environ.get("KILN_TEST_FAULT_TOKEN") else None


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[int | None]  # per scheduled request; None where its prefill is still partial
    logprobs: list[dict[int, Logprob] | None]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        compiled: CompiledModel | None = None,
        cudagraph_mode: str = "none",
        capture_sizes: list[int] | None = None,
    ) -> None:
        self.model = model
        self.compiled = compiled
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        use_graphs = compiled is not None and device.type == "cuda" and cudagraph_mode != "none"
        self.cudagraph_mode = cudagraph_mode if use_graphs else "none"
        self.capture_sizes = sorted(capture_sizes or []) if use_graphs else []
        # Padding never needs more rows than the largest capture size or the token budget.
        max_tokens = max(max_num_batched_tokens, *self.capture_sizes, 1)
        max_reqs = max(max_num_seqs, *self.capture_sizes, 1)
        self.max_blocks_per_seq = -(-max_model_len // block_size)

        def buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = buffer(max_tokens, dtype=torch.int64)
        self.positions = buffer(max_tokens, dtype=torch.int64)
        self.slot_mapping = buffer(max_tokens, dtype=torch.int64)
        self.query_start_loc = buffer(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = buffer(max_reqs, dtype=torch.int32)
        self.block_table = buffer(max_reqs, self.max_blocks_per_seq, dtype=torch.int32)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        if _FAULT_TOKEN is not None and any(_FAULT_TOKEN in r.prompt_token_ids for r in batch.requests):
            raise RuntimeError("injected fault (KILN_TEST_FAULT_TOKEN)")
        plan = self.plan(batch)
        metadata, sample_rows = self.prepare_inputs(batch, plan)
        hidden = self.forward(metadata, plan)
        sampled: list[int | None] = [None] * len(batch.requests)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(batch.requests)
        if not sample_rows:
            return ModelRunnerOutput(sampled, logprobs)
        # The last token of each request that has caught up predicts its next token.
        logits_indices = metadata.query_start_loc[1:][sample_rows].long() - 1
        logits = self.model.compute_logits(hidden[logits_indices])
        requests = [batch.requests[i] for i in sample_rows]
        sampling = SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        result = self.sampler(logits, sampling)
        token_ids = result.sampled_token_ids.tolist()
        row_logprobs = _logprob_dicts(result.logprobs, requests) if result.logprobs is not None else None
        for j, row in enumerate(sample_rows):
            sampled[row] = token_ids[j]
            if row_logprobs is not None:
                logprobs[row] = row_logprobs[j]
        return ModelRunnerOutput(sampled, logprobs)

    # ---- graph dispatch -------------------------------------------------------------------------------

    def plan(self, batch: SchedulerOutput) -> GraphPlan:
        """Decode-only batches replay a full graph, others a piecewise one, padded up to the nearest
        capture size; batches beyond the largest size run the compiled pieces without graphs."""
        num_tokens = batch.total_num_tokens
        num_reqs = len(batch.requests)
        size = next((s for s in self.capture_sizes if s >= num_tokens), None)
        if size is None:
            return GraphPlan("none", num_tokens, num_reqs)
        if self.cudagraph_mode == "full_and_piecewise" and num_tokens == num_reqs:
            return GraphPlan("full", size, size)
        return GraphPlan("piecewise", size, num_reqs)

    def forward(self, metadata: AttentionMetadata, plan: GraphPlan) -> torch.Tensor:
        if plan.mode == "full":
            return self.compiled.replay_full_graph(plan.num_tokens)
        piecewise_size = plan.num_tokens if plan.mode == "piecewise" else None
        context = ForwardContext(metadata, self.kv_caches, self.backend, cudagraph_size=piecewise_size)
        model = self.compiled if self.compiled is not None else self.model
        with set_forward_context(context):
            return model(self.input_ids[: plan.num_tokens], self.positions[: plan.num_tokens])

    # ---- inputs ---------------------------------------------------------------------------------------

    def prepare_inputs(self, batch: SchedulerOutput, plan: GraphPlan) -> tuple[AttentionMetadata, list[int]]:
        """Fill the persistent buffers; returns the metadata and the rows that sample this step.

        For request i with c computed tokens and n new ones::

            positions:    c, c+1, ..., c+n-1
            slot_mapping: block_table[i][p // block_size] * block_size + p % block_size, per position p
        """
        requests = batch.requests
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        computed = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=len(requests))
        input_ids = np.fromiter(
            (t for r, c, n in zip(requests, computed, num_new) for t in r.all_token_ids[c : c + n]),
            dtype=np.int64,
            count=int(num_new.sum()),
        )
        metadata = self.fill_buffers(input_ids, computed, num_new, batch.block_ids, plan)
        seq_lens = computed + num_new
        sample_rows = [i for i, r in enumerate(requests) if seq_lens[i] == r.num_tokens]
        return metadata, sample_rows

    def fill_buffers(self, input_ids: np.ndarray, computed: np.ndarray, num_new: np.ndarray,
                     block_ids: list[list[int]], plan: GraphPlan) -> AttentionMetadata:  # fmt: skip
        """Padding: tokens past the real ones read id 0 at position 0 and write their K/V into the
        scratch block 0; a full graph's padded requests have one token each and an empty context."""
        num_reqs = len(num_new)
        num_tokens = int(num_new.sum())
        seq_lens = computed + num_new
        query_start_loc = np.zeros(plan.num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1 : num_reqs + 1])
        query_start_loc[num_reqs + 1 :] = num_tokens + np.arange(1, plan.num_reqs - num_reqs + 1)
        req_of_token = np.repeat(np.arange(num_reqs), num_new)
        positions = computed[req_of_token] + np.arange(num_tokens) - query_start_loc[req_of_token]
        num_block_cols = max(1, max(len(ids) for ids in block_ids))
        block_table = np.zeros((num_reqs, num_block_cols), dtype=np.int32)
        for i, ids in enumerate(block_ids):
            block_table[i, : len(ids)] = ids
        slot_mapping = np.zeros(plan.num_tokens, dtype=np.int64)
        slot_mapping[:num_tokens] = (
            block_table[req_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        padded_ids = np.zeros(plan.num_tokens, dtype=np.int64)
        padded_ids[:num_tokens] = input_ids
        padded_positions = np.zeros(plan.num_tokens, dtype=np.int64)
        padded_positions[:num_tokens] = positions
        padded_seq_lens = np.zeros(plan.num_reqs, dtype=np.int32)
        padded_seq_lens[:num_reqs] = seq_lens

        n = plan.num_tokens
        self.input_ids[:n].copy_(torch.from_numpy(padded_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(padded_positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(slot_mapping), non_blocking=True)
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(padded_seq_lens)
        self.query_start_loc[: plan.num_reqs + 1].copy_(qsl_cpu, non_blocking=True)
        self.seq_lens[: plan.num_reqs].copy_(seq_lens_cpu, non_blocking=True)
        self.block_table[:num_reqs, :num_block_cols].copy_(torch.from_numpy(block_table), non_blocking=True)

        full = plan.mode == "full"
        return AttentionMetadata(
            num_actual_tokens=n if full else num_tokens,  # a full graph writes K/V for padding too (to scratch)
            query_start_loc=self.query_start_loc[: plan.num_reqs + 1],
            seq_lens=self.seq_lens[: plan.num_reqs],
            block_table=self.block_table[: plan.num_reqs],
            slot_mapping=self.slot_mapping[: n if full else num_tokens],
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    # ---- start-up -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One prefill-shaped and one decode-shaped dummy step (all K/V into the scratch block): traces
        the compiled model and brings every kernel in before anything is served or captured."""
        for decode in (False, True):
            self._dummy_forward(num_tokens if not decode else min(num_tokens, 4), decode, "none")

    @torch.inference_mode()
    def capture_cudagraphs(self, counters) -> None:
        """Largest size first, so smaller graphs reuse the shared pool's memory."""
        sizes = sorted(self.capture_sizes, reverse=True)
        for size in tqdm(sizes, desc="capturing CUDA graphs", unit="size", leave=False):
            with counters.timed("capture_seconds"):
                self._dummy_forward(size, False, "none")
                self._dummy_forward(size, False, "piecewise")  # captures each piece for this size
                counters.cudagraphs_captured += 1
                if self.cudagraph_mode == "full_and_piecewise":
                    metadata, _ = self._dummy_metadata(size, True, "full")
                    context = ForwardContext(metadata, self.kv_caches, self.backend)
                    with set_forward_context(context):
                        self.compiled(self.input_ids[:size], self.positions[:size])  # warm-up at this size
                        self.compiled.capture_full_graph(size, self.input_ids, self.positions)
        torch.cuda.synchronize()

    def _dummy_metadata(self, num_tokens: int, decode: bool, mode: str) -> tuple[AttentionMetadata, GraphPlan]:
        """`num_tokens` one-token requests (decode) or as few prefills as fit in max_model_len, every
        K/V slot in the scratch block."""
        per_req = 1 if decode else min(num_tokens, self.max_blocks_per_seq * self.block_size)
        num_new = np.full(-(-num_tokens // per_req), per_req, dtype=np.int64)
        num_new[-1] = num_tokens - per_req * (len(num_new) - 1)
        blocks = [[0] * -(-int(n) // self.block_size) for n in num_new]
        plan = GraphPlan(mode, num_tokens, len(num_new))
        zeros = np.zeros(len(num_new), dtype=np.int64)
        return self.fill_buffers(np.zeros(num_tokens, dtype=np.int64), zeros, num_new, blocks, plan), plan

    def _dummy_forward(self, num_tokens: int, decode: bool, mode: str) -> torch.Tensor:
        metadata, plan = self._dummy_metadata(num_tokens, decode, mode)
        return self.forward(metadata, plan)


@dataclass(frozen=True)
class GraphPlan:
    mode: str  # "full", "piecewise" or "none"
    num_tokens: int  # padded token count (the capture size for graphs)
    num_reqs: int  # padded request count (a full graph pads requests too)


def _logprob_dicts(tensors, requests) -> list[dict[int, Logprob] | None]:
    """vLLM's shape: for each row, {token id: Logprob} with the sampled token and the row's top-N."""
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    rows: list[dict[int, Logprob] | None] = []
    for j, request in enumerate(requests):
        num = request.sampling_params.logprobs
        if num is None:
            rows.append(None)
            continue
        entry = {ids[j][0]: Logprob(values[j][0], ranks[j])}
        for k in range(1, num + 1):
            entry.setdefault(ids[j][k], Logprob(values[j][k], k))
        rows.append(entry)
    return rows
