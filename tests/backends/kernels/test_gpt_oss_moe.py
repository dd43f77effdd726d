"""gpt-oss's experts (`kiln::gpt_oss_moe`): the Triton kernels (Triton's interpreter on a CPU) against a float64 loop
over the experts, their weights 16-bit and MXFP4 (against the dequantized float64 product): uneven expert loads,
experts no token chose, tied routing, one token and many, K not a multiple of the tile, no down bias (a rank that
does not add it), the SwiGLU's clamp biting on both sides; and the MXFP4 format against the OCP table and
transformers' dequantization of OpenAI's layout."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kiln.backends.kernels import mxfp4
from kiln.backends.kernels.gpt_oss_moe import Experts, clamped_swiglu, gpt_oss_moe_reference, route
from kiln.backends.kernels.gpt_oss_moe_triton import _mxfp4_values, gpt_oss_moe, routed_gpt_oss_moe, tile_config

from helpers.kernels import DEVICE, DTYPES, close

ALPHA, LIMIT = 1.702, 1.5  # (a limit the random projections cross both ways)


def _problem(num_tokens, hidden, inter, num_experts, top_k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 2 * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=g) * 0.5
    b2 = torch.randn(num_experts, hidden, generator=g) * 0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if kind == "skewed":  # most tokens on the same few experts, the last ones on none
        logits[:, : top_k + 1] += 4.0
        logits[:, -2:] -= 100.0
    elif kind == "ties":
        logits = torch.zeros(num_tokens, num_experts)
    top, experts = torch.topk(logits, top_k, dim=-1)
    return x, w13, b13, w2, b2, top.softmax(-1), experts.to(torch.int32)


CASES = [
    (1, 64, 32, 4, 2, "random"),  # a batch-1 decode
    (7, 96, 96, 8, 3, "skewed"),  # K not a multiple of 64 (MXFP4's tile); empty experts
    (33, 64, 64, 6, 2, "ties"),  # every token on experts 0 and 1
    (70, 128, 64, 16, 4, "random"),  # past the decode tile: 280 pairs
    (5, 64, 32, 4, 1, "random"),  # top-1
]


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,kind", CASES)
@pytest.mark.parametrize("down_bias", [True, False])
def test_experts_against_float64(fmt, dtype, num_tokens, hidden, inter, num_experts, top_k, kind, down_bias):
    x, w13, b13, w2, b2, weights, experts = _problem(num_tokens, hidden, inter, num_experts, top_k, kind, num_tokens)
    scales = (None, None)
    if fmt == "mxfp4":  # the kernels read the 4-bit bytes; the reference the values they stand for
        (w13, s13), (w2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        scales = (s13, s2)
        dense13, dense2 = mxfp4.dequantize(w13, s13, torch.float64), mxfp4.dequantize(w2, s2, torch.float64)
    else:
        dense13, dense2 = w13.double(), w2.double()
    b2 = b2 if down_bias else None
    dense = Experts(dense13, b13.double(), dense2, None if b2 is None else b2.double(), ALPHA, LIMIT)
    reference = gpt_oss_moe_reference(x.double(), weights.double(), experts, dense)
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    cast = lambda t: None if t is None else on(t if t.dtype == torch.uint8 else t.to(dtype))  # noqa: E731
    layer = Experts(cast(w13), cast(b13), cast(w2), cast(b2), ALPHA, LIMIT, *map(on, scales))
    out = gpt_oss_moe(cast(x), cast(weights), on(experts), layer)
    assert out.shape == x.shape and out.dtype == dtype
    close(out.cpu(), reference.to(dtype), dtype)


@pytest.mark.parametrize("num_pairs", [300, 2000])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_prefill_tiles_against_float64(num_pairs, fmt):
    """The tiles of longer steps (BLOCK_M 16 and 64, BLOCK_K 64: K = 96 leaves a half tile of MXFP4 blocks)."""
    x, w13, b13, w2, b2, weights, experts = _problem(num_pairs // 2, 96, 64, 8, 2, "random", 5)
    assert tile_config(num_pairs, 96, True)["BLOCK_M"] == (16 if num_pairs <= 1024 else 64)
    scales: tuple = (None, None)
    if fmt == "mxfp4":
        (w13, s13), (w2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        scales = (s13, s2)
    dense = Experts(_dense(w13, scales[0]), b13.double(), _dense(w2, scales[1]), b2.double(), ALPHA, LIMIT)
    reference = gpt_oss_moe_reference(x.double(), weights.double(), experts, dense)
    tensors = [t.to(DEVICE) for t in (w13, b13, w2, b2)]
    layer = Experts(*tensors, ALPHA, LIMIT, *(None if s is None else s.to(DEVICE) for s in scales))
    out = gpt_oss_moe(x.to(DEVICE), weights.to(DEVICE), experts.to(DEVICE), layer)
    close(out.cpu(), reference.float(), torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_the_routed_op_against_float64(num_tokens):
    """The op's GPU form from the router's logits (routing and alignment in one launch, the top k of the softmax
    renormalised) against Hugging Face's routing (the softmax of the top k logits) and the float64 experts."""
    x, w13, b13, w2, b2, _, _ = _problem(num_tokens, 64, 64, 8, 2, "random", 11)
    logits = torch.randn(num_tokens, 8, generator=torch.Generator().manual_seed(3)) * 2
    (w13, s13), (w2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
    weights, experts = route(logits.double(), 2)
    dense = Experts(_dense(w13, s13), b13.double(), _dense(w2, s2), b2.double(), ALPHA, LIMIT)
    reference = gpt_oss_moe_reference(x.double(), weights, experts, dense)
    layer = Experts(*(t.to(DEVICE) for t in (w13, b13, w2, b2)), ALPHA, LIMIT, s13.to(DEVICE), s2.to(DEVICE))
    out = routed_gpt_oss_moe(x.to(DEVICE), logits.to(DEVICE), 2, layer)
    close(out.cpu(), reference.float(), torch.float32)
    plain = torch.ops.kiln.gpt_oss_moe(x, logits, 2, w13, b13, w2, b2, ALPHA, LIMIT, s13, s2)  # (the CPU's form)
    close(plain, reference.float(), torch.float32)


def _dense(w: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return w.double() if scales is None else mxfp4.dequantize(w, scales, torch.float64)


def test_the_clamped_swiglu():
    """(up + 1) * g * sigmoid(alpha g), g = min(gate, limit), up within +-limit: as transformers' GptOssExperts."""
    gate = torch.tensor([-9.0, -1.0, 0.0, 1.0, 9.0])
    up = torch.tensor([-9.0, 0.5, 2.0, 9.0, -0.25])
    got = clamped_swiglu(torch.cat([gate, up]), 1.702, 7.0)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(got, (u + 1) * g * torch.sigmoid(1.702 * g))
    assert got[4] == pytest.approx(0.75 * 7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item())


def test_e2m1_values_are_the_ocp_table():
    """Every code of every nibble: sign, two exponent bits (bias 1), one mantissa bit; the low nibble first."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)  # 512 values, 16 blocks
    values = mxfp4.dequantize(packed, torch.full((1, 16), 127, dtype=torch.uint8))
    expected = []
    for byte in range(256):
        for nibble in (byte & 15, byte >> 4):
            sign, exponent, mantissa = nibble >> 3, (nibble >> 1) & 3, nibble & 1
            magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2 ** (exponent - 1)
            expected.append(-magnitude if sign else magnitude)
    assert values.flatten().tolist() == expected


@triton.jit
def _decode_kernel(codes_ptr, scales_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    factor = (tl.load(scales_ptr + offs) << 23).to(tl.float32, bitcast=True)
    values = _mxfp4_values(tl.load(codes_ptr + offs), factor)
    tl.store(out_ptr + offs, values)


def test_the_kernels_decode_is_the_table_at_every_scale():
    """The kernels build each weight's float32 from its code's and scale's bits: every code at scales from 1 (blocks
    of 2^-126, whose halves are subnormal) to 252, as the plain dequantization's values."""
    scales = torch.tensor([1, 2, 3, 64, 100, 120, 125, 126, 127, 128, 129, 140, 180, 200, 250, 252], dtype=torch.int32)
    codes = torch.arange(16, dtype=torch.int32).repeat(len(scales))
    block_scales = scales.repeat_interleave(16)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), block_scales.to(DEVICE), out, N=codes.numel())
    table = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float64)[codes.long()]
    want = table * torch.exp2(block_scales.double() - 127)
    assert out.cpu().double().tolist() == want.tolist()
    assert out.cpu().signbit().tolist() == table.signbit().tolist()  # (-0 stays -0)


def test_scales_are_powers_of_two_from_2_to_the_minus_127():
    """(6 x 2^125 is about the largest that float32 holds, so the top scale tested is 252)"""
    packed = torch.full((1, 48), 0x72, dtype=torch.uint8)  # low nibble 2 (1.0), high 7 (6.0)
    scales = torch.tensor([[0, 127, 252]], dtype=torch.uint8)
    values = mxfp4.dequantize(packed, scales, torch.float64)
    for block, exponent in enumerate((-127, 0, 125)):
        assert values[0, 32 * block : 32 * block + 2].tolist() == [2.0**exponent, 6 * 2.0**exponent]


def test_quantize_keeps_representable_values_and_transformers_reads_the_layout():
    """Values already on the e2m1 grid of their block come back exactly; OpenAI's layout (`*_blocks` [E, N, K/32,
    16], `*_scales` [E, N, K/32]) dequantizes in transformers to the same weights, transposed as it holds them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 10, 96, generator=g) * 0.05
    packed, scales = mxfp4.quantize(weight)
    values = mxfp4.dequantize(packed, scales)
    again = mxfp4.dequantize(*mxfp4.quantize(values))
    assert torch.equal(again, values)
    assert (values - weight).abs().max() <= weight.abs().amax() / 4  # (2 bits of precision: within a half step)
    hf = convert_moe_packed_tensors(packed.unflatten(-1, (-1, 16)), scales, dtype=torch.float32)
    assert torch.equal(hf.transpose(1, 2), values)
