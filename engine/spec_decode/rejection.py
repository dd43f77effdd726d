"""Verifying drafts on the device: which draft tokens the target model keeps, and the token after them.

Row i of a request's 1 + k logit rows scores the token after its i-th input; its draft is the (i + 1)-th proposed
token (none on the last row). Each row yields `accepted` (does the target keep the draft) and `token` (what the
target says there when it does not: a draw from its distribution with the draft taken out, renormalised):

    greedy:  accepted = argmax == draft,           token = argmax
    random:  accepted = u < p(draft), u ~ U(0, 1), token ~ p without the draft

The host keeps a request's drafts up to its first row not accepted and takes that row's token. With a draft
distribution q that is one token (n-gram), this is the rejection sampler of speculative sampling (Leviathan et al.,
2023): accept with probability min(1, p/q) = p(draft), else draw from norm(max(p - q, 0)); the tokens are
distributed exactly as the target's own.
"""

from __future__ import annotations

import torch

from kiln.engine.worker.sampler import (
    SamplingMetadata,
    exponential_race,
    needs_processing,
    process_logits,
    row_argmax,
    sampling_probs,
)


def verify(
    logits: torch.Tensor, drafts: torch.Tensor, metadata: SamplingMetadata, argmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [R] bool, token [R] int64) for logit rows [R, V] and their drafts [R] (-1: none). `argmax`: the
    rows' argmax of the raw logits where a full graph computed it, taken as is when greedy needs no processing."""
    if argmax is not None and metadata.all_greedy and not needs_processing(metadata):
        return (drafts >= 0) & (argmax == drafts), argmax
    processed = process_logits(logits.to(torch.float32), metadata)
    greedy = None if metadata.all_random else row_argmax(processed)
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)
    if metadata.all_greedy:
        return has_draft & (greedy == drafts), greedy
    probs = sampling_probs(processed, metadata)
    uniform = torch.rand(probs.shape[0], device=probs.device)
    for row, generator in metadata.generators.items():
        uniform[row] = torch.rand(1, generator=generator, device=probs.device)[0]
    accepted = has_draft & (uniform < probs.gather(1, safe.unsqueeze(1)).squeeze(1))
    residual = probs.scatter(1, safe.unsqueeze(1), torch.where(has_draft, 0.0, probs.gather(1, safe.unsqueeze(1))))
    token = exponential_race(residual, metadata.generators)
    if greedy is not None:
        greedy_accepted = has_draft & (greedy == drafts)
        accepted = torch.where(metadata.greedy_mask, greedy_accepted, accepted)
        token = torch.where(metadata.greedy_mask, greedy, token)
    return accepted, token
