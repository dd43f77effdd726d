"""A step's inputs, from a scheduled batch to the persistent device buffers the model (and a CUDA graph) reads:
token ids, positions, slot mapping and the attention metadata, written with numpy into a pinned host mirror and
copied over in one transfer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.backends.attention import AttentionMetadata
from kiln.engine.worker.inputs import DRAFT_ON_DEVICE, GraphPlan, InputArena, StepInputs, StepTokens
from kiln.engine.worker.sampler import to_device

if TYPE_CHECKING:
    from kiln.engine.core.scheduler import SchedulerOutput

Rows = torch.Tensor | slice  # rows of the hidden states: an index tensor, or a slice when that is all of them


class InputWriter:
    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
        writes_per_step: int = 1,
    ) -> None:
        """`writes_per_step`: how many times a step writes inputs (a drafter's passes write theirs after the step's):
        twice as many host mirrors take turns, so a write waits only for copies two steps old, never for the step
        it belongs to."""
        self.block_size = block_size
        self.device = device
        self.num_groups = num_groups
        max_blocks_per_seq = -(-max_model_len // block_size)
        mirrors = 2 * writes_per_step
        self.arena = InputArena(max_tokens, max_reqs, max_blocks_per_seq, device, num_groups, mirrors)
        # Every request's block ids, row by row, kept on the host from step to step: a request's list only grows
        # (the KV cache manager extends it in place), so a row holding the same list needs only its new tail
        # written; a step then copies its rows into the arena at once. Per row: the list and how much of it.
        # With several KV groups a row holds each group's table ([G, width]), tracked a group at a time.
        shape = (max_reqs, num_groups, max_blocks_per_seq) if num_groups > 1 else (max_reqs, max_blocks_per_seq)
        self._block_table = np.zeros(shape, dtype=np.int32)
        self._block_rows: list[list[tuple[list[int] | None, int]]] = [[(None, 0)] * max_reqs for _ in range(num_groups)]
        self._arange = np.arange(max(max_tokens, max_reqs) + 1)
        self.device_arange = torch.arange(max(max_tokens, max_reqs) + 1, device=device)
        # The host mirror the next write fills (they take turns), and the copy out of each (done once its event fires).
        self._parity = 0
        self._fences: list[torch.cuda.Event | None] = [None] * mirrors
        # a hybrid model verifying drafts: per recurrent-state slot, the tokens its request's last verification step
        # kept (its input and the drafts kept), written by the runner after the verdict (set by the runner)
        self.kept_tokens: torch.Tensor | None = None

    def prepare(
        self,
        batch: SchedulerOutput,
        plan: GraphPlan,
        sample_rows: list[int],
        prev: StepTokens | None,
        shift: torch.Tensor | None = None,
    ) -> tuple[AttentionMetadata, Rows]:
        """Fill the persistent buffers; returns the metadata and where the sampled rows' hidden states are.

        For request i with c computed tokens and n new ones::

            positions:    c, c+1, ..., c+n-1
            slot_mapping: block_table[i][p // block_size] * block_size + p % block_size, per position p

        Token ids come from the host, except a decode's input that the previous step sampled and the
        host has not seen yet (async scheduling): it is copied from that step's output on the device
        (`prev.next_ids`, the request's row there `prev.index[request_id]`); and the drafts an EAGLE-3 or
        MTP drafter left on the device (`batch.device_drafts`), copied from there. `shift`: each request's
        correction of c on the device (`write`).
        """
        tokens, carry_dst, carry_src, end, draft_dst, draft_src = [], [], [], 0, [], []
        drafts = batch.spec_token_ids or [()] * len(batch.requests)
        for r, c, n, draft in zip(batch.requests, batch.num_computed_tokens, batch.num_new_tokens, drafts):
            all_token_ids = r.all_token_ids
            end += n
            num_inputs = n - len(draft)  # (then the drafts it verifies)
            if c + num_inputs <= len(all_token_ids):
                if num_inputs == 1:
                    tokens.append(all_token_ids[c])  # a decode whose input the host has
                else:
                    tokens += all_token_ids[c : c + num_inputs]
            else:  # its last input the previous step sampled (c may run ahead of the host's tokens: `write`'s shift)
                assert num_inputs == 1 or c + num_inputs == len(all_token_ids) + 1, "one input token on the device"
                tokens += all_token_ids[c : c + num_inputs - 1]
                tokens.append(0)
                carry_dst.append(end - len(draft) - 1)
                carry_src.append(prev.index[r.request_id])
            if draft:  # speculative decoding: the drafts to verify after the input tokens
                if draft[0] == DRAFT_ON_DEVICE:  # (EAGLE-3's, MTP's: copied from the drafter's tensor below)
                    on_device, row_of = batch.device_drafts
                    first = row_of[r.request_id] * on_device.shape[1]
                    draft_dst += range(end - len(draft), end)
                    draft_src += range(first, first + len(draft))
                tokens += draft
        input_ids = np.array(tokens, dtype=np.int64)
        computed = np.asarray(batch.num_computed_tokens, dtype=np.int64)
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        carry = (carry_dst, carry_src)
        prev_ids = prev.next_ids if prev is not None else None
        states = (batch.state_slots, batch.state_folds)
        written = self.write(
            input_ids, computed, num_new, batch.block_ids, plan, sample_rows, carry, prev_ids, states, shift
        )
        if draft_dst:  # (in the stream after the chain that drafted them, and before this step's forward)
            dst, src = to_device([draft_dst, draft_src], torch.int64, self.device)
            self.arena.input_ids.index_copy_(0, dst, batch.device_drafts[0].view(-1).index_select(0, src))
        return written

    def write(
        self,
        input_ids: np.ndarray,
        computed: np.ndarray,
        num_new: np.ndarray,
        block_ids: list,
        plan: GraphPlan,
        sample_rows: list[int] = (),
        carry: tuple[list[int], list[int]] = ((), ()),
        prev_sampled: torch.Tensor | None = None,
        states: tuple[list[int], list[tuple[int, int]]] = ((), ()),
        shift: torch.Tensor | None = None,
    ) -> tuple[AttentionMetadata, Rows]:
        """Write the step's inputs into this step's pinned mirrors with numpy, then copy them over. `block_ids`:
        each request's block table, or with several KV groups its table in each (one table: the same in each).

        `shift` ([requests] int64, on the device, <= 0): each request's computed count as the host wrote it was
        ahead by that many (it was scheduled assuming the step in flight kept all its drafts, and the device
        knows how many it did not): its positions, sequence length and slots are moved back there, after the copy.

        Padding: tokens past the real ones read id 0 at position 0 and write their K/V into the
        scratch block 0; a full graph's padded requests have one token each and an empty context."""
        p = self._parity
        if self._fences[p] is not None:
            self._fences[p].synchronize()  # the copy out of this mirror two steps ago is done
        num_reqs, num_tokens = len(num_new), len(input_ids)
        n, padded_reqs = plan.num_tokens, plan.num_reqs
        host, inputs = self.arena.views(n, padded_reqs, p, numpy=True), self.arena.views(n, padded_reqs)
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
        # (rows are copied from where they were last written: entries a sliding window freed since keep their old
        # ids here, pages before the window that no kernel reads; a request's tables in every group have one length,
        # so where its first group's is as written, all are)
        block_table, groups = self._block_table, self.num_groups
        tables_of_group = [block_table[:, g] for g in range(groups)] if groups > 1 else [block_table]
        first_written, used = self._block_rows[0], 0
        for i, tables in enumerate(block_ids):
            each = tables if groups > 1 and tables and isinstance(tables[0], list) else [tables] * groups
            used = max(used, len(each[0]))
            last, num_written = first_written[i]
            if last is each[0] and num_written == len(last):
                continue
            for g, ids in enumerate(each):
                last, num_written = self._block_rows[g][i]
                if last is not ids:
                    num_written = 0
                tables_of_group[g][i, num_written : len(ids)] = ids[num_written:]
                self._block_rows[g][i] = (ids, len(ids))
        # only the columns some table reaches: a row is max_model_len / block_size wide (8,192 at 131,072 tokens) and
        # no kernel reads past its request's context, so what lies beyond in this mirror may be any old ids
        host.block_table[:num_reqs, ..., :used] = block_table[:num_reqs, ..., :used]
        host.input_ids[:num_tokens] = input_ids
        host.positions[:num_tokens] = positions
        pages, offsets = positions // self.block_size, positions % self.block_size
        if self.num_groups > 1:
            slots = block_table[req_of_token, :, pages].astype(np.int64).T * self.block_size + offsets
            host.slot_mapping[:, :num_tokens] = slots
        else:
            slots = block_table[req_of_token, pages].astype(np.int64) * self.block_size + offsets
            host.slot_mapping[:num_tokens] = slots
        for field in (host.input_ids, host.positions, host.slot_mapping):
            field[..., num_tokens:] = 0
        host.seq_lens[:num_reqs] = seq_lens
        host.seq_lens[num_reqs:] = 0
        state_slots, state_folds = states
        host.state_slots[: len(state_slots)] = state_slots
        host.state_slots[len(state_slots) :] = 0  # (none: the scratch row, as padded requests)
        folds = len(state_folds)
        if folds:
            host.state_folds[:, :folds] = np.asarray(state_folds, dtype=np.int32).T
        host.state_folds[:, folds:] = 0
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

        self.arena.copy(p, n, padded_reqs, num_reqs)  # the step's one host-to-device transfer
        if k and not carry_by_index:
            inputs.input_ids[:k].copy_(prev_sampled[:k])
        elif carry_by_index:
            dst, src = inputs.carry[0, :k], inputs.carry[1, :k]
            inputs.input_ids.index_copy_(0, dst, prev_sampled.index_select(0, src))
        if shift is not None:
            self._shift(inputs, host, num_tokens, num_reqs, req_of_token, shift)
        if folds and any(fold for fold, _ in state_folds):
            slots = inputs.state_slots[:folds]
            inputs.state_folds[0, :folds].mul_(self.kept_tokens.index_select(0, slots))
        if self.device.type == "cuda":
            self._fences[p] = torch.cuda.Event()
            self._fences[p].record()
        self._parity = (p + 1) % len(self._fences)

        full = plan.mode == "full"
        num_actual_tokens = n if full else num_tokens  # a full graph writes K/V for padding too (to scratch)
        host_views = self.arena.views(n, padded_reqs, p)
        slot_mapping = inputs.slot_mapping if full else inputs.slot_mapping[..., :num_tokens]
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_table=inputs.block_table,
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=host_views.query_start_loc,
            seq_lens_cpu=host_views.seq_lens,
            state_slots=inputs.state_slots,
            state_slots_cpu=host_views.state_slots,
            state_folds=inputs.state_folds,
        )
        if self.num_groups > 1:
            metadata = metadata.with_groups(inputs.block_table, slot_mapping)
        return metadata, logits_indices

    def _shift(
        self, inputs: StepInputs, host: StepInputs, num_tokens: int, num_reqs: int, req_of_token, shift: torch.Tensor
    ) -> None:
        """Move each request's positions and sequence length by `shift` on the device and recompute their slots from
        the block table there. On the CPU the host's sequence lengths follow (the torch backend reads those)."""
        if num_tokens == num_reqs:
            token_shift, req_index = shift, self.device_arange[:num_reqs]
        else:
            req_index = to_device(req_of_token, torch.int64, self.device)
            token_shift = shift.index_select(0, req_index)
        positions = inputs.positions[:num_tokens]
        positions.add_(token_shift)
        inputs.seq_lens[:num_reqs].add_(shift.to(torch.int32))
        pages, offsets = positions // self.block_size, positions % self.block_size
        if self.num_groups > 1:
            slots = inputs.block_table[req_index, :, pages].long().T * self.block_size + offsets
        else:
            slots = inputs.block_table[req_index, pages].long() * self.block_size + offsets
        inputs.slot_mapping[..., :num_tokens].copy_(slots)
        if self.device.type == "cpu":
            host.seq_lens[:num_reqs] += shift.numpy().astype(np.int32)
