"""FP8 experts (`kiln::fused_moe_fp8`'s GPU form, Triton's interpreter on the CPU) against a float64 loop over the
experts on the same e4m3 values: block-scaled experts (Qwen's FP8 checkpoints: 128 x 128 blocks; smaller ones here)
with activations rounded per token and group, per-channel experts with activations rounded per token; uneven expert
loads, experts no token chose, tied routing, one token and many, every prefill tile; the op from the router's logits
against its plain-torch form, the CPU's; Gemma 4's experts (GELU-tanh, a scale an expert on the routing weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln.backends.kernels.moe_fp8  # noqa: F401  (registers torch.ops.kiln.fused_moe_fp8)
from kiln.backends.kernels.fp8 import quantize_activations
from kiln.backends.kernels.moe_fp8 import fused_moe_fp8_reference
from kiln.backends.kernels.moe_fp8_triton import experts_forward_fp8, fused_moe_fp8
from kiln.backends.kernels.moe_routing import route_reference
from kiln.backends.kernels.moe_triton import tile_config

from helpers.kernels import DEVICE, DTYPES, close

FP8_MAX = 448.0


def _experts(num_experts: int, n: int, k: int, block: tuple[int, int] | None, generator: torch.Generator):
    """(e4m3 weights [E, n, k], float32 scales): [E, n] a scale a row, or [E, n / rows, k / columns] a scale a block
    (random scales, so that each block's matters)."""
    w = torch.randn(num_experts, n, k, generator=generator) * k**-0.5
    if block is None:
        scale = w.abs().amax(dim=2) / FP8_MAX
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale
    rows, columns = block
    scale = torch.rand(num_experts, n // rows, k // columns, generator=generator) * 2e-3 + 2e-4
    full = scale.repeat_interleave(rows, 1).repeat_interleave(columns, 2)
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float64 weights: each e4m3 value times its scale, exactly."""
    if block is None:
        return q.double() * scale.double()[..., None]
    return q.double() * scale.double().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)


def _rounded(x: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x through e4m3 as the experts round their inputs: a scale a token and group of columns, or a token."""
    return quantize_activations(x, "group" if block else "token", None, block[1] if block else 0).double()


def reference(x, w13, s13, w2, s2, weights, experts, block, gelu: bool = False) -> torch.Tensor:
    """The experts in float64 on the e4m3 values: each input rounded as the kernels round it (act from x's dtype);
    the activation SiLU, or GELU's tanh form."""
    w13, w2 = _dequantize(w13, s13, block), _dequantize(w2, s2, block)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert in torch.unique(experts).tolist():
        tokens, slot = torch.where(experts == expert)
        gate, up = (_rounded(x[tokens], block) @ w13[expert].T).chunk(2, dim=-1)
        act = ((F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up).to(x.dtype)
        out.index_add_(0, tokens, (_rounded(act, block) @ w2[expert].T) * weights[tokens, slot, None].double())
    return out


def _routing(num_tokens: int, num_experts: int, top_k: int, kind: str, generator: torch.Generator):
    """(weights [T, k], experts [T, k]) of one kind of load."""
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if kind == "skewed":  # most tokens pick the same few experts; the last experts see none
        logits[:, : top_k + 1] += 4.0
        logits[:, -2:] -= 100.0
    elif kind == "ties":  # every token picks experts 0..k-1 with weight 1/E each
        logits.zero_()
    weights, experts = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights, experts.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k,kind,block",
    [
        (1, 64, 32, 8, 2, "random", (16, 16)),  # a batch-1 decode: k experts, one row each
        (3, 256, 128, 4, 2, "random", (128, 128)),  # Qwen's blocks: two groups of K in gate/up, one in down
        (7, 96, 48, 8, 3, "skewed", (16, 16)),  # K and N not multiples of the tiles; empty experts
        (33, 64, 32, 6, 2, "ties", None),  # every token on the same two experts; a scale a row and a token
        (70, 128, 64, 16, 4, "random", (32, 64)),  # past the decode tile: 280 pairs, BLOCK_N 64
        (5, 64, 32, 4, 1, "random", None),  # top-1
    ],
)
def test_fp8_experts_against_float64(dtype, num_tokens, hidden, inter, num_experts, top_k, kind, block):
    generator = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    w13, s13 = _experts(num_experts, 2 * inter, hidden, block, generator)
    w2, s2 = _experts(num_experts, hidden, inter, block, generator)
    weights, experts = _routing(num_tokens, num_experts, top_k, kind, generator)
    want = reference(x, w13, s13, w2, s2, weights.to(dtype), experts, block)
    block_n, block_k = block or (0, 0)
    args = [t.to(DEVICE) for t in (x, w13, s13, w2, s2, weights.to(dtype), experts)]
    out = experts_forward_fp8(*args, block_n, block_k, "group" if block else "token")
    assert out.shape == x.shape and out.dtype == dtype
    close(out.cpu(), want.to(dtype), dtype)


@pytest.mark.parametrize("num_pairs", [300, 5000, 20000])
@pytest.mark.parametrize("block", [(64, 64), None], ids=["blocks", "rows"])
def test_every_prefill_tile_against_float64(num_pairs, block):
    """The tiles of longer steps (BLOCK_M 16, 64 and 128: 64 x 64 and 128 x 128 blocks of the output, BLOCK_K 64),
    on a few tokens' pairs."""
    generator = torch.Generator().manual_seed(num_pairs)
    num_tokens, hidden, inter, num_experts, top_k = 40, 128, 192, 8, 2
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13, s13 = _experts(num_experts, 2 * inter, hidden, block, generator)
    w2, s2 = _experts(num_experts, hidden, inter, block, generator)
    weights, experts = _routing(num_tokens, num_experts, top_k, "skewed", generator)
    want = reference(x, w13, s13, w2, s2, weights, experts, block)
    config = tile_config(num_pairs, 2 * inter, hidden)
    block_n, block_k = block or (0, 0)
    args = [t.to(DEVICE) for t in (x, w13, s13, w2, s2, weights, experts)]
    out = experts_forward_fp8(*args, block_n, block_k, "group" if block else "token", config=config)
    close(out.cpu(), want.float(), torch.float32)


@pytest.mark.parametrize("block", [(16, 32), None], ids=["blocks", "rows"])
def test_the_op_from_router_logits_against_its_cpu_form(block):
    """`kiln::fused_moe_fp8`'s GPU form end to end (routing included) against its plain-torch form (the CPU's:
    torch's routing, an expert loop through `fp8_linear_reference`), which the op runs on the CPU."""
    generator = torch.Generator().manual_seed(11)
    num_tokens, hidden, inter, num_experts, top_k = 9, 64, 32, 16, 4
    x = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    w13, s13 = _experts(num_experts, 2 * inter, hidden, block, generator)
    w2, s2 = _experts(num_experts, hidden, inter, block, generator)
    block_n, block_k = block or (0, 0)
    activations = "group" if block else "token"
    fp8 = (block_n, block_k, activations)
    cpu = torch.ops.kiln.fused_moe_fp8(x, logits, w13, s13, w2, s2, top_k, True, False, *fp8)
    weights, experts = route_reference(logits, top_k, True, torch.float32)
    assert torch.equal(cpu, fused_moe_fp8_reference(x, w13, s13, w2, s2, weights, experts, *fp8))
    close(cpu, reference(x, w13, s13, w2, s2, weights, experts, block).float(), torch.float32)
    args = [t.to(DEVICE) for t in (x, logits, w13, s13, w2, s2)]
    out = fused_moe_fp8(*args, top_k, True, torch.float32, *fp8)
    close(out.cpu(), cpu, torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 70], ids=["decode", "prefill"])
@pytest.mark.parametrize("block", [(16, 16), None], ids=["blocks", "rows"])
def test_gemma4s_experts_gelu_and_scales_against_float64(num_tokens, block):
    """Gemma 4's FP8 experts (`--quantization fp8`'s: a scale a row and a token; blocks too): GELU's tanh form, the
    renormalised top-k weights in float32 times each chosen expert's scale; the kernels and the op's plain form (the
    CPU's) against float64 on the same e4m3 values."""
    generator = torch.Generator().manual_seed(num_tokens)
    hidden, inter, num_experts, top_k = 64, 48, 8, 2
    x = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    w13, s13 = _experts(num_experts, 2 * inter, hidden, block, generator)
    w2, s2 = _experts(num_experts, hidden, inter, block, generator)
    scales = torch.rand(num_experts, generator=generator) + 0.5
    probs, experts = torch.topk(logits.double().softmax(-1), top_k, dim=-1)
    weights = probs / probs.sum(-1, keepdim=True) * scales.double()[experts]
    want = reference(x, w13, s13, w2, s2, weights, experts, block, gelu=True).float()
    fp8 = (*(block or (0, 0)), "group" if block else "token")
    args = [t.to(DEVICE) for t in (x, logits, w13, s13, w2, s2)]
    out = fused_moe_fp8(*args, top_k, True, torch.float32, *fp8, expert_scales=scales.to(DEVICE), gelu=True)
    close(out.cpu(), want, torch.float32)
    plain = torch.ops.kiln.fused_moe_fp8(x, logits, w13, s13, w2, s2, top_k, True, True, *fp8, scales, True)
    close(plain, want, torch.float32)
    silu = torch.ops.kiln.fused_moe_fp8(x, logits, w13, s13, w2, s2, top_k, True, True, *fp8)
    assert (silu - plain).abs().max() > 1e-2  # (the activation and the scales matter here)
