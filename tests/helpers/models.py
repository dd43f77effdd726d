"""Tiny random-weight Hugging Face models, saved locally with a locally trained tokenizer: the reference models of
the CPU tests (nothing is fetched from a hub)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    eos_token_id=511,
    bos_token_id=0,
    pad_token_id=0,
)


# Mixtures of experts: 8 (or 6) experts of 32 columns, k of them a token; the Qwen ones with a dense layer too
TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_hf_config(kind: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if kind == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        return LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None)
    if kind == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        return Qwen2Config(**TINY, rope_parameters=rope, tie_word_embeddings=True)
    if kind == "qwen3":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        shape = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 1}  # GQA 4:1, head_dim 32 != 64 / 4
        return Qwen3Config(**shape, head_dim=32, rope_parameters=rope, tie_word_embeddings=False)
    if kind == "gemma3":  # two sliding layers (window 8, RoPE base 10k) and a global one (1M, linear x2)
        return Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            tie_word_embeddings=True,
            architectures=["Gemma3ForCausalLM"],
        )
    if kind == "gemma2":  # layers 0 and 2 slide (window 8); scores capped at 2.5 and logits at 3: both bite here
        return Gemma2Config(
            **{**TINY, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=2.5,
            final_logit_softcapping=3.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
            architectures=["Gemma2ForCausalLM"],
        )
    rope = {"rope_type": "default", "rope_theta": 1e6}
    if kind == "mixtral":  # every layer sparse, top-2 of 8 renormalised; its experts are intermediate_size wide
        return MixtralConfig(
            **{**TINY, "intermediate_size": 32},
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters=rope,
            sliding_window=None,
        )
    if kind == "qwen3_moe":  # layer 0 dense (decoder_sparse_step 2), top-3 of 8 renormalised, q/k norms
        return Qwen3MoeConfig(
            **TINY,
            **{**TINY_MOE, "num_experts_per_tok": 3},
            num_experts=8,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            head_dim=16,
            rope_parameters=rope,
            tie_word_embeddings=False,
        )
    if kind == "qwen2_moe":  # 3 layers, the middle one dense (mlp_only_layers), a gated shared expert, QKV bias
        return Qwen2MoeConfig(
            **{**TINY, "num_hidden_layers": 3},
            **TINY_MOE,
            num_experts=6,
            mlp_only_layers=[1],
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            rope_parameters=rope,
        )
    if kind in HYBRIDS:
        return tiny_hybrid_config(kind)
    if kind in GEMMA4:
        return tiny_gemma4_config(kind)
    raise ValueError(kind)


# Gemma 4: sliding layers (window 8) of four heads of 16 over two KV heads, full layers of heads of 32 (RoPE over a
# quarter of their pairs), logits capped at 3 (it bites here). "gemma4": 31B's full layers, one KV head whose value is
# the key's projection, beside sliding layers of four KV heads (a full layer's page half a sliding one's);
# "gemma4_e": E2B's and E4B's per-layer embeddings (8 a layer) and the last two layers reading the KV of layers 3
# (sliding) and 4 (full), their MLP twice as wide (a sliding layer's page half a full one's); "gemma4_moe": 26B-A4B's
# four experts (top 2) beside every layer's MLP
GEMMA4 = ("gemma4", "gemma4_e", "gemma4_moe")
TINY_GEMMA4 = dict(
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    final_logit_softcapping=3.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
    tie_word_embeddings=True,
    architectures=["Gemma4ForCausalLM"],
)


def tiny_gemma4_config(kind: str):
    from transformers import Gemma4TextConfig

    sliding, full = "sliding_attention", "full_attention"
    if kind == "gemma4":
        layers = [sliding, sliding, full, sliding, sliding, full]
        extra = dict(num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=1)
    elif kind == "gemma4_e":
        layers = [sliding, sliding, full, sliding, full, sliding, full]
        extra = dict(
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=TINY["vocab_size"],
        )
    else:
        layers = [sliding, sliding, full, sliding, full]
        extra = dict(
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        )
    shape = {**TINY, "num_hidden_layers": len(layers), "num_key_value_heads": extra.pop("num_key_value_heads", 2)}
    if kind != "gemma4_e":
        extra["hidden_size_per_layer_input"] = 0
    return Gemma4TextConfig(**shape, **TINY_GEMMA4, layer_types=layers, **extra)


# Gated DeltaNet hybrids: layers 0-2 linear, 3 full, 4 linear (a second period begun); two key heads of 16, four value
# heads of 8 (each pair reading one key head), a 4-tap conv; attention of four 16-dim heads over two KV heads, a gate
# each, RoPE over a quarter of each head
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TINY_HYBRID = dict(
    num_hidden_layers=5,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
)


def tiny_hybrid_config(kind: str):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    shape = {**TINY, **TINY_HYBRID}
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if kind == "qwen3_5":
        config = Qwen3_5TextConfig(**shape, tie_word_embeddings=True)
    elif kind == "qwen3_5_moe":
        config = Qwen3_5MoeTextConfig(**shape, **experts, tie_word_embeddings=False)
    else:  # layer 1 dense (mlp_only_layers), the others sparse
        config = Qwen3NextConfig(
            **shape, **experts, mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False
        )
    config.architectures = [
        {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}.get(kind, "Qwen3NextForCausalLM")
    ]
    return config


def make_tiny_model_dir(path: Path, kind: str, seed: int = 0, vocab_size: int | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    from kiln.engine.text.tokenizer import builtin_tokenizer

    torch.manual_seed(seed)
    config = tiny_hf_config(kind)
    if vocab_size is not None:
        config.vocab_size, config.eos_token_id = vocab_size, vocab_size - 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind in ("mixtral", "qwen3_moe", "qwen2_moe"):
        # decisive routers (logits ~4x HF's init): a near-tie between experts would let bf16 rounding pick another
        # expert, which says nothing about the kernels
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    p.mul_(4.0)
    if kind in ("qwen2", "qwen2_moe"):  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    if kind in HYBRIDS:  # norms (1 + 0 at init), the gated norm's (1) and the decays: all made to matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    p.normal_(0, 0.3)
                elif name.endswith("A_log"):
                    p.uniform_(-3.0, 1.0)
                elif name.endswith("mlp.gate.weight"):
                    p.mul_(4.0)
    if kind in ("gemma2", "gemma3"):  # HF initialises Gemma's norm weights to zero (a scale of 1 + 0); make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    if kind in GEMMA4:  # norms and scales (HF's ones) made to matter, the router decisive
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "router.scale")):
                    p.normal_(1.0, 0.3)
                elif name.endswith("router.per_expert_scale"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith("router.proj.weight"):
                    p.mul_(4.0)
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):
                    b.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    builtin_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def assert_greedy_matches_hf(hf, prompts, outputs, max_tokens: int, tol: float, near_tie: bool = False) -> None:
    """Kiln's greedy outputs equal the tokens of HF's `generate()`, and each token's log-probability HF's (within
    `tol`). With `near_tie`, they may part after half the tokens where HF's own two candidates are within `tol`
    (compared up to there)."""
    for prompt, output in zip(prompts, outputs):
        got = output.outputs[0]
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
            logits = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.double(), dim=-1)
        agreed = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b), len(want))
        if agreed < len(want):
            assert near_tie, f"token {agreed} differs: {got.token_ids} against HF's {want}"
            gap = reference[agreed, want[agreed]] - reference[agreed, got.token_ids[agreed]]
            assert agreed >= max_tokens // 2 and gap <= tol, f"token {agreed} differs, HF's gap {gap:.2e}"
        for i, (token, entry) in enumerate(zip(got.token_ids[: agreed + 1], got.logprobs)):
            assert math.isclose(entry[token].logprob, reference[i, token].item(), abs_tol=tol), i


def assert_bf16_as_close_as_hf(hf, hf16, prompts, outputs, cuda: bool = True) -> None:
    """A bf16 run's log-probabilities against float32 Hugging Face's (`hf`, on the CPU) over the run's own tokens, as
    close as Hugging Face's own bf16 run (`hf16`) is. A near-tie (a router's choice of expert, an e4m3 rounding) can
    go another way in bf16, in either run and at different places, so a few entries may be far: over every prompt's
    entries together, the mean error must be within 2x HF's + 0.02, and at most a tenth of them past HF's largest
    error + 0.05."""
    ours, theirs = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        got = output.outputs[0]
        ids = torch.tensor([prompt + got.token_ids[:-1]])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 :].double(), -1)
            logits16 = hf16(ids.cuda() if cuda else ids).logits[0, len(prompt) - 1 :]
            ref16 = torch.log_softmax(logits16.double(), -1).cpu()
        for step, lps in enumerate(got.logprobs):
            for t, lp in lps.items():
                ours.append(abs(lp.logprob - ref[step, t].item()))
                theirs.append(abs(ref16[step, t].item() - ref[step, t].item()))
    our_errors, their_errors = torch.tensor(ours), torch.tensor(theirs)
    assert our_errors.mean() < 2 * their_errors.mean() + 0.02, (our_errors, their_errors)
    assert (our_errors > their_errors.max() + 0.05).float().mean() <= 0.1, (our_errors, their_errors)


def skip_uninterpreted_triton(backend: str) -> None:
    """Skip a CPU test of the Triton backend where CUDA is: Triton runs on the CPU under its interpreter only, which
    conftest turns on only without a GPU (the GPU tests run those kernels there)."""
    import pytest  # noqa: PLC0415

    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("Triton on the CPU runs under its interpreter, which a GPU machine's run leaves off")
