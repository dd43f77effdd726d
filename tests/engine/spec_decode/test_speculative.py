"""Speculative decoding on the CPU: greedy tokens and logprobs equal the engine's without drafts (and Hugging Face's),
for k = 1 to 5, with chunked prefill, preemption, prefix hits, an abort, and EOS, max_tokens or a stop string inside a
draft; the rejection sampler draws exactly the target's distribution (a chi-square test); every KV block comes back.

Random weights rarely repeat themselves, so besides the n-gram drafter these tests use an oracle drafter that proposes
the model's own greedy continuation (known from a run without drafts), every third proposal corrupted: drafts are then
kept in full, in part and not at all, each path of the verification.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.ngram import MAX_LOOKBACK, NgramProposer
from kiln.engine.spec_decode.rejection import verify
from kiln.engine.worker.sampler import SamplingMetadata

from helpers.models import assert_greedy_matches_hf
from helpers.speculative import (
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    abort_midway,
    assert_blocks_back,
    assert_same_as_baseline,
    brute_force_lookup,
)


class OracleProposer:
    """Proposes the continuation a run without drafts produced (by prompt), every third proposal's last token
    corrupted."""

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.k, self.continuations, self.vocab_size, self.calls = k, continuations, vocab_size, 0

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        limit = min(self.k, limit)
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt and len(token_ids) >= len(prompt):
                done = len(token_ids) - len(prompt)
                draft = continuation[done : done + limit]
                self.calls += 1
                if draft and self.calls % 3 == 0:
                    draft[-1] = (draft[-1] + 1) % self.vocab_size
                return draft
        return []


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}


def with_oracle(llm: LLM, baseline, k: int) -> OracleProposer:
    oracle = OracleProposer(k, {p: list(o.token_ids) for p, o in baseline.items()}, llm.engine.model_config.vocab_size)
    llm.engine.scheduler.drafter = oracle
    return oracle


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_drafts_equals_without(tiny_llama_dir, baseline, k):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=ngram(k))
    oracle = with_oracle(llm, baseline, k)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_as_baseline(outputs, baseline)
    scheduler = llm.engine.scheduler
    assert oracle.calls and 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens  # kept in part
    steps = scheduler.num_spec_steps
    assert steps < len(PROMPTS) * MAX_TOKENS  # fewer steps than tokens: drafts were kept
    assert_blocks_back(llm)


def test_ngram_drafts_match_hf_chunked_and_compiled(tiny_llama_dir, baseline, tmp_path):
    """The n-gram drafter itself (compiled, the prefill chunked by a 12-token budget), against HF and the baseline."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    kwargs = dict(max_model_len=256, max_num_batched_tokens=12, compile_cache_dir=str(tmp_path))
    llm = LLM(str(tiny_llama_dir), speculative_config=ngram(3), **kwargs)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_as_baseline(outputs, baseline)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 1e-4)
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert_blocks_back(llm)


def test_preemption_and_prefix_hits_with_drafts(tiny_llama_dir, baseline):
    """Too few blocks for every request and its drafts: some are preempted and recomputed; a second round hits the
    prefix cache. Tokens as without drafts, and every block back."""
    kwargs = dict(max_model_len=64, num_kv_blocks=17, block_size=4, speculative_config=ngram(4))
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, **kwargs)
    with_oracle(llm, baseline, 4)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_as_baseline(outputs, baseline)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_as_baseline(again, baseline)
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_blocks_back(llm)


def test_max_tokens_eos_and_stop_strings_inside_a_draft(tiny_llama_dir, baseline):
    """A limit reached inside a draft ends the request there: max_tokens, an EOS (a stop token id standing for it)
    and a stop string, each where the run without drafts ends."""
    prompt = tuple(PROMPTS[0])
    want = baseline[prompt].token_ids
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=ngram(5))
    with_oracle(llm, baseline, 5)
    short = llm.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0]
    assert short.outputs[0].token_ids == want[:7] and short.outputs[0].finish_reason == "length"
    stop_at = want[9]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at], ignore_eos=True)
    stopped = llm.generate([list(prompt)], params)[0].outputs[0]
    assert stopped.token_ids == want[: want.index(stop_at) + 1] and stopped.finish_reason == "stop"
    text = baseline[prompt].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True)
    by_text = llm.generate([list(prompt)], params)[0].outputs[0]
    plain = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256).generate([list(prompt)], params)
    assert by_text.finish_reason == "stop" and by_text.text == plain[0].outputs[0].text == text[: text.index(stop)]
    assert_blocks_back(llm)


def test_abort_while_drafting(tiny_llama_dir, baseline):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=ngram(3))
    with_oracle(llm, baseline, 3)
    abort_midway(llm)


def test_rejection_sampler_draws_the_targets_distribution():
    """Over a vocabulary of 6 and a draft that is each token in turn, the first token the verification yields (the
    draft if kept, else the row's draw) is distributed as softmax(logits / T) after top-k: chi-square, 20,000 draws."""
    torch.manual_seed(0)
    vocab, draws = 6, 20_000
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5])
    params = SamplingParams(temperature=0.8, top_k=5)
    target = torch.softmax(logits / 0.8, dim=-1)
    target[3] = 0.0  # (top-k 5 drops the smallest)
    target /= target.sum()
    for draft in range(vocab):
        rows = logits.expand(draws, vocab).clone()
        metadata = SamplingMetadata.build(
            [params] * draws, [[0]] * draws, [[]] * draws, [None] * draws, (), vocab, "cpu"
        )
        accepted, token = verify(rows, torch.full((draws,), draft), metadata)
        first = torch.where(accepted, torch.full_like(token, draft), token)
        counts = torch.bincount(first, minlength=vocab).double()
        expected = target.double() * draws
        seen = expected > 0
        assert counts[~seen].sum() == 0
        chi2 = (((counts - expected) ** 2)[seen] / expected[seen]).sum().item()
        assert chi2 < 20.5, (draft, chi2)  # 4 degrees of freedom: p < 0.0005


def test_the_ngram_proposer():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 10) == [9, 1, 2]  # the 3-gram (1, 2, 3) seen before
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # within the limit
    assert proposer.propose([4, 5, 6, 4, 5, 7, 4, 5], 10) == [7, 4, 5]  # the latest earlier (4, 5)
    assert proposer.propose([1, 2, 3, 4], 10) == []  # no suffix occurred before
    assert NgramProposer(3, 2, 3).propose([1, 2, 5, 2], 10) == []  # a 1-gram match is below prompt_lookup_min


def test_the_ngram_proposer_as_its_definition_reads():
    """Random texts of small vocabularies (many matches) grown a few tokens at a time, two of them through one
    proposer in turns (each keeps its own array), one past the lookback, against a brute-force search."""
    rng = random.Random(0)
    for _ in range(40):
        k, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n, vocab = rng.randint(min_n, 5), rng.choice([3, 8, 50])
        proposer = NgramProposer(k, min_n, max_n)
        texts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(2)]
        for step in range(60):
            text, limit = texts[step % 2], rng.randint(0, 6)
            assert proposer.propose(text, limit) == brute_force_lookup(text, k, min_n, max_n, limit)
            text.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
    proposer, text = NgramProposer(3, 1, 3), [rng.randrange(300) for _ in range(MAX_LOOKBACK - 50)]
    for _ in range(8):
        assert proposer.propose(text, 3) == brute_force_lookup(text, 3, 1, 3, 3)
        text.extend(rng.randrange(300) for _ in range(40))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "not JSON"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "not supported yet"),
        ({"method": "guess", "num_speculative_tokens": 2}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ],
)
def test_a_wrong_speculative_config_is_one_error(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_mtp_for_a_model_without_an_mtp_layer_is_one_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="method mtp runs the MTP layer"):
        LLM(str(tiny_llama_dir), enforce_eager=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_served_with_drafts_the_metrics_count_them(tiny_llama_dir):
    """`kiln serve --speculative-config`: a completion of a prompt that repeats itself equals the engine's without
    drafts, and /metrics holds the drafts under Kiln's and vLLM's names."""
    from helpers.server import Server

    prompt = [5, 17, 33, 2, 101, 45, 9] * 6
    plain = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)
    want = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    server = Server(tiny_llama_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        reply = server.client().completions.create(
            model=server.model, prompt=prompt, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text == want.text
        drafted = server.metric("vllm:spec_decode_num_draft_tokens_total")
        assert drafted > 0 and drafted == server.metric("kiln_spec_decode_num_draft_tokens")
        assert server.metric("vllm:spec_decode_num_drafts_total") > 0
        accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total")
        assert 0 <= server.metric("kiln_spec_decode_acceptance_rate") == accepted / drafted <= 1
    finally:
        server.stop()


def test_no_drafts_from_disable_by_batch_size_running_requests(tiny_llama_dir, baseline):
    """disable_by_batch_size 3: four requests running draft nothing, and their steps overlap (asynchronous
    scheduling, as without speculation); one alone drafts, its steps synchronous; the tokens as without drafts."""
    spec = {**ngram(3), "disable_by_batch_size": 3}
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=spec)
    with_oracle(llm, baseline, 3)
    scheduler = llm.engine.scheduler
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), list(prompt), GREEDY)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    schedule, in_flight_at_schedule = scheduler.schedule, []

    def spy():  # whether a step is scheduled while its requests' last tokens are still in flight
        in_flight_at_schedule.append(any(r.num_output_placeholders for r in scheduler.running))
        return schedule()

    scheduler.schedule = spy

    def step() -> None:
        for output in engine.step().outputs:
            tokens[output.request_id] += output.new_token_ids

    for _ in range(4):
        step()
    assert scheduler.num_draft_tokens == 0 and len(scheduler.running) == 4
    assert in_flight_at_schedule[2:] == [True, True]  # (after the prefill and the first decode)
    engine.abort_requests(["0", "1", "2"])
    in_flight_at_schedule.clear()
    while engine.has_unfinished_requests():
        step()
    assert scheduler.num_draft_tokens > 0 and not any(in_flight_at_schedule[1:])
    assert tokens["3"] == baseline[tuple(PROMPTS[3])].token_ids


def test_tp2_with_drafts_equals_without(tiny_llama_dir, baseline):
    """Two ranks over gloo: every rank scores every draft row (the LM head's gather joins them all)."""
    kwargs = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=64, speculative_config=ngram(3))
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kwargs) as llm:
        with_oracle(llm, baseline, 3)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_accepted_tokens > 0
    assert_same_as_baseline(outputs, baseline)


def test_a_step_verifying_k_drafts_of_every_request_plans_a_full_graph(tiny_llama_dir):
    """The graph plan alone (graphs need a GPU: test_gpu_qwen3_5 replays them): a step whose every request verifies
    k drafts replays the full graph of the next captured request count, padded; any other step with drafts a
    piecewise one."""
    from kiln.engine.core.scheduler import SchedulerOutput  # noqa: PLC0415
    from kiln.engine.worker.inputs import GraphPlan  # noqa: PLC0415

    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=ngram(3)) as llm:
        runner = llm.engine.runner
    assert runner.verify_len == 4 and runner.verify_sizes == []  # (no graphs on the CPU)
    # what a GPU runner captures with sizes 1, 2, 4, 8, 16 and max_num_seqs 8
    runner.cudagraph_mode, runner.capture_sizes, runner.largest_full = "full_and_piecewise", [1, 2, 4, 8, 16], 8
    runner.verify_sizes = [1, 2, 4]  # (8 requests of 4 tokens: past the 16 of this runner's inputs)

    def plan(drafts: list[list[int]]) -> GraphPlan:
        num_new = [1 + len(d) for d in drafts]
        return runner.plan(SchedulerOutput([None] * len(drafts), num_new, [[]] * len(drafts), spec_token_ids=drafts))

    assert plan([[1, 2, 3]] * 3) == GraphPlan("full", 16, 4)
    assert plan([[1, 2, 3]]) == GraphPlan("full", 4, 1)
    assert plan([[1, 2, 3], [4, 5]]) == GraphPlan("piecewise", 8, 2)
    assert plan([[1, 2, 3]] * 5) == GraphPlan("none", 20, 5)  # (past the largest size)
    assert plan([[]] * 3) == GraphPlan("full", 4, 4)  # a decode step: the decode graph
