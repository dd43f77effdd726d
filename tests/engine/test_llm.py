"""The offline API: vLLM-shaped outputs, n, logprobs, stop strings, seeds, and bad input."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)


def test_string_and_token_prompts_in_order(llm):
    texts = ["The quick brown fox", "Numbers: 1 2 3"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_text = llm.generate(texts, params, use_tqdm=False)
    by_ids = llm.generate([o.prompt_token_ids for o in by_text], params, use_tqdm=False)
    assert [o.prompt for o in by_text] == texts
    assert by_text[0].prompt_token_ids == llm.tokenizer.encode(texts[0])
    for a, b in zip(by_text, by_ids):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids, skip_special_tokens=True)
        assert a.finished and b.prompt is None
    single = llm.generate([1, 2, 3], params, use_tqdm=False)  # one token-id prompt, not three
    assert len(single) == 1 and single[0].prompt_token_ids == [1, 2, 3]


def test_one_params_per_prompt(llm):
    outs = llm.generate(
        [[1, 2], [3, 4]],
        [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])


def test_n_gives_several_outputs(llm):
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=1), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per child


def test_logprobs_match_reference(llm, tiny_llama_dir):
    """Logprobs of each generated token equal log_softmax of HF's logits at that position (fp32)."""
    prompt = [10, 20, 30, 40]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].double(), dim=-1)
    assert len(out.logprobs) == 4
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert set(entry) == set(top.indices.tolist())
        for token_id, lp in entry.items():
            assert math.isclose(lp.logprob, row[token_id].item(), abs_tol=1e-4)
            assert isinstance(lp.decoded_token, str)
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_stop_string_cuts_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        [[1, 2, 3]],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert not llm.engine.has_unfinished_requests()


def test_seed_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    mixed = llm.generate([[1, 2], [9, 8, 7], [4, 4, 4, 4]], [others, seeded, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_finish_on_eos(tiny_llama_dir):
    """Make the EOS id the greedy choice: generation stops on it with finish_reason 'stop'."""
    probe = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)
    first = probe.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    eos = first[0].outputs[0].token_ids[0]
    out = probe.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[eos]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason == eos


def test_bad_requests_raise_and_leave_engine_clean(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 200], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    free = llm.engine.kv_cache_manager.num_free_blocks
    assert free == llm.engine.num_kv_blocks - 1


def test_dict_params_and_numpy_token_ids(llm):
    """Sampling params as a dict of their fields, token ids as numpy integers: the same as the plain forms."""
    np = pytest.importorskip("numpy")
    plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    ids = list(np.array([5, 6, 7], dtype=np.int64))
    for prompts in ([ids], ids, tuple(ids)):
        (out,) = llm.generate(prompts, {"temperature": 0, "max_tokens": 3, "ignore_eos": True}, use_tqdm=False)
        assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="unknown sampling parameter.*max_token"):
        llm.generate([[1, 2]], {"max_token": 3})
    with pytest.raises(TypeError, match="sampling_params must be"):
        llm.generate([[1, 2]], [3])
    assert not llm.engine.has_unfinished_requests()


def test_n_with_the_largest_seed_wraps_like_the_server(llm):
    """Child j of n draws with seed (seed + j) mod 2**64, the range a torch.Generator takes."""
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    both = llm.generate([[5, 6, 7]], SamplingParams(n=2, seed=2**64 - 1, **params), use_tqdm=False)[0].outputs
    alone = [
        llm.generate([[5, 6, 7]], SamplingParams(seed=s, **params), use_tqdm=False)[0].outputs[0]
        for s in (2**64 - 1, 0)
    ]
    assert [c.token_ids for c in both] == [c.token_ids for c in alone]


def test_an_interrupted_step_leaves_no_prefix_behind(llm):
    """Ctrl-C (or any error) inside a forward pass: the blocks it allocated were hashed before their KV was
    written, so the next prompt sharing that prefix must not be served from them."""
    prompt = list(range(10, 46))  # two full blocks and a bit
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.kv_cache_manager.reset_prefix_cache()
    runner, forward = llm.engine.runner, llm.engine.runner.forward

    def interrupted(*args, **kwargs):
        runner.forward = forward
        raise KeyboardInterrupt

    runner.forward = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompt], params, use_tqdm=False)
    finally:
        runner.forward = forward
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_kv_blocks - 1


def test_a_stop_tokens_text_is_left_out_and_min_tokens_holds_stop_strings(llm):
    """As vLLM: the text of the stop token that ended a completion is not in it (its id is, in token_ids), and a
    stop string counts only in the text of tokens past min_tokens."""
    prompt = [10, 20, 30, 40]
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[3]
    i = base.token_ids.index(stop_id)  # its first appearance
    for include in (False, True):
        out = llm.generate(
            [prompt],
            SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include, **greedy),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.token_ids == base.token_ids[: i + 1] and out.stop_reason == stop_id
        assert out.text == llm.tokenizer.decode(base.token_ids[: i + 1 if include else i], skip_special_tokens=True)
    stop = base.text[2:5]
    early = llm.generate([prompt], SamplingParams(stop=[stop], **greedy), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.text == base.text[: base.text.index(stop)]
    held = llm.generate([prompt], SamplingParams(stop=[stop], min_tokens=12, **greedy), use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "length" and held.text == base.text  # no token past min_tokens: no stop


def test_max_tokens_none_fills_context(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=32)
    out = llm.generate([[1] * 20], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12 and out[0].outputs[0].finish_reason == "length"


def test_close_gives_the_memory_back_while_the_llm_is_still_referenced(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=32) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        executor = llm.engine.executor
        kv, weight = weakref.ref(executor.kv_caches[0]), weakref.ref(executor.model.lm_head.weight)
        del executor
        assert gc.get_freeze_count() > 0  # start-up's objects, out of the collector's full passes while serving
    gc.collect()
    assert gc.get_freeze_count() == 0  # (else a closed model's cycles would never be collected)
    assert kv() is None and weight() is None  # `llm` still names the object: close() let go of the tensors
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()  # idempotent


def test_a_dropped_llm_gives_its_memory_back(tiny_llama_dir):
    """No close(): dropping the LLM closes its engine, whose cycles start-up froze out of the collector's reach."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=32)
    kv, weight = weakref.ref(llm.engine.executor.kv_caches[0]), weakref.ref(llm.engine.executor.model.lm_head.weight)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert kv() is None and weight() is None and engine() is None


def test_close_empties_the_weights_of_a_model_still_referenced(tiny_llama_dir):
    """Whoever still holds the modules after close() (Dynamo's guards of a trace on some torch versions) holds no
    memory through them: every parameter and buffer is empty."""
    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=32) as llm:
        model = llm.engine.executor.model
        assert sum(t.numel() for t in model.parameters()) > 0
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.numel() == 0 for t in tensors)


def test_none_for_an_engine_setting_means_its_default():
    """vLLM's reading: `LLM(..., max_num_batched_tokens=None)` is the default budget, not a crash deep in the runner."""
    from kiln.engine.config import EngineConfig

    config = EngineConfig(max_num_batched_tokens=None, max_num_seqs=None, block_size=None, enable_prefix_caching=None)
    default = EngineConfig()
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.block_size, config.enable_prefix_caching) == (
        default.max_num_batched_tokens,
        default.max_num_seqs,
        default.block_size,
        default.enable_prefix_caching,
    )
    assert config.max_model_len is None  # a field whose default is None keeps it
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        EngineConfig(max_num_seqs=0)
