"""The model runner: turn a scheduled batch into flat tensors, run the model, sample.

Inputs are written into persistent device buffers (sized for the largest batch at start-up) so the
addresses never change from step to step: what CUDA-graph replay needs, and one allocation fewer
per step besides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kiln.backends import AttentionBackend, AttentionMetadata, ForwardContext, set_forward_context
from kiln.engine.outputs import Logprob
from kiln.engine.sampler import Sampler, SamplingMetadata
from kiln.engine.scheduler import SchedulerOutput


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
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler()
        max_tokens, max_reqs = max_num_batched_tokens, max_num_seqs
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
        metadata, sample_rows = self.prepare_inputs(batch)
        num_tokens = metadata.num_actual_tokens
        with set_forward_context(ForwardContext(metadata, self.kv_caches, self.backend)):
            hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])
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

    def prepare_inputs(self, batch: SchedulerOutput) -> tuple[AttentionMetadata, list[int]]:
        """Fill the persistent buffers; returns the metadata and the rows that sample this step.

        For request i with c computed tokens and n new ones::

            positions:    c, c+1, ..., c+n-1
            slot_mapping: block_table[i][p // block_size] * block_size + p % block_size, per position p
        """
        requests = batch.requests
        num_reqs = len(requests)
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        computed = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_reqs)
        seq_lens = computed + num_new
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        req_of_token = np.repeat(np.arange(num_reqs), num_new)
        positions = computed[req_of_token] + np.arange(num_tokens) - query_start_loc[req_of_token]
        input_ids = np.fromiter(
            (t for r, c, n in zip(requests, computed, num_new) for t in r.all_token_ids[c : c + n]),
            dtype=np.int64,
            count=num_tokens,
        )
        num_block_cols = max(len(ids) for ids in batch.block_ids)
        block_table = np.zeros((num_reqs, num_block_cols), dtype=np.int32)
        for i, ids in enumerate(batch.block_ids):
            block_table[i, : len(ids)] = ids
        slot_mapping = (
            block_table[req_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

        self.input_ids[:num_tokens].copy_(torch.from_numpy(input_ids), non_blocking=True)
        self.positions[:num_tokens].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(torch.from_numpy(slot_mapping), non_blocking=True)
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        self.query_start_loc[: num_reqs + 1].copy_(qsl_cpu, non_blocking=True)
        self.seq_lens[:num_reqs].copy_(seq_lens_cpu, non_blocking=True)
        self.block_table[:num_reqs, :num_block_cols].copy_(torch.from_numpy(block_table), non_blocking=True)

        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        sample_rows = [i for i, r in enumerate(requests) if seq_lens[i] == r.num_tokens]
        return metadata, sample_rows


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
