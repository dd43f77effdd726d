"""The few architecture facts a Kiln model needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.engine.models.quant_config import QuantConfig, parse_checkpoint_quantization

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# the attention of each mixture of experts is its dense sibling's
_ATTENTION_OF = {
    "MixtralForCausalLM": "MistralForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
}


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

    @classmethod
    def from_hf(cls, hf_config: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a `transformers` config (4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        archs = getattr(hf_config, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; Kiln supports {list(SUPPORTED_ARCHITECTURES)}"
            )
        quantization = parse_checkpoint_quantization(getattr(hf_config, "quantization_config", None))
        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        attention = _ATTENTION_OF.get(arch, arch)
        activation = getattr(hf_config, "hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act {activation!r} is not supported: Kiln's MLP is SiLU-and-mul")
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
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf_config, "qkv_bias", True)) if attention == "Qwen2ForCausalLM" else attention_bias,
            o_bias=attention_bias if attention in ("LlamaForCausalLM", "MistralForCausalLM") else False,
            qk_norm=attention == "Qwen3ForCausalLM",
            eos_token_ids=tuple(eos_token_ids),
            sliding_window=int(window) if window else None,
            sliding_layers=sliding,
            quantization=quantization,
            **_experts(arch, hf_config),
        )

    def __post_init__(self) -> None:
        if self.quantization is not None and self.num_experts:
            raise ValueError("FP8 quantization of a mixture of experts is not supported yet: serve its 16-bit weights")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def max_context(self) -> int:
        """The longest context the model's positions cover (times a linear RoPE's factor, which stretches them, as
        vLLM counts). An attention backend without sliding windows caps a windowed model at its window
        (engine/core/startup.py `context_length`)."""
        positions = self.max_position_embeddings
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "linear":
            positions = int(positions * float(self.rope_scaling.get("factor", 1.0)))
        return positions

    def window_of(self, layer: int) -> int:
        """How many tokens back the layer attends (0: all of them)."""
        return (self.sliding_window or 0) if layer in self.sliding_layers else 0


def _experts(arch: str, hf_config: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of `arch`'s config (none for a dense model)."""
    if arch not in _ATTENTION_OF:
        return {}
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    if num_experts == 0:  # (Qwen's MoE configs allow it: every layer dense)
        return {}
    top_k = hf_config.num_experts_per_tok
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {num_experts}]")
    if arch == "MixtralForCausalLM":  # every layer sparse; the top-k weights always renormalised
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=hf_config.intermediate_size,
            moe_layers=tuple(range(hf_config.num_hidden_layers)),
            norm_topk_prob=True,
        )
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        moe_layers=layers,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0)
        if arch == "Qwen2MoeForCausalLM"
        else 0,
    )
