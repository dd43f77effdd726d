"""MXFP4, the OCP Microscaling format gpt-oss's experts are published in: blocks of 32 values sharing one scale.

    a value   one e2m1 code, 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit
              codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8-15 the same negated
    a byte    two values: the low nibble the even element, the high nibble the odd one
    a scale   e8m0, one byte a block: 2^(s - 127)

    weight [N, K]  ->  blocks [N, K/32, 16] uint8 (the checkpoint's `*_blocks`), scales [N, K/32] uint8 (`*_scales`)
                       w[n, k] = E2M1[nibble k of row n] * 2^(scales[n, k // 32] - 127)

An e2m1 value times a power of two has at most two significant bits, so a dequantized weight is exact in bf16 (and
fp32): the kernels dequantize in registers and lose nothing. Here, the plain-torch forms: the CPU's, the loader's and
the tests'.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing a scale
SCALE_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of MXFP4 rows: `packed` [..., K/2] uint8 (two codes a byte), `scales` [..., K/32] uint8 -> [..., K]
    in `dtype`."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.to(torch.int64)
    values = torch.stack([table[codes & 15], table[codes >> 4]], dim=-1).flatten(-2)  # [..., K]
    factors = torch.exp2(scales.to(torch.float32) - SCALE_BIAS)
    return (values.unflatten(-1, (-1, BLOCK)) * factors[..., None]).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., K] (K a multiple of 32) as MXFP4: (packed [..., K/2] uint8, scales [..., K/32] uint8). Each block's
    scale is the spec's: 2^(floor(log2(its largest magnitude)) - 2), e2m1's largest exponent being 2; each value then
    the nearest e2m1 (past 6: 6)."""
    w = weight.to(torch.float32).unflatten(-1, (-1, BLOCK))
    amax = w.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, -SCALE_BIAS)
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = w / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # (ties: the smaller magnitude)
    codes = (nearest + 8 * (scaled < 0)).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)
