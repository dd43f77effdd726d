"""The few architecture facts a Kiln model needs, read once from a Hugging Face config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kiln.engine.models.config_families import (
    ATTENTION_OF,
    expert_fields,
    gemma_fields,
    gpt_oss_fields,
    hybrid_fields,
    refuse_gemma_variants,
    rope_parameters,
    sliding_layer_config,
)
from kiln.engine.models.quant_config import (
    QuantConfig,
    UnsupportedQuantization,
    parse_checkpoint_quantization,
    quant_method,
)

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Gemma4ForCausalLM",
    "GptOssForCausalLM",
)
# Gated DeltaNet hybrids: three of every four layers linear attention with a recurrent state (qwen3_5.py)
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# mixtures whose experts take FP8 weights: moe.py's `Experts` (an FP8 checkpoint's, or `--quantization fp8`'s) and
# Gemma 4's (`--quantization fp8`'s; quantization.py refuses an FP8 checkpoint's)
_FP8_EXPERTS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM")
_FP8_EXPERTS += ("Qwen3NextForCausalLM", "Gemma4ForCausalLM")
# multimodal checkpoints served as their language model (the loader skips the vision tower; warned once)
_LANGUAGE_MODEL_OF = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
_GPT_OSS = "GptOssForCausalLM"  # (gpt_oss.py: attention sinks, biased experts, MXFP4 checkpoints)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}; None = plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...] = field(default=())
    sliding_window: int | None = None  # the layers in `sliding_layers` attend this many tokens back only
    sliding_layers: tuple[int, ...] = field(default=())
    # A mixture of experts (num_experts > 0): the layers in `moe_layers` route each token to `num_experts_per_tok`
    # of `num_experts` SiLU MLPs of `moe_intermediate_size`, the others have the dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = field(default=())
    norm_topk_prob: bool = False  # the top-k routing weights divided by their sum
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an MLP every token takes, scaled by a sigmoid gate
    quantization: QuantConfig | None = None  # FP8 linear layers (the checkpoint's, or --quantization fp8)
    # Gemma: GeGLU, embeddings times sqrt(hidden), a norm after attention and the MLP as well as before (the
    # `sandwich_norms`), every norm's weight 1 + the checkpoint's (`norm_weight_offset`, added at load), q scaled by
    # query_pre_attn_scalar ** -0.5 (`attn_scale`); Gemma 3's sliding layers' RoPE of another base (`local_rope_*`)
    hidden_act: str = "silu"  # "silu" or "gelu_pytorch_tanh", of gate, times up
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    local_rope_theta: float = 0.0  # 0: the sliding layers' RoPE is the others'
    local_rope_scaling: dict[str, Any] | None = None
    attn_softcap: float = 0.0  # Gemma 2: attention scores softcap * tanh(s / softcap) (0: none)
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    # Gated DeltaNet hybrids (Qwen3.5/3.6, Qwen3-Next): the layers in `linear_layers` are linear attention over a
    # recurrent state (value heads of `linear_value_head_dim`, each reading key head h // (values / keys), a causal
    # conv of `linear_conv_kernel_dim` taps before it); the others attend with an output gate (`attn_output_gate`:
    # q_proj yields a sigmoid gate beside each head) and rotate only the first `rotary_dim` dims of a head
    linear_layers: tuple[int, ...] = field(default=())
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False
    rotary_dim: int = 0  # 0: the whole head
    # Gemma 4 (gemma4.py): the full layers' heads are `global_head_dim` wide over `num_global_kv_heads` KV heads (0:
    # the sliding layers' head_dim and num_kv_heads), their value the key's projection (`attention_k_eq_v`); the last
    # `num_kv_shared_layers` layers attend over the KV of the last earlier layer of their kind and hold none, their MLP
    # twice as wide with `double_wide_mlp`; per-layer embeddings of `per_layer_input_size` a layer (0: none) from a
    # table of `per_layer_vocab_size` rows
    global_head_dim: int = 0
    num_global_kv_heads: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # gpt-oss (gpt_oss.py): biases on the router and the experts, whose SwiGLU is clamped at `swiglu_limit` (the gate
    # above, the up projection both sides), gated by sigmoid(`swiglu_alpha` x) and times up + 1; a learned sink a head
    # in each attention's softmax; with `mxfp4_experts` the experts as OpenAI publishes them (e2m1 values, an e8m0
    # scale a 32), kept so on the device
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    attention_sinks: bool = False
    mxfp4_experts: bool = False

    @classmethod
    def from_hf(cls, hf_config: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a `transformers` config (4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        archs = getattr(hf_config, "architectures", None) or []
        quantization = parse_checkpoint_quantization(getattr(hf_config, "quantization_config", None))
        multimodal = next((a for a in archs if a in _LANGUAGE_MODEL_OF), None)
        if multimodal is not None:  # its language model (the loader skips the vision tower)
            logger.warning("%s: serving its language model; the vision tower is ignored", multimodal)
            tied = getattr(hf_config, "tie_word_embeddings", None)
            hf_config, archs = hf_config.get_text_config(), [_LANGUAGE_MODEL_OF[multimodal]]
            if tied is not None:  # (the multimodal config's word, which transformers ties by)
                hf_config.tie_word_embeddings = tied
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; Kiln supports {list(SUPPORTED_ARCHITECTURES)}"
            )
        if quant_method(getattr(hf_config, "quantization_config", None)) == "mxfp4" and arch != _GPT_OSS:
            raise UnsupportedQuantization(f"quantization_config with quant_method 'mxfp4' is gpt-oss's, not {arch}'s")
        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        local_rope = rope.pop("sliding_attention", None)  # Gemma 3: RoPE parameters per layer type
        rope = dict(rope.pop("full_attention", rope))
        rope_theta, rope_scaling = rope_parameters(rope, getattr(hf_config, "rope_theta", 10000.0))
        num_heads = hf_config.num_attention_heads
        heads = sliding_layer_config(hf_config)  # (the full layers' of Gemma 4: gemma4_fields)
        head_dim = getattr(heads, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        attention = ATTENTION_OF.get(arch, arch)
        activation = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
        activation = "silu" if activation == "swish" else activation
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {activation!r} is not supported: Kiln's MLP is SiLU- or GeLU(tanh)-and-mul")
        gemma = arch.startswith("Gemma")
        if gemma:
            refuse_gemma_variants(hf_config, arch)
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported: Kiln's MLP projections have no bias")
        # Mistral: every layer slides when sliding_window is set; Qwen2/3: the layers transformers marks so
        layer_types = getattr(hf_config, "layer_types", None)
        window = getattr(hf_config, "sliding_window", None)
        if layer_types:
            sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        else:
            sliding = tuple(range(hf_config.num_hidden_layers)) if attention == "MistralForCausalLM" else ()
        if not window or not sliding:
            window, sliding = None, ()
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=getattr(hf_config, "intermediate_size", 0) or 0,  # (0: every layer sparse)
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(heads, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf_config, "qkv_bias", True)) if attention == "Qwen2ForCausalLM" else attention_bias,
            o_bias=attention_bias if attention in ("LlamaForCausalLM", "MistralForCausalLM", _GPT_OSS) else False,
            qk_norm=attention in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM")
            or arch in HYBRID_ARCHITECTURES,
            eos_token_ids=tuple(eos_token_ids),
            sliding_window=int(window) if window else None,
            sliding_layers=sliding,
            quantization=quantization,
            hidden_act=activation,
            **(gemma_fields(hf_config, local_rope) if gemma else {}),
            **(hybrid_fields(hf_config, rope, head_dim) if arch in HYBRID_ARCHITECTURES else {}),
            **expert_fields(arch, hf_config),
            **(gpt_oss_fields(hf_config) if arch == _GPT_OSS else {}),
        )

    def __post_init__(self) -> None:
        if self.quantization is not None and self.num_experts and self.architecture not in _FP8_EXPERTS:
            raise ValueError(
                f"FP8 quantization of {self.architecture}'s experts is not supported: serve its 16-bit weights"
            )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that have KV blocks: all but the recurrent ones and those that read another layer's KV."""
        linear = set(self.linear_layers)
        return tuple(layer for layer in range(self.num_layers - self.num_kv_shared_layers) if layer not in linear)

    def kv_source_of(self, layer: int) -> int:
        """The layer whose KV cache `layer` attends over: its own, or for one of the last `num_kv_shared_layers` the
        last layer before them of its kind (sliding or full)."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return layer
        sliding = layer in self.sliding_layers
        return next(i for i in range(first_shared - 1, -1, -1) if (i in self.sliding_layers) == sliding)

    def head_dim_of(self, layer: int) -> int:
        """The width of the layer's attention heads (Gemma 4's full layers: `global_head_dim`)."""
        if self.global_head_dim and layer not in self.sliding_layers:
            return self.global_head_dim
        return self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """The layer's KV heads (Gemma 4's full layers: `num_global_kv_heads`)."""
        if self.num_global_kv_heads and layer not in self.sliding_layers:
            return self.num_global_kv_heads
        return self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def max_context(self) -> int:
        """The longest context the model's positions cover (times a linear RoPE's factor, which stretches them, as
        vLLM counts). An attention backend without sliding windows caps a windowed model at its window
        (engine/core/startup.py `context_length`)."""
        positions = self.max_position_embeddings
        # (Gemma 3's max_position_embeddings already counts its linear RoPE's stretch: 128k, 8 x 16k)
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "linear" and not self.sandwich_norms:
            positions = int(positions * float(self.rope_scaling.get("factor", 1.0)))
        return positions

    @property
    def uniform_window(self) -> int:
        """The window when every layer slides (Mistral-7B-v0.1): the KV blocks behind it can go; else 0."""
        every = len(self.sliding_layers) == self.num_layers
        return self.sliding_window if every and self.sliding_window else 0

    def local_rope_of(self, layer: int) -> bool:
        """Whether the layer's RoPE is the local one (Gemma 3's sliding layers)."""
        return bool(self.local_rope_theta) and layer in self.sliding_layers

    def window_of(self, layer: int) -> int:
        """How many tokens back the layer attends (0: all of them)."""
        return (self.sliding_window or 0) if layer in self.sliding_layers else 0
