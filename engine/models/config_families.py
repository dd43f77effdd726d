"""Each family's fields of ModelConfig, read from its Hugging Face config: Gemma 2/3/4's, the Gated DeltaNet
hybrids', gpt-oss's and the mixtures of experts'; the RoPE parameters and the config a layer's heads are read from."""

from __future__ import annotations

from typing import Any

from kiln.engine.models.quant_config import quant_method

# the attention of each mixture of experts is its dense sibling's
ATTENTION_OF = {
    "MixtralForCausalLM": "MistralForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
}


def sliding_layer_config(hf_config: Any) -> Any:
    """The config to read a layer's heads from: the config itself, or where transformers 5 states them per layer (a
    heterogeneous config: Gemma 4's `per_layer_config`, which refuses a global read) its first sliding layer's."""
    if not getattr(hf_config, "is_heterogeneous", False):
        return hf_config
    layer_types = getattr(hf_config, "layer_types", None) or []
    return hf_config.per_layer_config[next((i for i, t in enumerate(layer_types) if t == "sliding_attention"), 0)]


def rope_parameters(rope: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling or None) from a config's RoPE parameters."""
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return theta, None if rope_type == "default" else {**rope, "rope_type": rope_type}


def gemma_fields(hf_config: Any, local_rope: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 2's, 3's and 4's fields (see ModelConfig): Gemma 3's and 4's sliding layers' RoPE is `local_rope`
    (transformers 5) or rope_local_base_freq (4.x); Gemma 2 has one RoPE, and soft-caps."""
    local_theta, local_scaling = 0.0, None
    if local_rope is not None:
        local_theta, local_scaling = rope_parameters(local_rope, 10000.0)
    elif getattr(hf_config, "rope_local_base_freq", None):
        local_theta = float(hf_config.rope_local_base_freq)
    gemma = dict(
        final_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
        embed_scale=hf_config.hidden_size**0.5,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )
    if hf_config.model_type == "gemma4_text":
        return {**gemma, **gemma4_fields(hf_config)}
    return dict(
        **gemma,
        attn_softcap=float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0),
        sandwich_norms=True,
        norm_weight_offset=1.0,
        attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
    )


def hybrid_fields(hf_config: Any, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """A Gated DeltaNet hybrid's fields (see ModelConfig); its norms scale by 1 + weight, as Gemma's, and its q and k
    are normed per head. Text positions only: mRoPE's three sections then rotate alike, as one RoPE."""
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        interval = getattr(hf_config, "full_attention_interval", 4)
        kinds = ("linear_attention", "full_attention")
        layer_types = [kinds[(i + 1) % interval == 0] for i in range(hf_config.num_hidden_layers)]
    unknown = set(layer_types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported: Kiln's hybrids have linear and full layers")
    factor = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return dict(
        linear_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
        linear_num_key_heads=hf_config.linear_num_key_heads,
        linear_num_value_heads=hf_config.linear_num_value_heads,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        attn_output_gate=bool(getattr(hf_config, "attn_output_gate", True)),
        rotary_dim=int(head_dim * float(factor)),
        norm_weight_offset=1.0,
    )


def refuse_gemma_variants(hf_config: Any, arch: str) -> None:
    """What Kiln's Gemma does not compute, refused in one line rather than served wrong. Gemma 4's "vision" makes
    only image tokens attend both ways: text alone is causal, as Kiln serves it."""
    bidirectional = getattr(hf_config, "use_bidirectional_attention", None)
    if bidirectional and not (arch == "Gemma4ForCausalLM" and bidirectional == "vision"):
        raise ValueError(f"use_bidirectional_attention={bidirectional!r} is not supported: Kiln's attention is causal")


def gemma4_fields(hf_config: Any) -> dict[str, Any]:
    """Gemma 4's fields (see ModelConfig). Its norms scale by their weight as it is (no 1 +), its attention by 1.0 (q
    and k are normed), and its full layers' heads may be wider and fewer: transformers 5 states them per layer
    (`per_layer_config`), the checkpoints' configs as `global_head_dim` and `num_global_key_value_heads`."""
    layer_types = list(hf_config.layer_types)
    sliding = sliding_layer_config(hf_config)
    head_dim, kv_heads = sliding.head_dim, sliding.num_key_value_heads
    if getattr(hf_config, "is_heterogeneous", False):
        full = hf_config.per_layer_config[layer_types.index("full_attention")]
        global_head_dim, global_kv_heads = full.head_dim, full.num_key_value_heads
    else:
        global_head_dim = getattr(hf_config, "global_head_dim", None) or head_dim
        global_kv_heads = kv_heads
        if hf_config.attention_k_eq_v and getattr(hf_config, "num_global_key_value_heads", None):
            global_kv_heads = hf_config.num_global_key_value_heads
    shared = hf_config.num_kv_shared_layers or 0
    if shared:
        kinds = set(layer_types[: hf_config.num_hidden_layers - shared])
        if kinds != set(layer_types):
            raise ValueError(
                f"num_kv_shared_layers={shared} leaves no earlier layer of each kind to share the KV of (layer_types "
                f"{sorted(kinds)} before them)"
            )
    per_layer_input = hf_config.hidden_size_per_layer_input or 0
    experts = {}
    if hf_config.enable_moe_block:
        experts = dict(
            num_experts=hf_config.num_experts,
            num_experts_per_tok=hf_config.top_k_experts,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            moe_layers=tuple(range(hf_config.num_hidden_layers)),
            norm_topk_prob=True,
        )
    return dict(
        norm_weight_offset=0.0,
        attn_scale=1.0,
        global_head_dim=global_head_dim if global_head_dim != head_dim else 0,
        num_global_kv_heads=global_kv_heads if global_kv_heads != kv_heads else 0,
        attention_k_eq_v=bool(hf_config.attention_k_eq_v),
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(hf_config.use_double_wide_mlp) and shared > 0,
        per_layer_input_size=per_layer_input,
        per_layer_vocab_size=hf_config.vocab_size_per_layer_input if per_layer_input else 0,
        **experts,
    )


def gpt_oss_fields(hf_config: Any) -> dict[str, Any]:
    """gpt-oss's fields (see ModelConfig): every layer sparse, the top-k logits' softmax (the top-k of the whole
    softmax, renormalised), the experts `intermediate_size` wide."""
    return dict(
        num_experts=hf_config.num_local_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.intermediate_size,
        moe_layers=tuple(range(hf_config.num_hidden_layers)),
        norm_topk_prob=True,
        # (OpenAI's config.json and older transformers name no alpha: 1.702 is the reference code's constant)
        swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
        swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)),
        attention_sinks=True,
        mxfp4_experts=quant_method(getattr(hf_config, "quantization_config", None)) == "mxfp4",
    )


def expert_fields(arch: str, hf_config: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of `arch`'s config (none for a dense model)."""
    if arch not in ATTENTION_OF and arch not in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        return {}
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    if num_experts == 0:  # (Qwen's MoE configs allow it: every layer dense)
        return {}
    top_k = hf_config.num_experts_per_tok
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {num_experts}]")
    every_layer = tuple(range(hf_config.num_hidden_layers))
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    if arch == "MixtralForCausalLM":  # every layer sparse; the top-k weights always renormalised
        inter, layers, renormalise, shared = hf_config.intermediate_size, every_layer, True, 0
    elif arch == "Qwen3_5MoeForCausalLM":  # every layer sparse, the top-k renormalised, a gated shared expert
        inter, layers, renormalise = hf_config.moe_intermediate_size, every_layer, True
    else:
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        inter = hf_config.moe_intermediate_size
        layers = tuple(i for i in every_layer if i not in dense and (i + 1) % step == 0)
        renormalise = bool(getattr(hf_config, "norm_topk_prob", False))
        shared = shared if arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM") else 0
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        moe_layers=layers,
        norm_topk_prob=renormalise,
        shared_expert_intermediate_size=shared,
    )
