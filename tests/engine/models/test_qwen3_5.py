"""The Gated DeltaNet hybrids (Qwen3.5 dense and MoE, Qwen3-Next) against Hugging Face (fp32, CPU): greedy tokens and
their log-probabilities equal transformers' own, eager and compiled, with chunked prefill whose chunk edges fall inside
and across the conv window, batches mixing new prompts with decodes and finishing requests, preemption, an abort
mid-prefill, and a conversation's next turn that starts from a state snapshot. No state slot or KV block leaks.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln.compile.cache import JsonFolder
from kiln.engine import LLM, SamplingParams
from kiln.engine.models.source import resolve_model

from helpers.models import assert_greedy_matches_hf, skip_uninterpreted_triton, tiny_hybrid_config

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], [7, 7, 7], list(range(20, 61)), [300, 12], list(range(1, 18))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_hybrid_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir, dtype=torch.float32).eval()


def assert_nothing_held(llm: LLM) -> None:
    """Every KV block and recurrent-state slot is back (snapshots stay: they are the prefix cache's)."""
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    states = manager.states
    assert not states.slot_of and len(states.free_slots) == states.num_slots


def test_config_reads_the_layer_kinds(tiny_hybrid_dir, tmp_path):
    config = resolve_model(str(tiny_hybrid_dir)).model_config
    memo = JsonFolder(tmp_path / "memo")  # the engine keeps the resolved config; read back, it is the same
    resolve_model(str(tiny_hybrid_dir), memo)
    assert resolve_model(str(tiny_hybrid_dir), memo).model_config == config
    hf_config = json.loads((tiny_hybrid_dir / "config.json").read_text())
    assert config.linear_layers == (0, 1, 2, 4) and config.attention_layers == (3,)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (16, 8, 4)
    assert config.rotary_dim == 4 and config.attn_output_gate and config.qk_norm
    assert config.norm_weight_offset == 1.0
    expected_moe = {"Qwen3_5ForCausalLM": (), "Qwen3_5MoeForCausalLM": (0, 1, 2, 3, 4)}
    expected_moe["Qwen3NextForCausalLM"] = (0, 2, 3, 4)
    assert config.moe_layers == expected_moe[hf_config["architectures"][0]]
    assert config.shared_expert_intermediate_size == (48 if config.moe_layers else 0)


@pytest.mark.parametrize("budget", [None, 5, 7], ids=["whole-prefill", "chunked-5", "chunked-7"])
def test_eager_matches_hf(tiny_hybrid_dir, hf, budget):
    """Chunks of 5 and 7 tokens: their edges fall inside the 3-token conv window of the next chunk and across it."""
    llm = LLM(str(tiny_hybrid_dir), enforce_eager=True, max_model_len=256, max_num_batched_tokens=budget)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)
    assert_nothing_held(llm)


def test_compiled_matches_hf(tiny_hybrid_dir, hf, tmp_path):
    """Compiled (the graph split at each linear-attention layer as at attention), chunked, then a warm start that
    traces nothing."""
    kwargs = dict(max_model_len=256, max_num_batched_tokens=9, compile_cache_dir=str(tmp_path))
    llm = LLM(str(tiny_hybrid_dir), **kwargs)
    counters = llm.engine.executor.counters
    assert counters.compute_pieces == 6  # split at 4 linear-attention layers and 1 attention layer
    assert_greedy_matches_hf(hf, PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False), MAX_TOKENS, TOL)
    del llm
    warm = LLM(str(tiny_hybrid_dir), **kwargs)
    assert warm.engine.executor.counters.dynamo_traces == 0
    assert_greedy_matches_hf(hf, PROMPTS, warm.generate(PROMPTS, GREEDY, use_tqdm=False), MAX_TOKENS, TOL)


def test_mixed_batches_and_finishing_requests(tiny_qwen3_5_dir):
    """Requests of different lengths arrive while others decode and finish (max_num_seqs 2, a 6-token budget), each
    equal to its run alone."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_dir, dtype=torch.float32).eval()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (3, 9, 5, 12, 2)]
    llm = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=6)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output, p in zip(PROMPTS, outputs, params):
        assert_greedy_matches_hf(hf, [prompt], [output], p.max_tokens, TOL)
    assert_nothing_held(llm)


def test_preemption_recomputes_the_state(tiny_qwen3_5_dir):
    """12 usable blocks of 4 tokens cannot hold five growing requests: some are preempted, their slots freed, and
    recomputed from the start to the same tokens."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_dir, dtype=torch.float32).eval()
    llm = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=48, num_kv_blocks=13, block_size=4)
    prompts = [p[:20] for p in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_greedy_matches_hf(hf, prompts, outputs, MAX_TOKENS, TOL)
    assert_nothing_held(llm)


def test_abort_mid_prefill_frees_the_slot(tiny_qwen3_5_dir):
    llm = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=128, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("long", list(range(1, 60)), GREEDY)
    engine.step()  # the first 8 of 59 prompt tokens
    assert engine.kv_cache_manager.states.slot_of == {"long": 1}
    engine.abort_requests(["long"])
    assert_nothing_held(llm)


def test_next_turn_starts_from_a_snapshot(tiny_qwen3_5_dir):
    """A conversation's second turn (the first turn's prompt, its answer, a new message) hits the snapshot kept at the
    first prompt's last full block, and its tokens equal a run without prefix caching and Hugging Face's."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_dir, dtype=torch.float32).eval()
    first = list(range(30, 70))  # 40 tokens: the snapshot after block 2 (token 32)
    llm = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=256, max_num_batched_tokens=16)
    answer = llm.generate([first], GREEDY, use_tqdm=False)[0]
    second = first + answer.outputs[0].token_ids + [9, 8, 7]
    hit = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 32
    cold = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=256, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == cold.generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_greedy_matches_hf(hf, [first, second], [answer, hit], MAX_TOKENS, TOL)
    assert_nothing_held(llm)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tp2_equals_tp1_and_hf(tiny_hybrid_dir, hf, compiled, tmp_path):
    """Two ranks over gloo: each holds one of the two key heads and two of the four value heads of every linear layer
    (their conv channels, decays and state rows with them), and one KV head of the attention layer."""
    if compiled and "qwen3_5_moe" not in str(tiny_hybrid_dir):
        pytest.skip("compiled once, on the MoE hybrid (its experts cut too): the split is every hybrid's")
    kwargs = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16, enforce_eager=not compiled)
    kwargs["compile_cache_dir"] = str(tmp_path)
    single = LLM(str(tiny_hybrid_dir), **{**kwargs, "enforce_eager": True}).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(tiny_hybrid_dir), tensor_parallel_size=2, **kwargs) as llm:
        layers = llm.engine.executor.model.model.layers
        assert layers[0].linear_attn.num_value_heads == 2 and layers[3].self_attn.num_kv_heads == 1
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for got, want in zip(outputs, single, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert all(abs(lp_got[t].logprob - lp_want[t].logprob) < TOL for t in lp_got)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path, caplog):
    """Qwen3_5ForConditionalGeneration as Qwen ships it (`model.language_model.*`, `model.visual.*`), with the
    multi-token-prediction layers Qwen ships beside (`mtp.*`): the language model's tokens equal the whole model's on
    text, the vision tower and the MTP layers are passed over with a line each."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from kiln.engine.text.tokenizer import builtin_tokenizer

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    config = Qwen3_5Config(text_config=tiny_hybrid_config("qwen3_5").to_dict(), vision_config=vision)
    config.tie_word_embeddings = False
    hf = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    builtin_tokenizer(config.text_config.vocab_size).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path), enforce_eager=True, max_model_len=128)
    assert "vision tower is ignored" in caplog.text and "multi-token-prediction" in caplog.text
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_the_triton_kernels_in_the_model_match_hf(tiny_qwen3_5_dir, monkeypatch):
    """The op with the Triton kernels (under the interpreter on the CPU) in place of the plain-torch forms: chunked
    prefill, mixed batches and decodes of the tiny model equal transformers'."""
    skip_uninterpreted_triton("triton")
    from kiln.backends.linear_attention import op

    monkeypatch.setattr(op, "_kernels", lambda device: op._triton_kernels())
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_dir, dtype=torch.float32).eval()
    llm = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=256, max_num_batched_tokens=7)
    prompts, params = PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    assert_greedy_matches_hf(hf, prompts, llm.generate(prompts, params, use_tqdm=False), 6, TOL)


def test_drafts_verified_over_the_recurrent_state(tiny_qwen3_5_dir):
    """Speculative decoding on the hybrid, drafts from the host (the step after one verifying drafts waits for its
    verdict): a step verifying drafts writes back the state it started from and records its tokens; the next step
    folds in those kept. Drafts from an oracle (the run without drafts' tokens, every other proposal's last token
    wrong): tokens and logprobs equal that run's."""
    plain = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=256)
    want = {tuple(p): o.outputs[0] for p, o in zip(PROMPTS, plain.generate(PROMPTS, GREEDY, use_tqdm=False))}

    class Oracle:
        calls = 0

        def propose(self, token_ids, limit):
            for prompt, output in want.items():
                if tuple(token_ids[: len(prompt)]) == prompt:
                    done = len(token_ids) - len(prompt)
                    draft = list(output.token_ids[done : done + min(3, limit)])
                    Oracle.calls += 1
                    if draft and Oracle.calls % 2:
                        draft[-1] = (draft[-1] + 1) % 512
                    return draft
            return []

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(tiny_qwen3_5_dir), enforce_eager=True, max_model_len=256, speculative_config=spec)
    llm.engine.scheduler.drafter = Oracle()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    for prompt, output in zip(PROMPTS, outputs):
        got, expected = output.outputs[0], want[tuple(prompt)]
        assert got.token_ids == expected.token_ids
        assert all(
            abs(a[t].logprob - b[t].logprob) < TOL for a, b, t in zip(got.logprobs, expected.logprobs, got.token_ids)
        )
    assert_nothing_held(llm)


SAME_LENGTH = [[5, 17, 33, 2, 101, 45, 9, 5, 17], [7] * 9, list(range(20, 29)), [300, 12] * 4 + [1]]


@pytest.mark.parametrize(
    "k,setup",
    [(1, "eager"), (3, "eager"), (4, "chunked-compiled"), (3, "preempted"), (2, "tp2"), (2, "triton")],
)
def test_drafts_on_the_device_fold_into_the_state(tiny_qwen3_5_dir, tmp_path, monkeypatch, k, setup):
    """Drafts made on the device (as MTP's and EAGLE-3's: bench_spec's oracle, the run without drafts' tokens with
    about 40% of draft tokens corrupted): the engine schedules each step before the verdict on the one in flight, and
    the device folds each request's kept tokens into its recurrent state (op.py's DraftRecord). Tokens and logprobs
    those of the run without drafts, with chunked prefill and compiled, preemption, two ranks over gloo, the Triton
    kernels, and again from the prefix cache's snapshots; every slot and block back."""
    from bench_spec import DeviceDrafter, install  # noqa: PLC0415

    if setup == "triton":  # (the GPU's kernels, under Triton's interpreter: the fold's strided record views)
        skip_uninterpreted_triton("triton")
        from kiln.backends.linear_attention import op

        monkeypatch.setattr(op, "_kernels", lambda device: op._triton_kernels())
    kwargs = dict(enforce_eager=setup != "chunked-compiled", max_model_len=64, block_size=4)
    if setup == "chunked-compiled":
        kwargs.update(max_num_batched_tokens=8, compile_cache_dir=str(tmp_path))
    if setup == "preempted":
        kwargs.update(num_kv_blocks=11, max_model_len=40)
    max_tokens = 8 if setup == "triton" else 16  # (the interpreter's steps are slow; a fold happens by the third)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    with LLM(str(tiny_qwen3_5_dir), **kwargs) as plain:
        want = plain.generate(SAME_LENGTH, params, use_tqdm=False)
    continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(SAME_LENGTH, want)}
    spec = {"method": "ngram", "num_speculative_tokens": k}
    tp = 2 if setup == "tp2" else 1
    with LLM(str(tiny_qwen3_5_dir), speculative_config=spec, tensor_parallel_size=tp, **kwargs) as llm:
        install(llm, DeviceDrafter(k, llm.engine.model_config.vocab_size, continuations, keep=0.6))
        assert llm.engine.scheduler.optimistic
        for _ in range(2):  # (the second time from the first's snapshots)
            outputs = llm.generate(SAME_LENGTH, params, use_tqdm=False)
            for got, expected in zip(outputs, want, strict=True):
                got, expected = got.outputs[0], expected.outputs[0]
                assert got.token_ids == expected.token_ids
                for a, b, t in zip(got.logprobs, expected.logprobs, got.token_ids):
                    assert abs(a[t].logprob - b[t].logprob) < TOL
        scheduler = llm.engine.scheduler
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
        assert all(o.num_cached_tokens >= 4 for o in outputs) or setup == "preempted"
        assert (scheduler.num_preemptions > 0) == (setup == "preempted")
        assert_nothing_held(llm)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_mtp_drafts(tiny_qwen3_5_dir, tmp_path, monkeypatch, tp):
    """speculative_config method mtp: the MTP layer the checkpoint ships proposes what transformers' own decoder layer
    wired as Qwen's MTP proposes, and greedy output with its drafts equals the run without them. With two ranks (gloo)
    it runs on rank 0 over the whole vocabulary (the embedding and the tied LM head read whole from the checkpoint)."""
    from kiln.engine.spec_decode.eagle_proposer import EagleProposer

    from helpers.mtp import add_mtp_layer, reference_mtp_drafts

    model_dir = add_mtp_layer(tiny_qwen3_5_dir, tmp_path / "with-mtp")
    proposals = []
    propose = EagleProposer.propose

    def recording(self, batch, *args):
        propose(self, batch, *args)
        proposals.append(self.proposals(batch))

    monkeypatch.setattr(EagleProposer, "propose", recording)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    kwargs = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
    plain = LLM(str(model_dir), **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(model_dir), tensor_parallel_size=tp, speculative_config=spec, **kwargs) as llm:
        prompt = PROMPTS[2]
        first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0].outputs[0]
        drafted = next(p[0] for p in proposals if p and p[0])  # (the step that sampled the first token: the prefill's)
        assert drafted == reference_mtp_drafts(model_dir, prompt, first.token_ids[0], 3)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_draft_tokens > 0
        assert_nothing_held(llm)
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_precompile_with_mtp_drafts_warms_the_deployments_cache(tiny_qwen3_5_dir, tmp_path, capsys):
    """`kiln precompile` with the deployment's --speculative-config traces the target and leaves the draft model
    unread (its random weights would have no MTP layer to refuse); the deployment then starts warm, drafts made."""
    from kiln.engine.cli import main

    from helpers.mtp import add_mtp_layer

    model_dir = add_mtp_layer(tiny_qwen3_5_dir, tmp_path / "with-mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    cache = str(tmp_path / "cache")
    flags = ["--max-model-len", "128", "--compile-cache-dir", cache, "--speculative-config", json.dumps(spec)]
    assert main(["precompile", str(model_dir), *flags]) == 0
    assert "inductor_compiles" in capsys.readouterr().out
    with LLM(str(model_dir), max_model_len=128, compile_cache_dir=cache, speculative_config=spec) as llm:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert llm.engine.startup_stats["inductor_compiles"] == 0
        assert llm.engine.scheduler.num_draft_tokens > 0
