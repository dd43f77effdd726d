"""EAGLE-3 drafts on the tiny Llama: a tiny random draft written in both published layouts proposes what a float64
reference of the architecture proposes from transformers' own hidden states; greedy output with its drafts equals
the engine's without, eager and compiled (the target's three layers' states saved out of the compiled graph), with
chunked prefill; at disable_by_batch_size requests or more no chain runs; a draft that does not fit its target is one
error."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams
from kiln.engine.spec_decode.eagle_proposer import EagleProposer

from helpers.eagle3 import make_eagle3_dir, record_drafts, reference_drafts
from helpers.gpt_oss import hf_gpt_oss, make_tiny_gpt_oss_dir

PROMPTS = [[5, 17, 33, 2, 101, 45, 9, 5, 17, 33], [7, 7, 7], list(range(20, 61)), [300, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
NUM_BLOCKS = 7  # (of 16 tokens: the four requests and their drafts' lookahead do not fit at once)


def eagle(draft_dir, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_first_drafts_equal_the_reference(tiny_llama_dir, tmp_path, layout, monkeypatch):
    draft_dir = make_eagle3_dir(tmp_path / layout, layout, norm_before_residual=layout == "speculators")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    proposals = []
    propose = EagleProposer.propose

    def recording(self, batch, *args):
        propose(self, batch, *args)
        proposals.append({r.request_id: d for r, d in zip(batch.requests, self.proposals(batch))})

    monkeypatch.setattr(EagleProposer, "propose", recording)
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256, speculative_config=eagle(draft_dir, 3))
    prompt = PROMPTS[2]
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0].outputs[0]
    first = next(p for p in proposals if any(p.values()))
    (drafts,) = first.values()
    assert drafts == reference_drafts(draft_dir, hf, prompt, output.token_ids[0], 3)


@pytest.mark.parametrize(
    ("layout", "compiled", "k"), [("eagle", False, 1), ("speculators", False, 3), ("eagle", True, 2)]
)
def test_greedy_with_eagle_drafts_equals_without(tiny_llama_dir, tmp_path, layout, compiled, k):
    draft_dir = make_eagle3_dir(tmp_path / layout, layout)
    kwargs = dict(max_model_len=256, max_num_batched_tokens=12, enforce_eager=not compiled)
    kwargs["compile_cache_dir"] = str(tmp_path / "cache")
    plain = LLM(str(tiny_llama_dir), **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, k), **kwargs)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    scheduler = llm.engine.scheduler
    assert scheduler.num_draft_tokens > 0
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    if compiled:
        assert llm.engine.startup_stats["compute_pieces"] == 2 + 1 + 3  # split at 2 attentions and 3 saved states


def test_no_chain_past_disable_by_batch_size(tiny_llama_dir, tmp_path, monkeypatch):
    """disable_by_batch_size 3: a step after which three or more requests run (a long prompt's chunks among them)
    runs the draft's first pass but no chain and leaves no drafts; with fewer the chain runs and its drafts are
    verified; the drafts made once the batch has shrunk are the float64 reference's (the first passes kept the
    draft's KV whole); outputs equal those without."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 4, 12, 12)]
    kwargs = dict(max_model_len=128, enforce_eager=True, max_num_batched_tokens=12)
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    k, spec = 3, {**eagle(draft_dir, 3), "disable_by_batch_size": 3}
    with LLM(str(tiny_llama_dir), speculative_config=spec, **kwargs) as llm:
        drafter, scheduler = llm.engine.runner.drafter, llm.engine.scheduler
        recorded = record_drafts(monkeypatch)
        steps = []  # (running, requests sampled, passes: the first and the chain's, chain passes, requests with drafts)
        propose, first_pass, chain_pass = drafter.propose, drafter._pass, drafter._chain_pass

        def counting(index, run):
            def counted(*args):
                steps[-1][index] += 1
                return run(*args)

            return counted

        def recording(batch, sample_rows, *args):
            steps.append([len(scheduler.running), len(sample_rows), 0, 0, 0])
            propose(batch, sample_rows, *args)
            steps[-1][4] = len(drafter.draft_rows)

        drafter.propose, drafter._pass, drafter._chain_pass = (
            recording,
            counting(2, first_pass),
            counting(3, chain_pass),
        )
        results = llm.generate(PROMPTS, params, use_tqdm=False)
        assert scheduler.num_draft_tokens > 0
    outputs = [o.outputs[0].token_ids for o in results]
    assert outputs == plain
    large = [s for s in steps if s[0] >= 3]
    small = [s for s in steps if s[0] < 3 and s[1] > 0]
    assert any(sampled < 3 for _, sampled, *_ in large)  # (steps the sampled count alone would have drafted after)
    assert len(large) >= 3 and all(passes == 1 and chain == left == 0 for _, _, passes, chain, left in large)
    assert small and all(chain == k - 1 and left == sampled for _, sampled, _, chain, left in small)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    index = {o.request_id: i for i, o in enumerate(results)}
    later = [(index[rid.split("-")[0]], done, d) for rid, done, d in recorded if done > 4]  # (two finished at 4)
    assert later
    for i, done, d in later:
        assert d == reference_drafts(draft_dir, hf, PROMPTS[i] + outputs[i][: done - 1], outputs[i][done - 1], k)


def test_a_draft_that_does_not_fit_is_one_error(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="needs the draft's 'model'"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="is not an EAGLE-3 draft"):
        LLM(str(tiny_llama_dir), enforce_eager=True, speculative_config=eagle(tiny_llama_dir))


def test_a_draft_without_room_on_the_gpu_is_one_error(tiny_llama_dir, tmp_path, monkeypatch):
    """Out of memory while the draft loads beside the target's weights: one line naming the draft, not a raw OOM."""
    from kiln.engine.spec_decode import draft_model

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(draft_model, "load_eagle3", out_of_memory)
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    with pytest.raises(ValueError, match="^out of GPU memory while loading the eagle3 draft model on cpu beside the "):
        LLM(str(tiny_llama_dir), enforce_eager=True, speculative_config=eagle(draft_dir, 2))


def test_the_drafts_kv_cache_comes_out_of_the_kv_budget(tiny_llama_dir, tmp_path):
    """`kv_cache_memory_bytes` holds the draft's own KV cache beside the target's (the draft is loaded before the
    cache is sized): the whole blocks of both that fit, no more."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    budget = 1 << 20
    kwargs = dict(enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=budget)
    with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, 2), **kwargs) as llm:
        engine = llm.engine
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in engine.executor.kv_caches}
        blocks, draft_bytes = engine.num_kv_blocks, engine.scheduler.drafter.kv_cache.nbytes
        block_bytes = (sum(storages.values()) + draft_bytes) // blocks
        assert blocks * block_bytes <= budget < (blocks + 1) * block_bytes
    with LLM(str(tiny_llama_dir), **kwargs) as plain:
        assert plain.engine.num_kv_blocks > blocks  # (the target's blocks alone fill the budget)


def test_eagle_drafts_with_tp2(tiny_llama_dir, tmp_path):
    """Two ranks over gloo: the draft runs on rank 0 over the target's states (whole on every rank)."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    kwargs = dict(max_model_len=256, num_kv_blocks=64, enforce_eager=True)
    plain = LLM(str(tiny_llama_dir), **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, speculative_config=eagle(draft_dir, 2), **kwargs) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_draft_tokens > 0
        assert llm.engine.scheduler.optimistic  # (rank 0 moves the positions back, then broadcasts the inputs)
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_eagle_drafts_for_gpt_oss(tmp_path, monkeypatch):
    """gpt-oss, its layers sliding (a window of 128) and full in turn, keeps two KV groups; the draft attends the whole
    context over the full group's blocks. With few blocks (the sliding group's freed ones soon taken again), its drafts
    equal the float64 reference's from transformers' own states after the prefill and after decode steps past the
    window, and greedy output with them equals the output without. Scheduled ahead of each step's verdict (async
    scheduling, the sliding window freeing no block a rejected draft would leave inside it), every draft is the
    synchronous run's."""
    target = make_tiny_gpt_oss_dir(tmp_path / "gpt-oss", False)
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    kwargs = dict(enforce_eager=True, max_model_len=208, max_num_batched_tokens=64, num_kv_blocks=28)
    prompt = list(range(20, 180))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    plain = LLM(str(target), **kwargs).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    runs = {}
    for ahead in (False, True):
        proposals = record_drafts(monkeypatch)
        with LLM(str(target), speculative_config=eagle(draft_dir, 3), async_scheduling=ahead, **kwargs) as llm:
            proposer, runner = llm.engine.scheduler.drafter, llm.engine.runner
            assert runner.windows == (128, 0, 128, 0) and runner.layer_groups[0] != runner.layer_groups[1]
            assert proposer.layer_groups == (runner.layer_groups[1],)  # (the full layers' group)
            assert llm.engine.scheduler.optimistic == ahead
            got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        output = got.token_ids
        assert output == plain.token_ids
        for a, b in zip(got.logprobs, plain.logprobs, strict=True):  # (a key a window lost would show here)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        runs[ahead] = [p[1:] for p in proposals]
        monkeypatch.undo()
    assert runs[True] == runs[False]
    hf = hf_gpt_oss(target)
    # (after the prefill; the last ones, past 128 + 32 tokens of context)
    checked = [p[1:] for p in (proposals[0], *proposals[-3:])]
    for done, drafts in checked:
        assert drafts == reference_drafts(draft_dir, hf, prompt + output[: done - 1], output[done - 1], 3), done
    assert proposals[-1][1] > 24


def test_a_request_that_sat_steps_out_verifies_no_stale_drafts(tiny_llama_dir, tmp_path):
    """Three requests prefilled together, then a budget of two requests' verification steps: the third waits while
    the others decode (the drafter's drafts on the device are theirs by then); when it runs again it verifies none
    of its old ones, and every output is the output without drafts."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    prompts, params = [[20 + i, 21] for i in range(3)], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(max_model_len=128, max_num_batched_tokens=8, enforce_eager=True)
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    sat_out = []
    with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, 3), **kwargs) as llm:
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def recording():
            holders = set(scheduler.drafter.draft_rows)  # (the requests the last step's chain drafted for)
            batch = schedule()
            left_out = [r for r in scheduler.running if r not in batch.requests]
            sat_out.extend(r.request_id for r in left_out if r.request_id in holders)
            return batch

        scheduler.schedule = recording
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert sat_out
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_steps_scheduled_ahead_of_their_drafts_verdict(tiny_llama_dir, tmp_path, monkeypatch, compiled):
    """Async scheduling while drafting: a request whose step in flight verifies drafts is scheduled as if that step
    kept them all, and the device moves its positions, sequence length and slots back by the ones it did not keep.
    Every draft, step by step, equals a synchronous run's (which waits for the verdict), output equals the output
    without drafts, with chunked prefill, a budget that leaves requests out and preemptions (few KV blocks); every KV
    block is free after."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    kwargs = dict(max_model_len=96, max_num_batched_tokens=12, enforce_eager=not compiled, num_kv_blocks=NUM_BLOCKS)
    kwargs["compile_cache_dir"] = str(tmp_path / "cache")
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    drafts, shifted = {}, {}
    for ahead in (True, False):
        recorded = record_drafts(monkeypatch)
        with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, 3), async_scheduling=ahead, **kwargs) as llm:
            scheduler = llm.engine.scheduler
            assert scheduler.optimistic == ahead
            schedule = scheduler.schedule
            shifted[ahead] = 0

            def counting(schedule=schedule, ahead=ahead):
                batch = schedule()
                shifted[ahead] += len(batch.shifted_rows)
                return batch

            scheduler.schedule = counting
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            manager = llm.engine.kv_cache_manager
            assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
            assert scheduler.num_preemptions > 0
        for got, want in zip(outputs, plain, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
        drafts[ahead] = {(rid.split("-")[0], done): d for rid, done, d in recorded}
        monkeypatch.undo()
    assert shifted[True] > 0 and shifted[False] == 0
    assert drafts[True] == drafts[False]


def test_a_failed_step_scheduled_ahead_is_retried_request_by_request(tiny_llama_dir, tmp_path):
    """The server's isolation mode: a step scheduled ahead of its drafts' verdict that raises is retried one request at
    a time once the step before it is in, each row's computed count as that verdict corrected it; every output equals
    the output without drafts, and every KV block is free after."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    prompts, params = PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(max_model_len=128, enforce_eager=True)
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, 3), **kwargs) as llm:
        engine, failed = llm.engine, []
        launch = engine.runner.launch

        def failing(batch):
            if batch.shifted_rows and len(batch.requests) > 1 and not failed:
                failed.append(len(batch.requests))
                raise RuntimeError("a step that fails")
            return launch(batch)

        engine.runner.launch = failing
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            out = engine.step(isolate_failures=True)
            assert not out.failed
            for o in out.outputs:
                tokens[o.request_id] += o.new_token_ids
        manager = engine.kv_cache_manager
        assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    assert failed == [3]
    assert [tokens[str(i)] for i in range(len(prompts))] == plain


def test_a_request_preempting_itself_with_drafts_in_flight(tiny_llama_dir, tmp_path):
    """Blocks of 4 tokens, few of them: the newest request, its drafts in flight, finds no room and preempts itself
    (scheduled ahead of the verdict, it is no row of the step); outputs equal those without drafts, blocks all free."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    prompts = [list(range(20 + i, 20 + i + n)) for i, n in enumerate((10, 12, 5))]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kwargs = dict(max_model_len=48, enforce_eager=True, block_size=4, num_kv_blocks=14)
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, 3), **kwargs) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.optimistic and llm.engine.scheduler.num_preemptions > 0
        manager = llm.engine.kv_cache_manager
        assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    assert outputs == plain


@pytest.mark.parametrize("ahead", [True, False], ids=["async", "sync"])
def test_drafting_up_to_max_model_len(tiny_llama_dir, tmp_path, ahead):
    """A request that runs until max_model_len: its last steps' chains would pass it (their positions are held at its
    last one), and it finishes by length with the tokens of a run without drafts."""
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)
    kwargs = dict(max_model_len=64, enforce_eager=True, async_scheduling=ahead)
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        plain = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, 3), **kwargs) as llm:
        got = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    assert len(got.token_ids) == 64 - len(PROMPTS[2]) and got.finish_reason == "length"
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("ahead", [True, False], ids=["async", "sync"])
def test_chains_start_where_the_kept_drafts_end(tiny_llama_dir, tmp_path, monkeypatch, ahead):
    """A random draft's tokens are all but never kept, so here the verdict is forced (as if the model agreed with some,
    in a pattern that moves each step) to keep 0 to k of them a step. Scheduled ahead of each verdict, each step's
    drafts equal the float64 reference's from transformers' own states over the tokens kept so far: the chain starts
    where the kept drafts end, on the device."""
    from kiln.engine.worker import draft_verification  # noqa: PLC0415

    real_verify, calls = draft_verification.verify, []

    def agreeing(logits, drafts, sampling, argmax=None):
        _, token = real_verify(logits, drafts, sampling, argmax)
        calls.append(None)
        rows = torch.arange(len(drafts), device=drafts.device)
        return (drafts >= 0) & ((rows + len(calls)) % 4 != 0), token

    monkeypatch.setattr(draft_verification, "verify", agreeing)
    draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
    proposals = record_drafts(monkeypatch)
    prompt, k = PROMPTS[0], 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(enforce_eager=True, max_model_len=128, async_scheduling=ahead)
    with LLM(str(tiny_llama_dir), speculative_config=eagle(draft_dir, k), **kwargs) as llm:
        output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        scheduler = llm.engine.scheduler
        assert scheduler.optimistic == ahead and 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    checked = {done: drafts for _, done, drafts in proposals if done < len(output)}
    assert len(checked) > 4
    for done, drafts in checked.items():
        assert drafts == reference_drafts(draft_dir, hf, prompt + output[: done - 1], output[done - 1], k), done
