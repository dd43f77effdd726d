"""N-gram drafts looked up on the device (`ngram_gpu`; `ngram` on a CUDA device): async scheduling stays on (each step
scheduled before the last one's tokens are seen), every lookup's drafts are the brute-force lookup's over the text it
ended, fillers are verified but not counted, and greedy tokens and logprobs equal the engine's without drafts, with
chunked prefill, compiled, preemption, prefix hits, a stop token, an abort and two ranks."""

from __future__ import annotations

import gc
import weakref

import pytest
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams
from kiln.engine.spec_decode.ngram_device import DeviceNgramProposer

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


def ngram_gpu(k: int, min_n: int = 1, max_n: int = 3) -> dict:
    return {"method": "ngram_gpu", "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_max": max_n}


class Spy:
    """Records each lookup's (request, text length, real drafts) and whether each step was scheduled while the one
    before it was in flight (the tokens it sampled not yet seen by the host)."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        self.proposer: DeviceNgramProposer = engine.runner.drafter
        assert isinstance(self.proposer, DeviceNgramProposer) and engine.scheduler.drafter is self.proposer
        self.lookups: list[tuple[tuple[int, ...], int, list[int]]] = []  # (by prompt)
        self.overlapped, self.scheduled_drafts = [], 0
        propose, schedule, scheduler = self.proposer.propose, engine.scheduler.schedule, engine.scheduler

        def spy_propose(batch, sample_rows, step, shift):
            propose(batch, sample_rows, step, shift)
            if self.proposer.drafts is not None:  # (a sync: the CPU's steps are done when launched anyway)
                lengths = self.proposer.lengths.tolist()
                for request, drafts in zip(batch.requests, self.proposer.proposals(batch)):
                    row = self.proposer.draft_rows.get(request.request_id)
                    if row is not None:
                        self.lookups.append((tuple(request.prompt_token_ids), lengths[row], drafts))

        def spy_schedule():
            self.overlapped.append(any(r.num_output_placeholders for r in scheduler.running))
            output = schedule()
            self.scheduled_drafts += sum(map(len, output.spec_token_ids))
            return output

        self.proposer.propose, scheduler.schedule = spy_propose, spy_schedule

    def assert_lookups_as_defined(self, texts: dict[tuple, list[int]], k: int, min_n: int, max_n: int) -> None:
        assert self.lookups
        for prompt, length, drafts in self.lookups:
            text = texts[prompt]
            assert length <= len(text)
            assert drafts == brute_force_lookup(text[:length], k, min_n, max_n, k), (prompt, length)


def texts_of(outputs, prompts=PROMPTS) -> dict[tuple, list[int]]:
    return {tuple(p): [*p, *o.outputs[0].token_ids] for p, o in zip(prompts, outputs)}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_device_lookups_keep_async_scheduling_and_the_tokens(tiny_llama_dir, k):
    """A model made to repeat its input token (bench_spec's make_greedy_decisive), so that drafts are kept, over
    texts with earlier repeats; the tokens those of the same model without drafts. (The random model's runs below
    reject them.)"""
    from bench_spec import make_greedy_decisive  # noqa: PLC0415

    prompts = [[5, 17, 33, 5, 17], [7, 7, 7], [9, 8, 7, 9, 8, 6, 9, 8], [300, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256)
    make_greedy_decisive(plain)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=ngram_gpu(k))
    make_greedy_decisive(llm)
    assert llm.engine.scheduler.optimistic
    spy = Spy(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    spy.assert_lookups_as_defined(texts_of(outputs, prompts), k, 1, 3)
    assert sum(spy.overlapped) > len(spy.overlapped) // 2  # steps scheduled ahead of their predecessors' tokens
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.num_accepted_tokens <= scheduler.num_draft_tokens <= spy.scheduled_drafts
    if k > 1:  # (a match next to the text's end has fewer real drafts than k: fillers follow, kept and not counted)
        assert scheduler.num_draft_tokens < spy.scheduled_drafts
    assert_blocks_back(llm)


def test_fillers_are_verified_but_not_counted(tiny_llama_dir, baseline):
    """prompt_lookup_min 6: these texts repeat no 6-gram (checked), so every lookup finds nothing; the steps verify
    k fillers all the same (the host scheduled them before the lookup ran), and the metrics count no draft."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=ngram_gpu(3, 6, 6))
    spy = Spy(llm)
    prompts = [p for p in PROMPTS if p != [7, 7, 7]]  # (7, 7, 7 and its continuation could repeat)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_as_baseline(outputs, baseline, prompts)
    spy.assert_lookups_as_defined(texts_of(outputs, prompts), 3, 6, 6)
    assert all(drafts == [] for _, _, drafts in spy.lookups)
    scheduler = llm.engine.scheduler
    assert spy.scheduled_drafts > 0
    assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens == scheduler.num_spec_steps == 0


def test_no_lookups_past_disable_by_batch_size(tiny_llama_dir, baseline):
    """disable_by_batch_size 3: while four requests run, each step's tokens still reach the device's texts but nothing
    is looked up (no drafts, no lookup's work); with one left its lookups resume over the whole text, as defined, and
    its tokens are those without drafts."""
    spec = {**ngram_gpu(3), "disable_by_batch_size": 3}
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=spec)
    spy = Spy(llm)
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), list(prompt), GREEDY)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}

    def step() -> None:
        for output in engine.step().outputs:
            tokens[output.request_id] += output.new_token_ids

    for _ in range(5):
        step()
    assert not spy.lookups and spy.scheduled_drafts == 0 and len(scheduler.running) == 4
    engine.abort_requests(["0", "1", "2"])
    while engine.has_unfinished_requests():
        step()
    assert spy.lookups and scheduler.num_draft_tokens > 0
    assert tokens["3"] == baseline[tuple(PROMPTS[3])].token_ids
    spy.assert_lookups_as_defined({tuple(PROMPTS[3]): [*PROMPTS[3], *tokens["3"]]}, 3, 1, 3)


def test_a_closed_engine_lets_its_weights_go(tiny_llama_dir):
    """Closed, the engine gives its weights back though the LLM is still referenced (the device drafter holds the
    runner, and the scheduler the drafter)."""
    spec = {"method": "ngram_gpu", "num_speculative_tokens": 2}
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=64, speculative_config=spec)
    llm.generate([[1, 2, 3, 1, 2]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    weight = weakref.ref(llm.engine.executor.model.model.embed_tokens.weight)
    llm.close()
    gc.collect()
    assert weight() is None


def test_texts_shorter_than_the_longest_suffix(tiny_llama_dir):
    """prompt_lookup_max 4 (the default) over one-token prompts, alone (the lookup's window then narrower than the
    suffix) and together: the lookups as defined, the tokens those without drafts."""
    prompts = [[7], [1], [3, 4, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram_gpu", "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=64, speculative_config=spec)
    spy = Spy(llm)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in together] == want
    spy.assert_lookups_as_defined(texts_of(together, prompts), 3, 1, 4)
    assert_blocks_back(llm)


def test_device_lookups_chunked_compiled_against_hf(tiny_llama_dir, baseline, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).float().eval()
    kwargs = dict(max_model_len=256, max_num_batched_tokens=12, compile_cache_dir=str(tmp_path))
    llm = LLM(str(tiny_llama_dir), speculative_config=ngram_gpu(3), **kwargs)
    spy = Spy(llm)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_as_baseline(outputs, baseline)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 1e-4)
    spy.assert_lookups_as_defined(texts_of(outputs), 3, 1, 3)
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert_blocks_back(llm)


def test_device_lookups_through_preemption_prefix_hits_a_stop_and_an_abort(tiny_llama_dir, baseline):
    kwargs = dict(max_model_len=64, num_kv_blocks=17, block_size=4, speculative_config=ngram_gpu(4))
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, **kwargs)
    spy = Spy(llm)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_as_baseline(outputs, baseline)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_as_baseline(again, baseline)
    assert any(o.num_cached_tokens > 0 for o in again)
    spy.assert_lookups_as_defined(texts_of(outputs), 4, 1, 3)
    want = baseline[tuple(PROMPTS[0])].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[want[9]], ignore_eos=True)
    stopped = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == want[: want.index(want[9]) + 1] and stopped.finish_reason == "stop"
    abort_midway(llm)


def test_device_lookups_over_two_ranks(tiny_llama_dir, baseline):
    kwargs = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=64, speculative_config=ngram_gpu(3))
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kwargs) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_draft_tokens > 0
    assert_same_as_baseline(outputs, baseline)


def test_ngram_on_the_cpu_stays_on_the_host(tiny_llama_dir):
    """`ngram` looks up on the device only on a GPU (where async scheduling pays); the CPU keeps the host's."""
    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=64, speculative_config=ngram_gpu(2)) as llm:
        assert isinstance(llm.engine.scheduler.drafter, DeviceNgramProposer)
    spec = {**ngram_gpu(2), "method": "ngram"}
    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=64, speculative_config=spec) as llm:
        assert not isinstance(llm.engine.scheduler.drafter, DeviceNgramProposer)
        assert not llm.engine.scheduler.optimistic


@pytest.mark.gpu
def test_ngram_on_the_gpu_looks_up_on_the_device(tiny_llama_dir, tmp_path):
    """On a GPU `ngram` itself looks up on the device, with async scheduling on and full CUDA graphs for the steps
    whose every request verifies k drafts: float32 tokens those of the same engine without drafts."""
    kwargs = dict(dtype="float32", max_model_len=256, compile_cache_dir=str(tmp_path), device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(tiny_llama_dir), speculative_config={**ngram_gpu(3), "method": "ngram"}, **kwargs) as llm:
        assert llm.engine.scheduler.optimistic
        spy = Spy(llm)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.scheduler.num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs] == want
    spy.assert_lookups_as_defined(texts_of(outputs), 3, 1, 3)
