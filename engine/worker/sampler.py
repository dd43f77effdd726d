"""Batched sampling on the device: logits ``[B, V]`` -> one token id per row, with no host sync.

The order is vLLM V1's, so a vLLM user gets the same distribution for the same parameters:

    raw logits ──► logprobs = log_softmax(raw)                 (only when some row asked)
        │ float32
        ▼
    logit_bias ─► min_tokens (EOS and stop ids -> -inf) ─► penalties (repetition, frequency, presence)
        ├─► greedy rows: argmax
        └─► random rows: / temperature ─► min-p ─► top-k ─► top-p ─► softmax ─► argmax(p / Exp(1))

``SamplingMetadata`` is built once per step and holds only what the batch uses: a batch without
penalties carries no penalty tensors and runs no penalty kernels, an all-greedy batch never sorts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.backends.kernels import argmax
from kiln.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own generator. It must live on the logits' device: ``exponential_`` on a CUDA
    tensor only takes a CUDA generator. Create it once per request; its state advances each step."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass
class SparseLogitUpdate:
    """Logits touched at a few ``(row, token)`` pairs: added ``values``, or ``-inf`` when None."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor | None  # [N] float32


@dataclass
class PenaltyTensors:
    """Penalties of the rows that use them (``rows``; None when that is every row)."""

    rows: torch.Tensor | None  # [P] int64
    repetition: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32
    # Padded with V, a column past the vocabulary that is sliced off after the scatter.
    prompt_token_ids: torch.Tensor | None  # [P, Lp] int64; None when no row has a repetition penalty
    output_token_ids: torch.Tensor  # [P, Lo] int64


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step's sampling rows; all tensors on the logits' device."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool, only for mixed batches
    temperature: torch.Tensor | None  # [B, 1] float32, 1.0 on greedy rows; None when all greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V], V = off; None when no row uses it
    max_top_k: int  # largest top_k in use, so top-k alone needs only a partial topk
    top_p: torch.Tensor | None  # [B, 1] float32
    min_p: torch.Tensor | None  # [B, 1] float32
    generators: dict[int, torch.Generator]  # seeded random rows -> their request's generator
    logit_bias: SparseLogitUpdate | None
    min_tokens_block: SparseLogitUpdate | None
    penalties: PenaltyTensors | None
    max_num_logprobs: int | None  # None when no row asked for logprobs

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Row ``i`` of the step's logits belongs to ``params[i]``. ``output_token_ids[i]`` is every
        token the request has produced so far (it drives min_tokens and the penalties);
        ``generators[i]`` is that request's generator, required when it has a seed.
        ``vocab_size`` must equal the logits' width. Raises ``ValueError`` on a token id outside
        the vocabulary, since on the device it would be an unrecoverable assert."""
        device = torch.device(device)
        num_rows = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows:
            raise ValueError(
                f"params, prompt_token_ids, output_token_ids and generators must have one entry per row ({num_rows})"
            )
        tensor = lambda data, dtype: to_device(data, dtype, device)
        greedy = [p.is_greedy for p in params]
        random_rows = [i for i in range(num_rows) if not greedy[i]]
        all_greedy, all_random = not random_rows, len(random_rows) == num_rows

        # Greedy rows get neutral values so one batched op serves a mixed batch.
        temperature = top_k = top_p = min_p = greedy_mask = None
        max_top_k, seeded = vocab_size, {}
        if not all_greedy:
            temperature = tensor([[1.0 if g else p.temperature] for p, g in zip(params, greedy)], torch.float32)
            ks = [p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size for p, g in zip(params, greedy)]
            if min(ks) < vocab_size:
                top_k, max_top_k = tensor(ks, torch.int64), max(k for k in ks if k < vocab_size)
            if any(params[i].top_p < 1.0 for i in random_rows):
                top_p = tensor([[1.0 if g else p.top_p] for p, g in zip(params, greedy)], torch.float32)
            if any(params[i].min_p > 0.0 for i in random_rows):
                min_p = tensor([[0.0 if g else p.min_p] for p, g in zip(params, greedy)], torch.float32)
            if not all_random:
                greedy_mask = tensor(greedy, torch.bool)
            for i in random_rows:
                if generators[i] is not None:
                    seeded[i] = generators[i]
                elif params[i].seed is not None:
                    raise ValueError(f"row {i} has seed={params[i].seed} but no generator")

        bias_rows, bias_ids, bias_values, block_rows, block_ids = [], [], [], [], []
        for i, p in enumerate(params):
            for token_id, value in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(token_id)
                bias_values.append(value)
            if len(output_token_ids[i]) < p.min_tokens:
                blocked = sorted(set(eos_token_ids) | set(p.stop_token_ids))
                block_rows += [i] * len(blocked)
                block_ids += blocked
        if any(not 0 <= t < vocab_size for t in bias_ids + block_ids):
            raise ValueError(f"logit_bias / EOS / stop_token_ids outside [0, {vocab_size})")
        logit_bias = min_tokens_block = None
        if bias_rows:
            logit_bias = SparseLogitUpdate(
                tensor(bias_rows, torch.int64), tensor(bias_ids, torch.int64), tensor(bias_values, torch.float32)
            )
        if block_rows:
            min_tokens_block = SparseLogitUpdate(tensor(block_rows, torch.int64), tensor(block_ids, torch.int64), None)

        penalty_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        penalties = None
        if penalty_rows:
            column = lambda values: tensor([[v] for v in values], torch.float32)
            rows_params = [params[i] for i in penalty_rows]
            use_prompt = any(p.repetition_penalty != 1.0 for p in rows_params)
            penalties = PenaltyTensors(
                rows=None if len(penalty_rows) == num_rows else tensor(penalty_rows, torch.int64),
                repetition=column(p.repetition_penalty for p in rows_params),
                frequency=column(p.frequency_penalty for p in rows_params),
                presence=column(p.presence_penalty for p in rows_params),
                prompt_token_ids=tensor(_padded([prompt_token_ids[i] for i in penalty_rows], vocab_size), torch.int64)
                if use_prompt
                else None,
                output_token_ids=tensor(_padded([output_token_ids[i] for i in penalty_rows], vocab_size), torch.int64),
            )

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=seeded,
            logit_bias=logit_bias,
            min_tokens_block=min_tokens_block,
            penalties=penalties,
            max_num_logprobs=max(requested) if requested else None,
        )


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, K+1] int64: column 0 the sampled token, then the top K
    logprobs: torch.Tensor  # [B, K+1] float32, from the raw logits
    ranks: torch.Tensor  # [B] int64, rank of the sampled token (1 = the most likely)

    def to_host(self) -> LogprobsTensors:
        """A copy on the host, in flight until the step's event fires."""
        return LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in (self.token_ids, self.logprobs, self.ranks)))


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64, on the device
    logprobs: LogprobsTensors | None  # only when some row asked for logprobs


class Sampler(torch.nn.Module):
    """Samples one token per row. Never reads a device value on the host, never modifies ``logits``."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match the metadata "
                f"({metadata.num_rows}, {metadata.vocab_size})"
            )
        if plain_greedy(metadata):
            # NOTE: the argmax of the logits in their own dtype: bf16 or fp16 to float32 is exact, so the argmax (ties
            # included) is float32's, without a cast of the whole vocabulary each step (a kernel at batch 1)
            return SamplerOutput(row_argmax(logits), None)
        logits = logits.to(torch.float32)
        # Logprobs describe the model's own distribution, before any request's processing (vLLM V1).
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        sampled = sample(process_logits(logits, metadata), metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs))


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Logit bias, min_tokens and penalties: everything that can change the argmax. Returns a new
    float32 tensor when anything applies, ``logits`` itself otherwise."""
    if not needs_processing(metadata):
        return logits
    logits = logits.to(torch.float32, copy=True)
    if (bias := metadata.logit_bias) is not None:
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if (block := metadata.min_tokens_block) is not None:
        logits[block.rows, block.token_ids] = float("-inf")
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    return logits


def plain_greedy(metadata: SamplingMetadata) -> bool:
    """Whether the step's tokens are the argmax of the raw logits: every row greedy, no logprobs, no processing."""
    return metadata.all_greedy and metadata.max_num_logprobs is None and not needs_processing(metadata)


def needs_processing(metadata: SamplingMetadata) -> bool:
    return metadata.logit_bias is not None or metadata.min_tokens_block is not None or metadata.penalties is not None


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Repetition (tokens in prompt or output: positive logits divided, negative multiplied), then
    frequency (minus penalty x count in output) and presence (minus penalty if in output)."""
    rows = penalties.rows
    selected = logits if rows is None else logits.index_select(0, rows)
    num_rows, vocab = selected.shape
    out_ids = penalties.output_token_ids
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=logits.device)
    counts = counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))[:, :vocab]
    in_output = counts > 0
    if penalties.prompt_token_ids is not None:
        in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        in_prompt = in_prompt.scatter_(1, penalties.prompt_token_ids, True)[:, :vocab]
        scale = torch.where(in_prompt | in_output, penalties.repetition, 1.0)
        selected = torch.where(selected > 0, selected / scale, selected * scale)
    selected = selected - penalties.frequency * counts - penalties.presence * in_output
    return selected if rows is None else logits.index_copy(0, rows, selected)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a ``[B, V]`` tensor. NOTE: torch's arg-reductions give each row one thread block
    on the GPU, so at a small batch a 128k vocabulary is one block's work; up to `argmax.MAX_ROWS` rows, Kiln's
    kernel spreads each row over many programs, in one launch."""
    if x.device.type != "cuda" or x.shape[0] > argmax.MAX_ROWS or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    return argmax.argmax(x)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Processed logits -> ``[B]`` int64 token ids: argmax on greedy rows, a draw on the others."""
    greedy = None if metadata.all_random else row_argmax(logits)
    if metadata.all_greedy:
        return greedy
    sampled = exponential_race(sampling_probs(logits, metadata), metadata.generators)
    return sampled if greedy is None else torch.where(metadata.greedy_mask, greedy, sampled)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The renormalised distribution random rows draw from (temperature, min-p, top-k, top-p).
    Rows of greedy requests hold a meaningless distribution."""
    logits = logits / metadata.temperature
    if metadata.min_p is not None:
        probs = logits.softmax(dim=-1)
        logits.masked_fill_(probs < metadata.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
    return logits.softmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Sets to -inf the tokens outside each row's top-k, then outside the smallest set whose
    (renormalised) mass reaches top_p; the most likely token always stays. Ties at the cut stay."""
    vocab = logits.shape[-1]
    if top_p is None:
        # Top-k alone needs only the k-th largest value: a partial topk, not a sort of the vocabulary.
        kth = logits.topk(max_top_k, dim=-1).values.gather(1, top_k.clamp(max=max_top_k).unsqueeze(1) - 1)
        kth.masked_fill_((top_k >= vocab).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # cumsum[i] counts token i and all below it, so 1 - cumsum[i] is the mass strictly above it:
    # drop the token when that mass alone reaches top_p.
    drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draws token i with probability p_i as argmax(p / q), q ~ Exp(1) i.i.d. (the smallest
    q_i / p_i wins a race of exponential clocks). Unlike ``torch.multinomial`` it needs no sync.

    A seeded row draws its whole ``[V]`` noise from its own generator, so its token depends only on
    its probabilities and that generator's state, never on the rest of the batch."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # NOTE: a zero draw would turn a banned token's 0/0 into NaN, which argmax picks.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return row_argmax(probs.div(noise))


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the top ``num_logprobs`` of each row."""
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs >= sampled_logprobs).sum(dim=-1)
    token_ids, values = sampled.unsqueeze(1), sampled_logprobs
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids, values = torch.cat([token_ids, top_ids], dim=1), torch.cat([values, top_values], dim=1)
    return LogprobsTensors(token_ids, values, ranks)


def _padded(rows: list[Sequence[int]], pad: int) -> np.ndarray:
    # At least one column, so an all-empty batch still scatters (into the pad column only).
    out = np.full((len(rows), max(1, max(len(r) for r in rows))), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def to_device(data: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    cpu = torch.as_tensor(data, dtype=dtype)
    if device.type == "cuda":
        # From pinned memory the copy is asynchronous, so building metadata never waits on the GPU.
        return cpu.pin_memory().to(device, non_blocking=True)
    return cpu.to(device)
