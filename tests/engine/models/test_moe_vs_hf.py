"""Mixtures of experts against Hugging Face (fp32, CPU): Mixtral, Qwen3-MoE and Qwen2-MoE tiny random-weight
checkpoints give the greedy tokens of `generate()` and the log-probabilities of HF's own forward over the same
tokens, eager and compiled, with chunked prefill; the router and the layer kinds read from each config; a
checkpoint short of an expert refused by name.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln.compile.cache import JsonFolder
from kiln.engine import LLM, SamplingParams
from kiln.engine.models.moe import SparseMoeBlock
from kiln.engine.models.source import resolve_model

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], [7, 7, 7], list(range(20, 61)), [300, 12]]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def hf(tiny_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()


def assert_matches_hf(hf, prompt: list[int], output) -> None:
    """Greedy tokens equal HF's (up to a near-tie of its top two logits), and each token's log-probability equals
    HF's log-softmax at that position."""
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    tokens = output.token_ids
    agreed = 0
    for got, want in zip(tokens, expected):
        if got != want:
            with torch.no_grad():
                top2 = hf(torch.tensor([prompt + expected[:agreed]])).logits[0, -1].topk(2).values
            assert top2[0] - top2[1] <= 1e-5, f"token {agreed} differs ({got} vs {want}) without a near-tie"
            break
        agreed += 1
    assert agreed >= MAX_TOKENS // 2, "too few tokens compared"
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, (token, entry) in enumerate(zip(tokens, output.logprobs)):
        assert math.isclose(entry[token].logprob, reference[i, token].item(), abs_tol=1e-4), i


def test_config_names_the_sparse_layers_and_the_router(tiny_moe_dir, tmp_path):
    config = resolve_model(str(tiny_moe_dir)).model_config
    hf_config = json.loads((tiny_moe_dir / "config.json").read_text())
    expected = {
        "MixtralForCausalLM": ((0, 1), 8, 2, True, 0),
        "Qwen3MoeForCausalLM": ((1,), 8, 3, True, 0),
        "Qwen2MoeForCausalLM": ((0, 2), 6, 2, False, 48),
    }[hf_config["architectures"][0]]
    got = (
        config.moe_layers,
        config.num_experts,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        config.shared_expert_intermediate_size,
    )
    assert got == expected
    memo = JsonFolder(tmp_path / "memo")  # the engine keeps the resolved config; read back, it is the same
    resolve_model(str(tiny_moe_dir), memo)
    assert resolve_model(str(tiny_moe_dir), memo).model_config == config


@pytest.mark.parametrize("budget", [None, 7], ids=["whole-prefill", "chunked-7"])
def test_eager_matches_hf(tiny_moe_dir, hf, budget):
    llm = LLM(str(tiny_moe_dir), enforce_eager=True, max_model_len=256, max_num_batched_tokens=budget)
    layers = llm.engine.executor.model.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] == list(
        llm.engine.model_config.moe_layers
    )
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert_matches_hf(hf, prompt, output.outputs[0])


def test_compiled_with_chunked_prefill_matches_hf(tiny_moe_dir, hf, tmp_path):
    llm = LLM(str(tiny_moe_dir), max_model_len=256, max_num_batched_tokens=16, compile_cache_dir=str(tmp_path))
    stats = llm.engine.startup_stats
    assert stats["dynamo_traces"] == 1
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert_matches_hf(hf, prompt, output.outputs[0])


def test_a_missing_expert_is_named(tiny_moe_dir, tmp_path):
    for f in tiny_moe_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    gone = next(name for name in sorted(weights) if ".experts.3." in name and ("up_proj" in name or ".w3." in name))
    del weights[gone]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    layer = gone.split(".layers.")[1].split(".")[0]
    with pytest.raises(ValueError, match=rf"missing 1 tensors: model\.layers\.{layer}\.mlp\.experts\.w13 \(\(3, 1\)\)"):
        LLM(str(tmp_path), enforce_eager=True, max_model_len=64)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_tp2_over_gloo_equals_tp1_and_hf(tiny_moe_dir, hf, enforce_eager, tmp_path):
    """Every rank holds every expert, half of its intermediate columns; one all-reduce adds the halves."""
    if not enforce_eager and "qwen2_moe" not in tiny_moe_dir.name:
        pytest.skip("compiled TP=2 on one of the three (the one with a shared expert and a dense layer): CI time")
    engine = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16)
    single = LLM(str(tiny_moe_dir), enforce_eager=True, **engine).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(
        str(tiny_moe_dir),
        enforce_eager=enforce_eager,
        tensor_parallel_size=2,
        compile_cache_dir=str(tmp_path),
        **engine,
    ) as llm:
        mlps = [layer.mlp for layer in llm.engine.executor.model.model.layers]
        sparse = next(mlp for mlp in mlps if isinstance(mlp, SparseMoeBlock))
        config = llm.engine.model_config
        assert sparse.experts.w13.shape == (config.num_experts, config.moe_intermediate_size, config.hidden_size)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, got, want in zip(PROMPTS, outputs, single):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        for lp_got, lp_want in zip(got.logprobs, want.logprobs):
            assert all(math.isclose(lp_got[t].logprob, lp_want[t].logprob, abs_tol=1e-4) for t in lp_got)
        assert_matches_hf(hf, prompt, got)


def test_weights_too_large_for_the_gpu_fail_at_start_with_the_sizes(monkeypatch):
    """qwen3-30b-a3b's weights against a GPU of 40 GiB: one line with both sizes, the weights' counted by Hugging
    Face's own model of the same config (built on the meta device)."""
    from transformers import AutoConfig

    from kiln.engine.core import kv_sizing, startup
    from kiln.engine.models.presets import PRESETS

    gib = 1 << 30

    def out_of_memory(config, dtype, device, *args):
        if device.type != "meta":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_build(config, dtype, device, *args)

    real_build = startup.build_model
    monkeypatch.setattr(startup, "build_model", out_of_memory)
    monkeypatch.setattr(kv_sizing, "device_memory", lambda device: (38 * gib, 40 * gib))
    preset = dict(PRESETS["qwen3-30b-a3b"])
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **preset))
    need = sum(p.numel() for p in reference.parameters()) * 4 / gib  # float32 on the CPU
    with pytest.raises(ValueError) as e:
        LLM("qwen3-30b-a3b", enforce_eager=True, max_model_len=64)
    assert str(e.value).startswith(f"the model's weights need {need:.1f} GiB on each GPU (tensor_parallel_size 1)")
    assert "36.0 GiB usable (38.0 GiB free of 40.0 GiB, gpu_memory_utilization 0.9)" in str(e.value)


def test_prefix_hits_and_preemption_with_experts(tiny_qwen3_moe_dir):
    """A mixture of experts keeps the engine's paging: prefix-cache hits and preempted, recomputed requests give HF's
    tokens, and every KV block comes back."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    shared = list(range(100, 140))
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6], shared + [7]]
    llm = LLM(str(tiny_qwen3_moe_dir), enforce_eager=True, max_model_len=80, num_kv_blocks=21, block_size=4)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 40 for o in rest)
    # 20 blocks of 4 tokens cannot hold the 10 shared blocks and three requests' 5 blocks of their own each
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, first + rest):
        assert_matches_hf(hf, prompt, output.outputs[0])
    assert llm.engine.kv_cache_manager.num_free_blocks == 20


def test_server_streams_and_constrains_a_mixture_of_experts(tiny_qwen3_moe_dir):
    """The API over a MoE model: a JSON-schema-constrained completion parses and validates, a stream ends, and the
    KV blocks come back."""
    from helpers.server import Server

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    schema["additionalProperties"] = False
    server = Server(tiny_qwen3_moe_dir)
    try:
        client = server.client()
        baseline = server.metric("kiln_kv_cache_free_blocks")
        out = client.completions.create(
            model=server.model, prompt="json", max_tokens=40, seed=1, extra_body={"guided_json": schema}
        )
        value = json.loads(out.choices[0].text)
        assert set(value) == {"n"} and isinstance(value["n"], int)
        stream = client.completions.create(model=server.model, prompt="hi", max_tokens=8, stream=True, seed=2)
        chunks = [c for c in stream if c.choices]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert server.metric("kiln_kv_cache_free_blocks") == baseline
    finally:
        server.stop()
