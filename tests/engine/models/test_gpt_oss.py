"""gpt-oss against Hugging Face (fp32, CPU) on tiny checkpoints of both published layouts (the bf16 one others
publish, and MXFP4 experts as OpenAI writes them, which transformers dequantizes): greedy tokens and their
log-probabilities equal transformers' own, eager and compiled, with the torch and Triton attention backends, chunked
prefill across the 128-token window of the sliding layers, a prefix hit, preemption, and TP=2 over gloo. Every feature
bites in the tiny model (the sinks, the clamp of the SwiGLU, the biases, YaRN)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kiln.compile.cache import JsonFolder
from kiln.engine import LLM, SamplingParams
from kiln.engine.models.gpt_oss import intermediate_share
from kiln.engine.models.layers import rope_attention_factor, rope_inv_freq
from kiln.engine.models.parallel import TensorParallelShard
from kiln.engine.models.source import resolve_model

from helpers.gpt_oss import hf_gpt_oss, make_tiny_gpt_oss_dir, tiny_gpt_oss_config
from helpers.models import assert_greedy_matches_hf, skip_uninterpreted_triton

# two prompts past the 128-token window of the sliding layers (one of them well past it), two short ones
PROMPTS = [[5, 17, 33, 2, 101, 45, 9], list(range(20, 180)), [300, 12], [(7 * i) % 480 + 3 for i in range(200)]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
TOL = 1e-4


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def gpt_oss_dir(request, tmp_path_factory):
    return make_tiny_gpt_oss_dir(tmp_path_factory.mktemp(f"gpt_oss_{request.param}"), request.param == "mxfp4")


@pytest.fixture(scope="module")
def hf(gpt_oss_dir):
    return hf_gpt_oss(gpt_oss_dir)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_every_feature_bites(gpt_oss_dir, hf):
    """Without the sinks, with HF's clamp of 7 instead of 2, without the biases: other logits, so the comparisons
    below test each of them."""
    prompt = PROMPTS[1]
    reference = _logits(hf, prompt)
    kwargs = {"dtype": torch.float32, "experts_implementation": "eager"}
    if "quantization_config" in json.loads((gpt_oss_dir / "config.json").read_text()):
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    changes = {
        "sinks": lambda m: [layer.self_attn.sinks.fill_(-1e4) for layer in m.model.layers],
        "biases": lambda m: [p.zero_() for name, p in m.named_parameters() if name.endswith("experts.down_proj_bias")],
    }
    for what, change in changes.items():
        other = AutoModelForCausalLM.from_pretrained(gpt_oss_dir, **kwargs).eval()
        with torch.no_grad():
            change(other)
        assert (_logits(other, prompt) - reference).abs().max() > 1e-2, what
    unclamped = AutoModelForCausalLM.from_pretrained(gpt_oss_dir, swiglu_limit=7.0, **kwargs).eval()
    assert (_logits(unclamped, prompt) - reference).abs().max() > 1e-2


def test_config_reads_the_model(gpt_oss_dir, tmp_path):
    config = resolve_model(str(gpt_oss_dir)).model_config
    memo = JsonFolder(tmp_path / "memo")  # the engine keeps the resolved config; read back, it is the same
    resolve_model(str(gpt_oss_dir), memo)
    assert resolve_model(str(gpt_oss_dir), memo).model_config == config
    assert config.architecture == "GptOssForCausalLM" and config.attention_sinks
    assert config.sliding_window == 128 and config.sliding_layers == (0, 2)
    assert config.qkv_bias and config.o_bias and not config.qk_norm
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 64)
    assert config.moe_layers == (0, 1, 2, 3) and (config.swiglu_alpha, config.swiglu_limit) == (1.702, 2.0)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == 150000.0
    assert config.mxfp4_experts == ("mxfp4" in gpt_oss_dir.name) and config.quantization is None
    assert set(config.eos_token_ids) == set(
        json.loads((gpt_oss_dir / "generation_config.json").read_text())["eos_token_id"]
    )


@pytest.mark.parametrize(
    "head_dim,theta,factor,original,truncate", [(64, 150000.0, 32.0, 4096, False), (16, 1e4, 4.0, 64, True)]
)
def test_yarn_is_transformers_yarn(head_dim, theta, factor, original, truncate):
    """gpt-oss's YaRN (32x over 4,096 positions, the ramp's ends not rounded) and another: the frequencies and the
    cos/sin factor transformers computes."""
    rope = dict(
        rope_type="yarn", factor=factor, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=original
    )
    rope["truncate"] = truncate
    hf_config = tiny_gpt_oss_config()
    hf_config.head_dim, hf_config.rope_parameters = head_dim, {**rope, "rope_theta": theta}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, rope), inv_freq, rtol=0, atol=0)
    assert rope_attention_factor(rope) == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize(
    "backend,budget,enforce_eager",
    [("torch", None, True), ("torch", 48, True), ("triton", 48, True), ("torch", 48, False), ("triton", 48, False)],
    ids=[
        "torch-whole-eager",
        "torch-chunked-eager",
        "triton-chunked-eager",
        "torch-chunked-compiled",
        "triton-chunked-compiled",
    ],
)
def test_matches_hf(gpt_oss_dir, hf, tmp_path, backend, budget, enforce_eager):
    """Chunks of 48 tokens: the 160- and 200-token prompts' chunks start inside and past the window of the sliding
    layers; the Triton backend under the interpreter on the CPU."""
    skip_uninterpreted_triton(backend)
    engine = dict(max_model_len=512, max_num_batched_tokens=budget, attention_backend=backend, device="cpu")
    with LLM(str(gpt_oss_dir), enforce_eager=enforce_eager, compile_cache_dir=str(tmp_path), **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_compiled_warm_start_traces_nothing(gpt_oss_dir, hf, tmp_path):
    """The graph split at each layer's attention (five pieces for four layers); a second start loads them."""
    kwargs = dict(max_model_len=512, max_num_batched_tokens=64, compile_cache_dir=str(tmp_path), device="cpu")
    with LLM(str(gpt_oss_dir), **kwargs) as llm:
        assert llm.engine.executor.counters.compute_pieces == 5
    with LLM(str(gpt_oss_dir), **kwargs) as warm:
        assert warm.engine.executor.counters.dynamo_traces == 0
        outputs = warm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_a_prefix_hit_across_the_window(gpt_oss_dir, hf):
    """A second prompt sharing the first's 176 tokens (past the window) computes only what follows them."""
    first = PROMPTS[3][:190]
    second = first[:176] + [400, 401, 402, 403, 404]
    with LLM(str(gpt_oss_dir), enforce_eager=True, max_model_len=512, device="cpu") as llm:
        llm.generate([first], GREEDY, use_tqdm=False)
        (output,) = llm.generate([second], GREEDY, use_tqdm=False)
        assert output.num_cached_tokens == 176
    assert_greedy_matches_hf(hf, [second], [output], MAX_TOKENS, TOL)


def test_preemption_recomputes_to_the_same_tokens(gpt_oss_dir, hf):
    """65 usable blocks of 8 tokens, the full layers' and the sliding layers' (a window of 128) from one pool: two of
    these 120-token prompts start, and as they grow past it one is preempted and recomputed, to HF's tokens; every
    block comes back."""
    prompts = [PROMPTS[3][:120], list(range(20, 140)), PROMPTS[3][40:160], [(11 * i) % 470 + 5 for i in range(120)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    engine = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=66, block_size=8, device="cpu")
    with LLM(str(gpt_oss_dir), **engine) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        manager = llm.engine.kv_cache_manager
        assert manager.num_free_blocks == manager.block_pool.num_usable_blocks
    assert_greedy_matches_hf(hf, prompts, outputs, 24, TOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tp2_equals_tp1_and_hf(gpt_oss_dir, hf, compiled, tmp_path):
    """Two ranks over gloo: two of the four query heads (and their sinks) and one of the two KV heads each, 32 of
    the experts' 64 intermediate columns (one MXFP4 block), the down projection's bias added by one rank."""
    kwargs = dict(max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=48, compile_cache_dir=str(tmp_path))
    single = LLM(str(gpt_oss_dir), enforce_eager=True, **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(gpt_oss_dir), tensor_parallel_size=2, enforce_eager=not compiled, **kwargs) as llm:
        layer = llm.engine.executor.model.model.layers[0]
        assert layer.self_attn.num_heads == 2 and layer.self_attn.sinks.shape == (2,)
        assert layer.mlp.experts.intermediate == 32
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for got, want in zip(outputs, single, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert all(abs(lp_got[t].logprob - lp_want[t].logprob) < TOL for t in lp_got)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_mxfp4_experts_stay_four_bit(tmp_path):
    """The experts hold the checkpoint's bytes (blocks and scales, rows de-interleaved into gate | up): half a byte a
    weight, one a 32 for the scales."""
    from safetensors.torch import load_file

    path = make_tiny_gpt_oss_dir(tmp_path / "m", mxfp4_experts=True)
    with LLM(str(path), enforce_eager=True, max_model_len=64, device="cpu") as llm:
        experts = llm.engine.executor.model.model.layers[1].mlp.experts
        assert experts.gate_up_proj_blocks.dtype == torch.uint8 and not hasattr(experts, "gate_up_proj")
        stored = load_file(path / "model.safetensors")
        blocks = stored["model.layers.1.mlp.experts.gate_up_proj_blocks"].flatten(2)  # [E, 2I interleaved, H/2]
        assert torch.equal(experts.gate_up_proj_blocks[:, :64], blocks[:, 0::2])
        assert torch.equal(experts.gate_up_proj_blocks[:, 64:], blocks[:, 1::2])
        assert torch.equal(experts.down_proj_scales, stored["model.layers.1.mlp.experts.down_proj_scales"])
        assert experts.gate_up_proj_blocks.numel() == 4 * 128 * 64 // 2


@pytest.mark.parametrize("size,ranks,granule", [(2880, 2, 32), (2880, 4, 32), (2880, 8, 32), (64, 2, 1), (128, 4, 32)])
def test_each_rank_takes_whole_mxfp4_blocks(size, ranks, granule):
    """2,880 intermediate columns (gpt-oss's) are 90 blocks of 32: over 4 or 8 ranks some take one block more."""
    shares = [intermediate_share(size, TensorParallelShard(rank, ranks), granule) for rank in range(ranks)]
    assert shares[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert sum(n for _, n in shares) == size and all(n % granule == 0 for _, n in shares)
    assert max(n for _, n in shares) - min(n for _, n in shares) <= granule


def test_too_few_mxfp4_blocks_for_the_ranks_is_one_line():
    with pytest.raises(ValueError, match="intermediate size 96 cannot be cut in 4 ranks' shares"):
        intermediate_share(96, TensorParallelShard(0, 4), 32)
    with pytest.raises(ValueError, match="intermediate size 80 is not whole blocks of 32"):
        intermediate_share(80, TensorParallelShard(0, 1), 32)


def test_mxfp4_is_refused_for_other_models(tiny_llama_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is gpt-oss's, not LlamaForCausalLM's"):
        LLM(str(tmp_path / "m"), enforce_eager=True, max_model_len=64)


@pytest.mark.parametrize(
    "preset,layers,experts,gigabytes", [("gpt-oss-20b", 24, 32, 13.76), ("gpt-oss-120b", 36, 128, 65.25)]
)
def test_presets_of_the_published_shapes(preset, layers, experts, gigabytes):
    """Built on the meta device: the published shapes, the experts 4-bit, and as many bytes of weights as OpenAI's
    safetensors files hold (13.8 GB and 65.3 GB)."""
    from kiln.engine.models.loader import build_model

    config = resolve_model(preset).model_config
    assert (config.num_layers, config.num_experts, config.num_experts_per_tok) == (layers, experts, 4)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size) == (64, 8, 64, 2880)
    assert config.sliding_layers == tuple(range(0, layers, 2)) and config.sliding_window == 128
    assert config.mxfp4_experts and config.attention_sinks and config.rope_scaling["factor"] == 32.0
    assert set(config.eos_token_ids) == {200002, 199999, 200012}  # <|return|>, <|endoftext|>, <|call|>
    model = build_model(config, torch.bfloat16, torch.device("meta"), 4096)
    experts_module = model.model.layers[0].mlp.experts
    assert experts_module.gate_up_proj_blocks.shape == (experts, 2 * 2880, 2880 // 2)
    assert experts_module.down_proj_scales.dtype == torch.uint8
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total == pytest.approx(gigabytes * 1e9, rel=1e-3)


def test_dummy_mxfp4_experts_are_the_same_whatever_the_ranks(tmp_path):
    """`--load-format dummy` (as the presets load) draws every expert's MXFP4 bytes whole and gives each rank its
    blocks: scales of 2^-7, codes of every kind, and the same tokens on one rank and two."""
    path = make_tiny_gpt_oss_dir(tmp_path / "m", mxfp4_experts=True)
    kwargs = dict(load_format="dummy", enforce_eager=True, max_model_len=256, num_kv_blocks=64)
    with LLM(str(path), **kwargs) as llm:
        experts = llm.engine.executor.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj_scales.unique().tolist() == [127 - 7]
        assert len((experts.down_proj_blocks & 15).unique()) == 16
        single = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    with LLM(str(path), tensor_parallel_size=2, **kwargs) as llm:
        double = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in double] == [o.outputs[0].token_ids for o in single]
