"""The model runner: turn a scheduled batch into flat tensors, run the model, sample.

Inputs are written into persistent device buffers (sized for the largest batch at start-up) so the addresses
never change from step to step: what CUDA-graph replay needs, and one allocation fewer per step besides.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from kiln.backends.attention import AttentionBackend, AttentionMetadata, ForwardContext, set_forward_context
from kiln.compile import CompiledModel
from kiln.engine.core.request import Request
from kiln.engine.core.scheduler import SchedulerOutput
from kiln.engine.outputs import Logprob
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.worker import inputs as runner_io
from kiln.engine.worker.inputs import GraphPlan, InputArena, ModelRunnerOutput, StepHandle, logprob_dicts
from kiln.engine.worker.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    plain_greedy,
    row_argmax,
)

if TYPE_CHECKING:
    from kiln.engine.structured_output.grammar import GrammarBitmask

Rows = torch.Tensor | slice  # rows of the hidden states: an index tensor, or a slice when that is all of them
Head = tuple[torch.Tensor, torch.Tensor]  # a full graph's logits [rows, V] and their argmax [rows]

# The files that lay out the traced model's inputs (their strides and offsets): the compile cache's key covers them.
INPUT_SOURCES = (Path(__file__), Path(runner_io.__file__))

# Test-only fault injection: a step fails when any request's prompt holds this token id.
_FAULT_TOKEN = int(os.environ["KILN_TEST_FAULT_TOKEN"]) if os.environ.get("KILN_TEST_FAULT_TOKEN") else None


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
        self._grammar_bitmask: GrammarBitmask | None = None  # made for the first batch with a grammar
        self.time_gpu = False  # record CUDA events around each step (the latency breakdown)
        self.tp_workers = None  # tensor parallel: rank 0's TensorParallelWorkers (engine/distributed.py)
        use_graphs = compiled is not None and device.type == "cuda" and cudagraph_mode != "none"
        self.cudagraph_mode = cudagraph_mode if use_graphs else "none"
        self.capture_sizes = sorted(capture_sizes or []) if use_graphs else []
        # A decode-only batch has at most max_num_seqs tokens: full graphs up to the first size that holds them
        self.largest_full = next((s for s in self.capture_sizes if s >= max_num_seqs), max(self.capture_sizes or [0]))
        # Padding never needs more rows than the largest capture size or the token budget.
        max_tokens = max(max_num_batched_tokens, *self.capture_sizes, 1)
        max_reqs = max(max_num_seqs, *self.capture_sizes, 1)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)

        self.inputs = InputArena(max_tokens, max_reqs, self.max_blocks_per_seq, device)
        # Every request's block ids, row by row, kept on the host from step to step: a request's list only grows
        # (the KV cache manager extends it in place), so a row holding the same list needs only its new tail
        # written; a step then copies its rows into the arena at once. Per row: the list and how much of it.
        self._block_table = np.zeros((max_reqs, self.max_blocks_per_seq), dtype=np.int32)
        self._block_rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_reqs
        self._arange = np.arange(max(max_tokens, max_reqs) + 1)
        self._parity = 0
        self._fences: list[torch.cuda.Event | None] = [None, None]
        # The last launched step's sampled tokens on the device, and each request's row there.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # The last step's sampling rows' params and their metadata, when it can serve again.
        self._sampling_cache: tuple[list[SamplingParams], SamplingMetadata] | None = None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Launch and wait: one synchronous step."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> StepHandle:
        """Prepare inputs, enqueue the forward pass and sampling; returns without waiting for the GPU."""
        if _FAULT_TOKEN is not None and any(_FAULT_TOKEN in r.prompt_token_ids for r in batch.requests):
            raise RuntimeError("injected fault (KILN_TEST_FAULT_TOKEN)")
        handle = StepHandle(batch, [i for i, sample in enumerate(batch.samples) if sample])
        if self.time_gpu and self.device.type == "cuda":
            handle.gpu_start = torch.cuda.Event(enable_timing=True)
            handle.gpu_start.record()
        plan = self.plan(batch)
        metadata, logits_indices = self.prepare_inputs(batch, plan, handle.sample_rows)
        if self.tp_workers is not None:  # tensor parallel: the other ranks run this step's forward too
            self.tp_workers.broadcast_step(self, metadata, plan, len(batch.requests), handle.sample_rows)
        hidden, head = self.forward(metadata, plan)
        if handle.sample_rows:
            requests = batch.requests
            if len(handle.sample_rows) != len(requests):
                requests = [requests[i] for i in handle.sample_rows]
            sampling = self.sampling_metadata(requests)
            grammars = [r.grammar for r in requests]
            constrained = any(grammar is not None for grammar in grammars)
            # a full graph ran the LM head and the greedy argmax over every row (`head`)
            logits = self.model.compute_logits(hidden[logits_indices]) if head is None else head[0][logits_indices]
            if constrained:
                # NOTE: the forward pass and the logits are enqueued by now: the host fills the grammar mask
                # while the device computes them, and the mask is applied in place just before sampling.
                self.grammar_bitmask().apply(logits, grammars)
            if head is not None and not constrained and plain_greedy(sampling):
                result = SamplerOutput(head[1][logits_indices], None)
            else:
                result = self.sampler(logits, sampling)
            self._prev_sampled = result.sampled_token_ids
            self._prev_rows = {r.request_id: j for j, r in enumerate(requests)}
            handle.sampled_cpu = result.sampled_token_ids.to("cpu", non_blocking=True)
            if result.logprobs is not None:
                handle.logprobs_cpu = LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in (
                    result.logprobs.token_ids, result.logprobs.logprobs, result.logprobs.ranks)))  # fmt: skip
        if self.device.type == "cuda":
            handle.done = torch.cuda.Event(enable_timing=handle.gpu_start is not None)
            handle.done.record()
        return handle

    def sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        """The sampling rows' metadata. When every row's parameters and generator are the ones of the
        last step's rows, in order, and none reads its output history (min_tokens, penalties), the last
        step's metadata (and its device tensors) serves again: most decode steps of a steady batch."""
        params = [r.sampling_params for r in requests]
        if self._sampling_cache is not None:
            last_params, sampling = self._sampling_cache
            # Generators enter the metadata only on seeded rows: those are the ones to compare.
            if (len(last_params) == len(params) and all(map(operator.is_, last_params, params))
                    and all(requests[row].generator is g for row, g in sampling.generators.items())):  # fmt: skip
                return sampling
        sampling = SamplingMetadata.build(
            params=params,
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        history = any(p.min_tokens > 0 or p.uses_penalties for p in params)
        self._sampling_cache = None if history else (params, sampling)
        return sampling

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step's tokens (the one host sync of a step) and hand them out per row."""
        batch = handle.batch
        sampled: list[int | None] = [None] * len(batch.requests)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(batch.requests)
        if handle.done is not None:
            if self.tp_workers is not None:
                self.tp_workers.wait(handle.done)  # NOTE: a collective with a dead worker would never finish
            else:
                handle.done.synchronize()
            if handle.gpu_start is not None:
                handle.gpu_seconds = handle.gpu_start.elapsed_time(handle.done) / 1e3
        if not handle.sample_rows:
            return ModelRunnerOutput(sampled, logprobs)
        token_ids = handle.sampled_cpu.tolist()
        row_logprobs = None
        if handle.logprobs_cpu is not None:
            row_logprobs = logprob_dicts(handle.logprobs_cpu, [batch.requests[i] for i in handle.sample_rows])
        for j, row in enumerate(handle.sample_rows):
            sampled[row] = token_ids[j]
            if row_logprobs is not None:
                logprobs[row] = row_logprobs[j]
        return ModelRunnerOutput(sampled, logprobs)

    def grammar_bitmask(self) -> GrammarBitmask:
        """Structured output's token mask; xgrammar is loaded with it, on the first constrained batch."""
        if self._grammar_bitmask is None:
            from kiln.engine.structured_output.grammar import GrammarBitmask  # noqa: PLC0415

            self._grammar_bitmask = GrammarBitmask(1, self.vocab_size, self.device)
        return self._grammar_bitmask

    # ---- graph dispatch -------------------------------------------------------------------------------

    def plan(self, batch: SchedulerOutput) -> GraphPlan:
        """Decode-only batches replay a full graph, others a piecewise one, padded up to the nearest
        capture size; batches beyond the largest size run the compiled pieces without graphs."""
        num_tokens = batch.total_num_tokens
        num_reqs = len(batch.requests)
        size = next((s for s in self.capture_sizes if s >= num_tokens), None)
        if size is None:
            return GraphPlan("none", num_tokens, num_reqs)
        if self.cudagraph_mode == "full_and_piecewise" and num_tokens == num_reqs and size <= self.largest_full:
            return GraphPlan("full", size, size)
        return GraphPlan("piecewise", size, num_reqs)

    def forward(self, metadata: AttentionMetadata, plan: GraphPlan) -> tuple[torch.Tensor, Head | None]:
        """The hidden states, and with a full graph its head's outputs: the logits and greedy tokens of every row."""
        if plan.mode == "full":
            hidden, *head = self.compiled.replay_full_graph(plan.num_tokens)
            return hidden, tuple(head)
        piecewise_size = plan.num_tokens if plan.mode == "piecewise" else None
        context = ForwardContext(metadata, self.kv_caches, self.backend, cudagraph_size=piecewise_size)
        model = self.compiled if self.compiled is not None else self.model
        with set_forward_context(context):
            inputs = self.inputs.views(plan.num_tokens, plan.num_reqs)
            return model(inputs.input_ids, inputs.positions), None

    def head(self, hidden: torch.Tensor) -> Head:
        """What a full graph records after the forward: every row's logits and their argmax (a greedy batch's
        tokens), so a greedy decode step runs no kernel outside its graph."""
        logits = self.model.compute_logits(hidden)
        return logits, row_argmax(logits)

    # ---- inputs ---------------------------------------------------------------------------------------

    def prepare_inputs(self, batch: SchedulerOutput, plan: GraphPlan,
                       sample_rows: list[int]) -> tuple[AttentionMetadata, Rows]:  # fmt: skip
        """Fill the persistent buffers; returns the metadata and where the sampled rows' hidden states are.

        For request i with c computed tokens and n new ones::

            positions:    c, c+1, ..., c+n-1
            slot_mapping: block_table[i][p // block_size] * block_size + p % block_size, per position p

        Token ids come from the host, except a decode's input that the previous step sampled and the
        host has not seen yet (async scheduling): it is copied from that step's output on the device.
        """
        tokens, carry_dst, carry_src, end = [], [], [], 0
        for r, c, n in zip(batch.requests, batch.num_computed_tokens, batch.num_new_tokens):
            all_token_ids = r.all_token_ids
            end += n
            if c + n <= len(all_token_ids):
                if n == 1:
                    tokens.append(all_token_ids[c])  # a decode whose input the host has
                else:
                    tokens += all_token_ids[c : c + n]
                continue
            assert c + n == len(all_token_ids) + 1, "at most one input token can still be on the device"
            tokens += all_token_ids[c:]
            tokens.append(0)
            carry_dst.append(end - 1)
            carry_src.append(self._prev_rows[r.request_id])
        input_ids = np.array(tokens, dtype=np.int64)
        computed = np.asarray(batch.num_computed_tokens, dtype=np.int64)
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        return self.fill_buffers(input_ids, computed, num_new, batch.block_ids, plan, sample_rows,
                                 (carry_dst, carry_src))  # fmt: skip

    def fill_buffers(self, input_ids: np.ndarray, computed: np.ndarray, num_new: np.ndarray,
                     block_ids: list[list[int]], plan: GraphPlan, sample_rows: list[int] = (),
                     carry: tuple[list[int], list[int]] = ((), ())) -> tuple[AttentionMetadata, Rows]:  # fmt: skip
        """Write the step's inputs into this step's pinned mirrors with numpy, then copy them over.

        Padding: tokens past the real ones read id 0 at position 0 and write their K/V into the
        scratch block 0; a full graph's padded requests have one token each and an empty context."""
        p = self._parity
        if self._fences[p] is not None:
            self._fences[p].synchronize()  # the copy out of this mirror two steps ago is done
        num_reqs, num_tokens = len(num_new), len(input_ids)
        n, padded_reqs = plan.num_tokens, plan.num_reqs
        host, inputs = self.inputs.views(n, padded_reqs, p, numpy=True), self.inputs.views(n, padded_reqs)
        seq_lens = computed + num_new

        qsl = host.query_start_loc
        if num_tokens == num_reqs:  # every request a decode (most steps): a token per request, at its end
            qsl[:] = self._arange[: padded_reqs + 1]
            req_of_token, positions, max_query_len = self._arange[:num_reqs], computed, 1
        else:
            qsl[0] = 0
            np.cumsum(num_new, out=qsl[1 : num_reqs + 1])
            qsl[num_reqs + 1 :] = num_tokens + np.arange(1, padded_reqs - num_reqs + 1)
            req_of_token = np.repeat(np.arange(num_reqs), num_new)
            positions = computed[req_of_token] + np.arange(num_tokens) - qsl[req_of_token]
            max_query_len = int(num_new.max())
        block_table, written = self._block_table, self._block_rows
        for i, ids in enumerate(block_ids):
            last, num_written = written[i]
            if last is not ids:
                num_written = 0
            elif num_written == len(ids):
                continue
            block_table[i, num_written : len(ids)] = ids[num_written:]
            written[i] = (ids, len(ids))
        host.block_table[:num_reqs] = block_table[:num_reqs]
        host.input_ids[:num_tokens] = input_ids
        host.positions[:num_tokens] = positions
        host.slot_mapping[:num_tokens] = (
            block_table[req_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        for field in (host.input_ids, host.positions, host.slot_mapping):
            field[num_tokens:] = 0
        host.seq_lens[:num_reqs] = seq_lens
        host.seq_lens[num_reqs:] = 0
        carry_dst, carry_src = carry
        k = len(carry_dst)
        # a decode batch in the previous step's order takes its tokens with a plain copy, others by index
        carry_by_index = k and not carry_dst == carry_src == list(range(k))
        if carry_by_index:
            host.carry[0, :k], host.carry[1, :k] = carry_dst, carry_src
        logits_indices: Rows = slice(0, len(sample_rows))
        if sample_rows and (num_tokens != num_reqs or len(sample_rows) != num_reqs):
            rows = np.asarray(sample_rows, dtype=np.int64)
            host.logits_indices[: len(sample_rows)] = qsl[1:][rows] - 1
            logits_indices = inputs.logits_indices[: len(sample_rows)]

        self.inputs.copy(p, n, padded_reqs, num_reqs)  # the step's one host-to-device transfer
        if k and not carry_by_index:
            inputs.input_ids[:k].copy_(self._prev_sampled[:k])
        elif carry_by_index:
            dst, src = inputs.carry[0, :k], inputs.carry[1, :k]
            inputs.input_ids.index_copy_(0, dst, self._prev_sampled.index_select(0, src))
        if self.device.type == "cuda":
            self._fences[p] = torch.cuda.Event()
            self._fences[p].record()
        self._parity ^= 1

        full = plan.mode == "full"
        num_actual_tokens = n if full else num_tokens  # a full graph writes K/V for padding too (to scratch)
        host_views = self.inputs.views(n, padded_reqs, p)
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping if full else inputs.slot_mapping[:num_tokens],
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=host_views.query_start_loc,
            seq_lens_cpu=host_views.seq_lens,
        )
        return metadata, logits_indices

    # ---- start-up -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Dummy steps (K/V into the scratch block) first, so no kernel is JIT-compiled while serving or capturing:
        the one Dynamo trace, prefills of 16 and 64 tokens (the Triton attention's two query tiles), a decode of each
        variant the backend runs 1 to the most requests as (one: the one-row matmul's too), the argmax kernel."""
        longest = max(2, min(self.max_model_len - 1, self.inputs.max_tokens))  # the trace needs >= 2 tokens
        for num_tokens in (16, 64):
            self._dummy_forward(min(num_tokens, longest), False, "none")
        most = min(self.inputs.max_reqs, self.inputs.max_tokens)  # a decode: one request a token, at position 0
        kv_heads, head_dim = self.kv_caches[0].shape[-2:]
        heads = kv_heads * (self.model.config.num_heads // self.model.config.num_kv_heads)  # on this GPU
        smallest_of = {self.backend.decode_variant(n, heads, kv_heads, head_dim): n for n in range(most, 0, -1)}
        for num_reqs in sorted({*smallest_of.values(), most if self.device.type == "cuda" else min(4, most)}):
            self._dummy_forward(num_reqs, True, "none")
        if self.device.type == "cuda":  # the argmax kernel's variants: of the logits, and of float32 (sampling)
            for dtype in {next(self.model.parameters()).dtype, torch.float32}:
                row_argmax(torch.zeros(1, self.vocab_size, dtype=dtype, device=self.device))

    @torch.inference_mode()
    def capture_cudagraphs(self, counters) -> None:
        """Largest size first (smaller graphs reuse the shared pool's memory); full graphs up to `largest_full`. No
        dummy step before a capture (`warm_up` ran every kernel variant), and the allocator emptied once, not per
        capture (`GraphPool.capture`: ~1,700 of them, a piece a layer per size)."""
        torch.cuda.empty_cache()
        for size in tqdm(sorted(self.capture_sizes)[::-1], desc="capturing CUDA graphs", unit="size", leave=False):
            with counters.timed("capture_seconds"):
                self._dummy_forward(size, False, "piecewise")  # captures each piece for this size
                counters.cudagraphs_captured += 1
                if self.cudagraph_mode == "full_and_piecewise" and size <= self.largest_full:
                    metadata, _ = self._dummy_metadata(size, True, "full")
                    context = ForwardContext(metadata, self.kv_caches, self.backend)
                    inputs = self.inputs.views(size, size)
                    with set_forward_context(context):
                        self.compiled.capture_full_graph(size, inputs.input_ids, inputs.positions, self.head)
        torch.cuda.synchronize()

    def _dummy_metadata(self, num_tokens: int, decode: bool, mode: str) -> tuple[AttentionMetadata, GraphPlan]:
        """`num_tokens` one-token requests (decode) or as few prefills as fit in max_model_len, every
        K/V slot in the scratch block."""
        # NOTE: not the block table's rounded-up capacity: positions past max_model_len index past the
        # rotary table.
        per_req = 1 if decode else min(num_tokens, self.max_model_len)
        num_new = np.full(-(-num_tokens // per_req), per_req, dtype=np.int64)
        num_new[-1] = num_tokens - per_req * (len(num_new) - 1)
        blocks = [[0] * -(-int(n) // self.block_size) for n in num_new]
        plan = GraphPlan(mode, num_tokens, len(num_new))
        zeros = np.zeros(len(num_new), dtype=np.int64)
        metadata, _ = self.fill_buffers(np.zeros(num_tokens, dtype=np.int64), zeros, num_new, blocks, plan)
        return metadata, plan

    def _dummy_forward(self, num_tokens: int, decode: bool, mode: str) -> None:
        self.forward(*self._dummy_metadata(num_tokens, decode, mode))
