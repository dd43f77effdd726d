"""Speculative decoding's tests share these: the prompts, a greedy run's parameters, what a run with drafts must equal,
and prompt lookup as its definition reads."""

from __future__ import annotations

import math

from kiln.engine import LLM, SamplingParams
from kiln.engine.spec_decode.ngram import MAX_LOOKBACK

PROMPTS = [[5, 17, 33, 2, 101, 45, 9, 5, 17, 33], [7, 7, 7], list(range(20, 61)), [300, 12]]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def assert_same_as_baseline(outputs, baseline, prompts=PROMPTS) -> None:
    """Tokens and logprobs those of the run without drafts (`baseline`: its outputs by prompt)."""
    for prompt, output in zip(prompts, outputs, strict=True):
        got, want = output.outputs[0], baseline[tuple(prompt)]
        assert got.token_ids == want.token_ids
        for lp_got, lp_want in zip(got.logprobs, want.logprobs, strict=True):
            assert lp_got.keys() == lp_want.keys()
            assert all(math.isclose(lp_got[t].logprob, lp_want[t].logprob, abs_tol=1e-5) for t in lp_got)


def assert_blocks_back(llm: LLM) -> None:
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks


def abort_midway(llm: LLM) -> None:
    """A request aborted after four steps (its drafts in flight), the engine drained, every block back."""
    engine = llm.engine
    engine.add_request("a", list(PROMPTS[2]), GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort_requests(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_blocks_back(llm)


def brute_force_lookup(token_ids: list[int], k: int, min_n: int, max_n: int, limit: int) -> list[int]:
    """Prompt lookup as its definition reads: the longest suffix first, its latest earlier occurrence."""
    tokens = token_ids[-MAX_LOOKBACK:]
    if min(k, limit) < 1 or len(token_ids) <= min_n:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + min(k, limit)]
    return []
