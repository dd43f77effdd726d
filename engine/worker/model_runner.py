"""The model runner: turn a scheduled batch into flat tensors, run the model, sample.

Inputs are written into persistent device buffers (sized for the largest batch at start-up) so the addresses
never change from step to step: what CUDA-graph replay needs, and one allocation fewer per step besides.
"""

from __future__ import annotations

import logging
import operator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from kiln.backends.attention import AttentionBackend, AttentionMetadata, ForwardContext, set_forward_context
from kiln.compile import CompiledModel
from kiln.engine.messages import TokenLogprobs
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.worker import input_writer, prompt_logprobs
from kiln.engine.worker import inputs as runner_io
from kiln.engine.worker.draft_verification import DraftVerification, Head, draft_rows
from kiln.engine.worker.input_writer import InputWriter, Rows
from kiln.engine.worker.inputs import GraphPlan, ModelRunnerOutput, StepHandle, StepTokens, logprob_lists
from kiln.engine.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    plain_greedy,
    row_argmax,
)

if TYPE_CHECKING:
    from kiln.cache import KVGroups
    from kiln.engine.core.request import Request
    from kiln.engine.core.scheduler import SchedulerOutput
    from kiln.engine.core.tensor_parallel import TensorParallelWorkers
    from kiln.engine.spec_decode.eagle_proposer import EagleProposer
    from kiln.engine.structured_output.grammar import GrammarBitmask

logger = logging.getLogger("kiln")

# The files that lay out the traced model's inputs (their strides and offsets): the compile cache's key covers them.
INPUT_SOURCES = (Path(__file__), Path(runner_io.__file__), Path(input_writer.__file__))


class ModelRunner(DraftVerification):
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
        tp_workers: TensorParallelWorkers | None = None,
        kv_groups: KVGroups | None = None,
        recurrent_states: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
        num_speculative_tokens: int = 0,
        draft_records: tuple = (),
    ) -> None:
        """`tp_workers`: rank 0's handle on the other tensor-parallel ranks, which run each step's forward too.
        `kv_groups`: the layers' KV groups (kiln.cache.groups), each with block tables of its own when several.
        `recurrent_states`: each recurrent layer's (conv, delta-rule) state tensors, a row a slot
        (kiln.cache.state_cache). `num_speculative_tokens`: speculative decoding's k, for whose verification steps
        full graphs are captured too; `draft_records`: each recurrent layer's record of its slots' last verification
        step (backends/linear_attention/op.py)."""
        self.model = model
        self.compiled = compiled
        self.kv_caches = kv_caches
        self.backend = backend
        # each layer's sliding window, for a backend that reads them (for the others start-up capped the context)
        attention = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
        windows = tuple(getattr(layer, "window", 0) for layer in attention)
        self.windows = windows if backend.sliding_window and any(windows) else ()
        softcaps = tuple(getattr(layer, "softcap", 0.0) for layer in attention)
        if any(softcaps) and not backend.logit_softcap:
            raise ValueError(f"the {backend.name} attention backend does not soft-cap scores, as this model needs")
        self.softcaps = softcaps if any(softcaps) else ()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.recurrent_states = recurrent_states
        self.aux_hidden: torch.Tensor | None = None  # EAGLE-3: the target layers' states a step leaves (startup.py)
        self.last_hidden: torch.Tensor | None = None
        self.sampler = Sampler()
        self._grammar_bitmask: GrammarBitmask | None = None  # made for the first batch with a grammar
        self.tp_workers = tp_workers
        use_graphs = compiled is not None and device.type == "cuda" and cudagraph_mode != "none"
        self.cudagraph_mode = cudagraph_mode if use_graphs else "none"
        self.capture_sizes = sorted(capture_sizes or []) if use_graphs else []
        # A decode-only batch has at most max_num_seqs tokens: full graphs up to the first size that holds them
        self.largest_full = next((s for s in self.capture_sizes if s >= max_num_seqs), max(self.capture_sizes or [0]))
        # Padding never needs more rows than the largest capture size or the token budget.
        max_tokens = max(max_num_batched_tokens, *self.capture_sizes, 1)
        max_reqs = max(max_num_seqs, *self.capture_sizes, 1)
        self.max_model_len = max_model_len
        # A step verifying k drafts of every request (1 + k query tokens each) replays a full graph of its own, sizes
        # up to `largest_full` requests (a recurrent model's too: its op plans its fold and records on the device).
        self.verify_len = 1 + num_speculative_tokens if num_speculative_tokens else 1
        self.verify_sizes: list[int] = []
        self.full_verifications = 0  # steps that verified drafts in a full graph
        if self.verify_len > 1 and self.cudagraph_mode == "full_and_piecewise":
            fits = [s for s in self.capture_sizes if s <= self.largest_full and s * self.verify_len <= max_tokens]
            self.verify_sizes = fits
        num_groups = kv_groups.num_groups if kv_groups is not None else 1
        self.layer_groups = kv_groups.layer_group if num_groups > 1 else ()
        # (an EAGLE-3 or MTP drafter writes its first pass's inputs and its chain's k - 1 after the step's)
        writes = 1 + num_speculative_tokens
        self.writer = InputWriter(max_tokens, max_reqs, max_model_len, block_size, device, num_groups, writes)
        self.inputs = self.writer.arena  # the persistent buffers every step's inputs (and a graph's) live in
        self.draft_records = draft_records
        if draft_records:  # (each slot's kept tokens: written after a verdict, read by the next step's inputs)
            num_slots = draft_records[0].g.shape[0]
            self.writer.kept_tokens = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # The last launched step's sampled tokens on the device (the next step's inputs read them there).
        self._prev: StepTokens | None = None
        # EAGLE-3's or MTP's proposer (engine_core.py): it drafts on the device right after each step's sampling
        self.drafter: EagleProposer | None = None
        # The last step's sampling rows' params and their metadata, when it can serve again.
        self._sampling_cache: tuple[list[SamplingParams], SamplingMetadata] | None = None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Launch and wait: one synchronous step."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> StepHandle:
        """Prepare inputs, enqueue the forward pass and sampling; returns without waiting for the GPU."""
        handle = StepHandle(batch, [i for i, sample in enumerate(batch.samples) if sample])
        plan = self.plan(batch)
        shift = self._shift(batch)
        metadata, logits_indices = self.prepare_inputs(batch, plan, handle.sample_rows, shift)
        prompt_spec = prompt_logprobs.prompt_rows(batch) if batch.prompt_logprobs else []
        drafts = draft_rows(batch, handle.sample_rows) if batch.spec_token_ids and any(batch.spec_token_ids) else None
        if self.tp_workers is not None:  # tensor parallel: the other ranks run this step's forward too
            slices = prompt_logprobs.logit_slices(prompt_spec)
            rows, copies = handle.sample_rows, batch.state_copies
            logit_rows = None if drafts is None else drafts[0]
            self.tp_workers.broadcast_step(self, metadata, plan, len(batch.requests), rows, slices, copies, logit_rows)
        before, after = batch.state_copies
        self.copy_states(before)  # (a prefix hit's snapshot into its request's slot)
        hidden, head = self.forward(metadata, plan)
        self.last_hidden = hidden  # (an MTP drafter's first states; valid until the next forward)
        self.copy_states(after)  # (snapshots of states the step leaves on a block boundary)
        if handle.sample_rows and drafts is not None:
            self._verify_drafts(batch, handle, hidden, head, *drafts)
        elif handle.sample_rows:
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
            sampled = result.sampled_token_ids
            index = {r.request_id: j for j, r in enumerate(requests)}
            # (the rows a copy where a drafter reads them: the arena's field is the drafter's to write next)
            on_device = isinstance(logits_indices, torch.Tensor)
            rows = logits_indices if on_device else self.writer.device_arange[: len(requests)]
            next_rows = rows.clone() if on_device and self.drafter is not None else rows
            self._prev = StepTokens(index, sampled, next_rows, next_rows, sampled)
            handle.sampled_cpu = result.sampled_token_ids.to("cpu", non_blocking=True)
            if result.logprobs is not None:
                handle.logprobs_cpu = result.logprobs.to_host()
        if prompt_spec:  # (after the sampling's LM head: tensor-parallel ranks run theirs in this order)
            computed = prompt_logprobs.compute(self.model.compute_logits, hidden, batch, prompt_spec)
            handle.prompt_logprobs_cpu = [(i, start, tensors.to_host()) for i, start, tensors in computed]
        if self.device.type == "cuda":
            handle.done = torch.cuda.Event()
            handle.done.record()
        if self.drafter is not None:  # (after `done`: the host need not wait for the chain)
            self.drafter.propose(batch, handle.sample_rows, self._prev if handle.sample_rows else None, shift)
        return handle

    def sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        """The sampling rows' metadata. When every row's parameters and generator are the ones of the
        last step's rows, in order, and none reads its output history (min_tokens, penalties), the last
        step's metadata (and its device tensors) serves again: most decode steps of a steady batch."""
        params = [r.sampling_params for r in requests]
        if self._sampling_cache is not None:
            last_params, sampling = self._sampling_cache
            # Generators enter the metadata only on seeded rows: those are the ones to compare.
            if (
                len(last_params) == len(params)
                and all(map(operator.is_, last_params, params))
                and all(requests[row].generator is g for row, g in sampling.generators.items())
            ):
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
        logprobs: list[TokenLogprobs | None] = [None] * len(batch.requests)
        if handle.done is not None:
            if self.tp_workers is not None:
                self.tp_workers.wait(handle.done)  # NOTE: a collective with a dead worker would never finish
            else:
                handle.done.synchronize()
        prompt = None
        if handle.prompt_logprobs_cpu is not None:
            prompt = {i: (start, prompt_logprobs.entries(t)) for i, start, t in handle.prompt_logprobs_cpu}
        if not handle.sample_rows:
            return ModelRunnerOutput(sampled, logprobs, prompt)
        if handle.draft_spans is not None:
            return self._collect_drafts(handle, sampled, logprobs, prompt)
        token_ids = handle.sampled_cpu.tolist()
        row_logprobs = None
        if handle.logprobs_cpu is not None:
            row_logprobs = logprob_lists(handle.logprobs_cpu, [batch.requests[i] for i in handle.sample_rows])
        for j, row in enumerate(handle.sample_rows):
            sampled[row] = token_ids[j]
            if row_logprobs is not None:
                logprobs[row] = row_logprobs[j]
        return ModelRunnerOutput(sampled, logprobs, prompt)

    def grammar_bitmask(self) -> GrammarBitmask:
        """Structured output's token mask; xgrammar is loaded with it, on the first constrained batch."""
        if self._grammar_bitmask is None:
            from kiln.engine.structured_output.grammar import GrammarBitmask  # noqa: PLC0415

            self._grammar_bitmask = GrammarBitmask(1, self.vocab_size, self.device)
        return self._grammar_bitmask

    # ---- graph dispatch -------------------------------------------------------------------------------

    def plan(self, batch: SchedulerOutput) -> GraphPlan:
        """Decode-only batches replay a full graph, and so do steps verifying k drafts of every request; others a
        piecewise one, padded up to the nearest capture size; batches beyond the largest size run the compiled
        pieces without graphs."""
        num_tokens = batch.total_num_tokens
        num_reqs = len(batch.requests)
        if self.verify_sizes and num_tokens == num_reqs * self.verify_len and self._uniform_drafts(batch):
            reqs = next((s for s in self.verify_sizes if s >= num_reqs), None)
            if reqs is not None:  # (padded with one-token requests of no context, as a decode graph's)
                return GraphPlan("full", reqs * self.verify_len, reqs)
        size = next((s for s in self.capture_sizes if s >= num_tokens), None)
        if size is None:
            return GraphPlan("none", num_tokens, num_reqs)
        if self.cudagraph_mode == "full_and_piecewise" and num_tokens == num_reqs and size <= self.largest_full:
            return GraphPlan("full", size, size)
        return GraphPlan("piecewise", size, num_reqs)

    def forward(self, metadata: AttentionMetadata, plan: GraphPlan) -> tuple[torch.Tensor, Head | None]:
        """The hidden states, and with a full graph its head's outputs: the logits and greedy tokens of every row."""
        if plan.mode == "full":
            self.full_verifications += plan.num_tokens != plan.num_reqs
            hidden, *head = self.compiled.replay_full_graph(plan.num_tokens, plan.num_reqs)
            return hidden, tuple(head)
        piecewise_size = plan.num_tokens if plan.mode == "piecewise" else None
        context = self._context(metadata, piecewise_size)
        model = self.compiled if self.compiled is not None else self.model
        with set_forward_context(context):
            inputs = self.inputs.views(plan.num_tokens, plan.num_reqs)
            return model(inputs.input_ids, inputs.positions), None

    def _context(self, metadata: AttentionMetadata, cudagraph_size: int | None = None) -> ForwardContext:
        return ForwardContext(
            metadata,
            self.kv_caches,
            self.backend,
            cudagraph_size,
            self.windows,
            self.softcaps,
            self.layer_groups,
            self.recurrent_states,
            self.aux_hidden,
            self.draft_records,
        )

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy rows of every recurrent layer's state tensors, (from, to) pairs, in the step's stream order."""
        if not copies:
            return
        targets = {b for _, b in copies}
        if len(targets) < len(copies) or targets & {a for a, _ in copies}:  # (order matters: one at a time)
            for pair in copies:
                self.copy_states([pair])
            return
        sources = torch.tensor([a for a, _ in copies], device=self.device)
        targets = torch.tensor([b for _, b in copies], device=self.device)
        for states in self.recurrent_states:
            for tensor in states:
                tensor.index_copy_(0, targets, tensor.index_select(0, sources))

    def head(self, hidden: torch.Tensor) -> Head:
        """What a full graph records after the forward: every row's logits and their argmax (a greedy batch's
        tokens), so a greedy decode step runs no kernel outside its graph."""
        logits = self.model.compute_logits(hidden)
        return logits, row_argmax(logits)

    # ---- inputs ---------------------------------------------------------------------------------------

    def prepare_inputs(
        self, batch: SchedulerOutput, plan: GraphPlan, sample_rows: list[int], shift: torch.Tensor | None = None
    ) -> tuple[AttentionMetadata, Rows]:
        """The step's inputs in the persistent buffers (`InputWriter.prepare`), a decode's input that the last step
        sampled on the device taken from there."""
        return self.writer.prepare(batch, plan, sample_rows, self._prev, shift)

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
        heads = next(layer.self_attn.num_heads for layer in self.model.model.layers if hasattr(layer, "self_attn"))
        sizes = {most if self.device.type == "cuda" else min(4, most)}
        for kv_heads, head_dim in {tuple(cache.shape[-2:]) for cache in self.kv_caches}:  # (Gemma 4's are two)
            smallest_of = {self.backend.decode_variant(n, heads, kv_heads, head_dim): n for n in range(most, 0, -1)}
            sizes |= set(smallest_of.values())
        for num_reqs in sorted(sizes):  # (heads: this GPU's query heads)
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
                    self._capture_full(size, 1)
                if size in self.verify_sizes:
                    try:
                        self._capture_full(size, self.verify_len, warm=True)
                    except Exception:  # (verification then replays the piecewise graphs, as a mixed step does)
                        logger.exception("capturing the full graphs of %d-token verifications failed", self.verify_len)
                        self.verify_sizes = []
        torch.cuda.synchronize()

    def _capture_full(self, num_reqs: int, query_len: int, warm: bool = False) -> None:
        """The full graph of `num_reqs` requests of `query_len` tokens each; with `warm`, one uncaptured forward of
        that shape first (a verification's: warm_up ran no step of that shape)."""
        metadata, plan = self._dummy_metadata(num_reqs * query_len, True, "full", query_len)
        if warm:
            self.forward(metadata, GraphPlan("none", plan.num_tokens, plan.num_reqs))
            metadata.derived.clear()  # (what the warm-up derived lives outside the graph: the capture derives its own)
        inputs = self.inputs.views(plan.num_tokens, plan.num_reqs)
        with set_forward_context(self._context(metadata)):
            self.compiled.capture_full_graph(
                plan.num_tokens, plan.num_reqs, inputs.input_ids, inputs.positions, self.head
            )

    def _dummy_metadata(
        self, num_tokens: int, decode: bool, mode: str, query_len: int = 1
    ) -> tuple[AttentionMetadata, GraphPlan]:
        """`num_tokens` requests of `query_len` tokens (decode; a verification's with query_len > 1) or as few
        prefills as fit in max_model_len, every K/V slot in the scratch block."""
        # NOTE: not the block table's rounded-up capacity: positions past max_model_len index past the
        # rotary table.
        per_req = query_len if decode else min(num_tokens, self.max_model_len)
        num_new = np.full(-(-num_tokens // per_req), per_req, dtype=np.int64)
        num_new[-1] = num_tokens - per_req * (len(num_new) - 1)
        blocks = [[0] * -(-int(n) // self.block_size) for n in num_new]
        plan = GraphPlan(mode, num_tokens, len(num_new))
        zeros = np.zeros(len(num_new), dtype=np.int64)
        metadata, _ = self.writer.write(np.zeros(num_tokens, dtype=np.int64), zeros, num_new, blocks, plan)
        return metadata, plan

    def _dummy_forward(self, num_tokens: int, decode: bool, mode: str) -> None:
        self.forward(*self._dummy_metadata(num_tokens, decode, mode))
