"""Building blocks shared by the models, in plain torch.

Each is written the way Hugging Face computes it (float32 where HF upcasts), so fp32 outputs match
token for token, and so Inductor can fuse it when the model is compiled.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.backends.kernels import fp8, gemv
from kiln.backends.kernels import fused as fused_kernels


class Linear(nn.Linear):
    """nn.Linear without the random init: weights come from a checkpoint or the dummy initialiser, and
    initialising billions of values only to overwrite them costs seconds at start-up."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self)


def project(x: torch.Tensor, layer: nn.Linear, with_bias: bool = True) -> torch.Tensor:
    """x through a linear layer: `linear` of its weights, or `kiln::fp8_linear` when they are FP8 (quantization.py;
    traced, the op; eager, the same function called directly)."""
    bias = layer.bias if with_bias else None
    if getattr(layer, "quant", None) is None:
        return linear(x, layer.weight, bias)
    args = _fp8_args(x, layer, bias)
    return torch.ops.kiln.fp8_linear(*args) if torch.compiler.is_compiling() else fp8.fp8_linear(*args)


def _fp8_args(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> tuple:
    """The arguments `kiln::fp8_linear` (and its forms with epilogues) takes for x through an FP8 layer."""
    quant = layer.quant
    block_n, block_k = quant.block if quant.weights == "block" else (0, quant.block[1] if quant.block else 0)
    input_scale = getattr(layer, "input_scale", None)
    return (x, layer.weight, layer.weight_scale, input_scale, bias, block_n, block_k, quant.activations)


def project_silu_mul(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """silu(gate) * up of a merged gate/up layer: `linear_silu_mul` of its weights, or when they are FP8 on the GPU
    `kiln::fp8_linear_silu_mul` (its one-row matmul with the SiLU-and-mul inside), on the CPU `project`'s output
    and the plain form."""
    if getattr(layer, "quant", None) is None:
        return linear_silu_mul(x, layer.weight)
    if not x.is_cuda:
        return silu_and_mul(project(x, layer))
    args = _fp8_args(x, layer, layer.bias)
    if torch.compiler.is_compiling():
        return torch.ops.kiln.fp8_linear_silu_mul(*args)
    return fp8.fp8_linear_silu_mul(*args)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on the GPU, a kernel of ours for one row (a batch-1 decode; cuBLAS reads the weights at
    8-60% of the bandwidth there) and cuBLAS for the rest. Traced, that choice is the `kiln::linear` op
    (made per call, at run time); eager, the same function called directly, not through the dispatcher."""
    if not x.is_cuda:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.kiln.linear(x, weight, bias)
    return gemv.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the merged gate/up projection (weight: the gate's rows, then the up's). On the GPU the
    same choice as `linear`, with the SiLU-and-mul inside the one-row kernel (a batch-1 step launches no kernel for
    it); traced, the `kiln::linear_silu_mul` op."""
    if not x.is_cuda:
        return silu_and_mul(F.linear(x, weight))
    if torch.compiler.is_compiling():
        return torch.ops.kiln.linear_silu_mul(x, weight)
    return gemv.linear_silu_mul(x, weight)


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    proj: nn.Linear,
    epilogue: str = "",
    rope: Any = None,
    rot_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sub-block's input: `norm(x + residual)` (`norm(x)` without a residual, the first layer's) projected by
    the linear layer `proj`, with the projection's epilogue: "" plain, "silu_mul" (`linear_silu_mul`) or "rope"
    (`kiln::linear_rope`, the rotary by `rope`'s cos, sin, for the compiled GPU pieces only). Returns (the
    projection, the new residual). On the GPU with a residual, the `kiln::add_norm_linear` op: at batch 1 the norm
    inside the one-row matmul (no kernel of its own), beyond it the add + norm kernel and the projection. An FP8
    layer takes the norm, then its projection with the epilogue (`project_silu_mul`, `kiln::fp8_linear_rope`)."""
    weight, bias = proj.weight, proj.bias
    if getattr(proj, "quant", None) is not None:
        if residual is None:
            residual, x = x, norm(x)
        else:
            x, residual = norm(x, residual)
        if epilogue == "silu_mul":
            return project_silu_mul(x, proj), residual
        if epilogue == "rope":
            return torch.ops.kiln.fp8_linear_rope(*_fp8_args(x, proj, bias), *rope, rot_rows), residual
        return project(x, proj), residual
    if x.is_cuda and residual is not None:
        cos, sin = rope if rope is not None else (None, None)
        args = (x, residual, norm.weight, norm.eps, weight, bias, epilogue, cos, sin, rot_rows)
        if torch.compiler.is_compiling():
            return torch.ops.kiln.add_norm_linear(*args)
        return gemv.add_norm_linear(*args)
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm(x, residual)
    if epilogue == "silu_mul":
        return linear_silu_mul(x, weight), residual
    if epilogue == "rope":
        return torch.ops.kiln.linear_rope(x, weight, bias, *rope, rot_rows), residual
    return linear(x, weight, bias), residual


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class FusedKernelsMixin:
    """Layers with two forms: plain torch (CPU, and under torch.compile so Inductor fuses it) and a
    hand-written Triton kernel (eager on the GPU). `use_fused_kernels(model, True)` switches them."""

    fused = False


def use_fused_kernels(model: nn.Module, enabled: bool) -> None:
    for module in model.modules():
        if isinstance(module, FusedKernelsMixin):
            module.fused = enabled


class RMSNorm(FusedKernelsMixin, nn.Module):
    """RMSNorm with an optional fused residual add: `norm(x + residual)`, returning the new residual too."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return fused_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        out = rms_norm(x, self.weight, self.eps)
        return out if residual is None else (out, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dim, in float32, scaled in x's dtype (as HF does); `weight` broadcasts against x."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the merged gate/up projection's output [.., 2N] (the plain form of
    `fused_kernels.silu_and_mul`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of the merged gate/up projection's output [.., 2N]: Gemma's GeGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "proportional":
        return _proportional_inv_freq(head_dim, base, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; Kiln supports default, linear, llama3, proportional and yarn"
    )


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies the cos and sin by (its `attention_factor`, by default 0.1 ln(factor) + 1, as Hugging
    Face computes it); 1 for the other RoPE types."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss, Qwen's long contexts): frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor`, those turning more than `beta_fast` times kept, a linear ramp between (its ends
    rounded outwards unless `truncate` is false, as gpt-oss has it)."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the pair index that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (no division by zero)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _proportional_inv_freq(head_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's full layers: the first `partial_rotary_factor` of the head's frequency pairs turn at the frequencies
    of the whole head's RoPE, the rest not at all (frequency 0: cos 1, sin 0), all divided by `factor`.

        head_dim 512, partial_rotary_factor 0.25: pairs (i, i + 256), i < 64, turn as in RoPE over 512 dims; 192 stay
    """
    rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv_freq = 1.0 / (base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - rotated)])
    return inv_freq / float(scaling.get("factor", 1.0))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band between the two thresholds interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(FusedKernelsMixin, nn.Module):
    """Neox-style RoPE (rotate halves) from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(scaling)
        # NOTE: float32 and not a parameter: the loader never touches it, and `model.to(dtype)` keeps it.
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What `rotate` needs for these positions. The model looks up once per forward and every layer
        rotates with it: the cos and sin rows in the model's dtype ([T, D/2] each; one gather a step, not
        one a layer), or for the Triton kernel, which reads the table itself, the positions."""
        if self.fused:
            return positions
        return self.cos_sin[positions].to(dtype).chunk(2, dim=-1)

    def rotate(self, rope: Any, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D], any token stride. The model passes q and k side by side as one tensor, so
        this is one kernel per layer (Inductor's or the Triton one) rather than one each."""
        if self.fused:
            return fused_kernels.rotary_embedding(x, rope, self.cos_sin)
        return _rotate(x, *rope)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(self.lookup(positions, x.dtype), x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin [T, D/2] already in x's dtype (as Hugging Face casts them before the multiply)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
