"""The few architecture facts a Kiln model needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    sliding_window: int | None = None  # some layers attend this many tokens back only (not implemented: max_context)

    @classmethod
    def from_hf(cls, hf_config: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a `transformers` config (4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        archs = getattr(hf_config, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; Kiln supports {list(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        activation = getattr(hf_config, "hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act {activation!r} is not supported: Kiln's MLP is SiLU-and-mul")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported: Kiln's MLP projections have no bias")
        # Mistral: every layer slides when sliding_window is set; Qwen2/3: the layers transformers marks so
        layer_types = getattr(hf_config, "layer_types", None)
        slides = "sliding_attention" in layer_types if layer_types else arch == "MistralForCausalLM"
        window = getattr(hf_config, "sliding_window", None) if slides else None
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
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=attention_bias if arch in ("LlamaForCausalLM", "MistralForCausalLM") else False,
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=tuple(eos_token_ids),
            sliding_window=int(window) if window else None,
        )

    @property
    def max_context(self) -> int:
        """The longest context Kiln computes right: the positions (times a linear RoPE's factor, which stretches
        them, as vLLM counts), and no more than a sliding window — Kiln attends to the whole context, which is the
        same as the window's attention only up to the window's length."""
        positions = self.max_position_embeddings
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "linear":
            positions = int(positions * float(self.rope_scaling.get("factor", 1.0)))
        return min(positions, self.sliding_window or positions)
