"""`kiln::fp8_linear`: a linear layer with FP8 e4m3 weights (engine/models/quantization.py says which formats).

    fp8_linear(x [.., K], weight [N, K] e4m3, weight_scale, input_scale?, bias?, block_n, block_k, activations)
        weight_scale: [N] a scale an output row (block_n = 0), or [N / block_n, K / block_k] a scale a block
        activations:  how x is quantized to e4m3 first, as the checkpoint was calibrated: "static" (by input_scale),
                      "token" (a scale a row, its largest |x| / 448), "group" (a scale a row and block_k columns),
                      "none" (x stays in its dtype)
        -> [.., N] in x's dtype:  dequant(x) @ dequant(weight)^T + bias, in float32

One opaque op (Dynamo traces past it, as it does the attention). On the GPU (`fp8_linear`): one row takes the FP8
one-row matmul (fp8_gemv.py); more rows with a scale per output row and activations per token or static take
`torch._scaled_mm` (x rounded to e4m3 in one launch, fp8_quant.py; e4m3 x e4m3 on the tensor cores, a scale per row
of each side; N and K multiples of 16, as cuBLAS takes them, bf16 out); block-scaled layers take the block-scaled
matmul (fp8_block.py); the rest (weight-only layers, blocks of other shapes) the reference, in float32.
`fp8_linear_reference` is the plain form, the CPU's, and the reference the tests hold every path to.
`kiln::fp8_linear_silu_mul` and `kiln::fp8_linear_rope` are the GPU's gate/up and qkv layers with their epilogues,
inside the one-row matmul for one row, as the 16-bit layers' `kiln::linear_silu_mul` and `kiln::linear_rope` are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.backends.kernels.ops import define

FP8_MAX = 448.0
# an activation's scale is its largest |x| times this: a product, as torch's CUDA division by a scalar is, so that
# the CPU, torch on the GPU and the kernels all give the same scale (a quotient can be an ulp away, and move a
# value's e4m3 rounding)
INV_FP8_MAX = 1.0 / FP8_MAX
_TINY = torch.finfo(torch.float32).tiny


def quantize_activations(x: torch.Tensor, activations: str, input_scale: torch.Tensor | None, group: int):
    """x rounded through e4m3 as `activations` says, back in float32 (what an FP8 matmul of x computes with). x / scale
    is x times 1 / scale, as the kernels compute it (both products IEEE-rounded on every device)."""
    x32 = x.float()
    if activations == "none":
        return x32
    if activations == "static":
        scale = input_scale.float().reshape(())
    elif activations == "token":
        scale = (x32.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=_TINY)
    else:  # "group": a scale a row and `group` columns
        grouped = x32.unflatten(-1, (-1, group))
        scale = (grouped.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=_TINY)
        return (_round(grouped * (1 / scale)) * scale).flatten(-2)
    return _round(x32 * (1 / scale)) * scale


def _round(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The float32 weights: each e4m3 value times its row's (or its block's) scale."""
    w = weight.float()
    if block_n == 0:
        return w * weight_scale.float()[:, None]
    n, k = w.shape
    scale = weight_scale.float().repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return w * scale


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    activations: str,
) -> torch.Tensor:
    x32 = quantize_activations(x, activations, input_scale, block_k)
    w32 = dequantize_weight(weight, weight_scale, block_n, block_k)
    return F.linear(x32, w32, None if bias is None else bias.float()).to(x.dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    activations: str,
) -> torch.Tensor:
    """The op: the GPU's forms (see the module's docstring), or the reference."""
    args = (x, weight, weight_scale, input_scale, bias, block_n, block_k, activations)
    if not x.is_cuda:
        return fp8_linear_reference(*args)
    if x.numel() == x.shape[-1]:
        from kiln.backends.kernels.fp8_gemv import fp8_gemv  # noqa: PLC0415  (Triton only where there is a GPU)

        return fp8_gemv(*args).view(*x.shape[:-1], weight.shape[0])
    n, k = weight.shape
    # cuBLAS's FP8 GEMM with a scale a row: N and K multiples of 16, a bf16 output
    cublas = n % 16 == 0 and k % 16 == 0 and x.dtype == torch.bfloat16
    if block_n == 0 and activations in ("token", "static") and cublas:
        return _scaled_mm(x, weight, weight_scale, input_scale, bias, activations)
    if block_n and activations == "group" and block_k >= 16 and block_k & (block_k - 1) == 0:
        from kiln.backends.kernels.fp8_block import block_fp8_linear  # noqa: PLC0415

        return block_fp8_linear(x, weight, weight_scale, bias, block_n, block_k)
    return fp8_linear_reference(*args)


def _scaled_mm(x, weight, weight_scale, input_scale, bias, activations: str) -> torch.Tensor:
    from kiln.backends.kernels.fp8_quant import quantize_rows  # noqa: PLC0415  (Triton only where there is a GPU)

    x2 = x.reshape(-1, x.shape[-1])
    xq, scale = quantize_rows(x2.contiguous(), input_scale if activations == "static" else None)
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale, scale_b=weight_scale.float().view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_linear_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    activations: str,
) -> torch.Tensor:
    """silu(gate) * up of an FP8 gate/up layer (the gate's rows, then the up's) on the GPU: for one row the one-row
    matmul with the SiLU-and-mul inside it (a batch-1 step launches no kernel for it), else `fp8_linear` and the
    SiLU-and-mul kernel."""
    from kiln.backends.kernels import fused  # noqa: PLC0415  (Triton only where there is a GPU)
    from kiln.backends.kernels.fp8_gemv import fp8_gemv  # noqa: PLC0415

    args = (x, weight, weight_scale, input_scale, bias, block_n, block_k, activations)
    if x.numel() == x.shape[-1]:
        return fp8_gemv(*args, epilogue="silu_mul").view(*x.shape[:-1], weight.shape[0] // 2)
    return fused.silu_and_mul(fp8_linear(*args)).view(*x.shape[:-1], weight.shape[0] // 2)


def fp8_linear_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    activations: str,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot_rows: int,
) -> torch.Tensor:
    """An FP8 qkv layer's [T, N] with neox RoPE on its first rot_rows columns (heads of cos.shape[-1] * 2, token t
    rotated by cos[t], sin[t]) on the GPU: for one row the one-row matmul with the rotary inside it, else
    `fp8_linear` and the rotary kernel in place (`kiln::linear_rope`'s two forms, gemv.py)."""
    from kiln.backends.kernels.fp8_gemv import fp8_gemv  # noqa: PLC0415  (Triton only where there is a GPU)
    from kiln.backends.kernels.gemv import rotate_leading  # noqa: PLC0415

    args = (x, weight, weight_scale, input_scale, bias, block_n, block_k, activations)
    if x.numel() == x.shape[-1]:
        y = fp8_gemv(*args, epilogue="rope", cos=cos, sin=sin, rot_rows=rot_rows)
        return y.view(*x.shape[:-1], weight.shape[0])
    return rotate_leading(fp8_linear(*args), cos, sin, rot_rows)


def _fake(x, weight, *args) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


define(
    "fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, int block_n, "
    "int block_k, str activations) -> Tensor",
    fp8_linear,
    _fake,
)
define(
    "fp8_linear_silu_mul(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
    "int block_n, int block_k, str activations) -> Tensor",
    fp8_linear_silu_mul,
    lambda x, weight, *args: x.new_empty(*x.shape[:-1], weight.shape[0] // 2),
)
define(
    "fp8_linear_rope(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, int block_n, "
    "int block_k, str activations, Tensor cos, Tensor sin, int rot_rows) -> Tensor",
    fp8_linear_rope,
    _fake,
)
