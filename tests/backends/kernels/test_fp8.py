"""The FP8 linear layer's GPU forms against its plain-torch reference (`kiln::fp8_linear`, fp8.py): the one-row
matmul under Triton's interpreter (on the GPU, the kernel itself) for every scale layout and activation rounding;
the activations' one-launch rounding and the block-scaled matmul past one row likewise; and on the GPU
`torch._scaled_mm` and the float32 fallback past one row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.backends.kernels.fp8 import dequantize_weight, fp8_linear, fp8_linear_reference, quantize_activations
from kiln.backends.kernels.fp8_block import block_fp8_linear
from kiln.backends.kernels.fp8_gemv import _round_e4m3, fp8_gemv
from kiln.backends.kernels.fp8_quant import quantize_groups, quantize_rows
from kiln.engine.models.layers import RotaryEmbedding, _rotate

from helpers.kernels import DEVICE

FP8_MAX = 448.0


def _layer(n: int, k: int, block: tuple[int, int] | None, generator: torch.Generator):
    """(e4m3 weights, float32 scales): a scale per row, or per block."""
    w = torch.randn(n, k, generator=generator) * 0.05
    if block is None:
        scale = w.abs().amax(dim=1) / FP8_MAX
        return (w / scale[:, None]).to(torch.float8_e4m3fn), scale
    rows, cols = -(-n // block[0]), -(-k // block[1])
    scale = torch.rand(rows, cols, generator=generator) * 1e-3 + 1e-4
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


CASES = [
    # (N, K, block, activations, bias)
    (96, 256, None, "token", False),
    (100, 200, None, "token", True),  # N and K past the tiles' multiples
    (64, 128, None, "static", False),
    (64, 128, None, "none", True),
    (80, 256, (16, 64), "group", False),  # a block-scaled layer (N not whole blocks)
    (64, 256, (32, 128), "none", False),
]


@pytest.mark.parametrize("n,k,block,activations,bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_fp8_gemv_against_the_reference(n, k, block, activations, bias, dtype):
    generator = torch.Generator().manual_seed(n + k)
    weight, scale = _layer(n, k, block, generator)
    x = torch.randn(1, k, generator=generator) * 2
    b = torch.randn(n, generator=generator) if bias else None
    input_scale = torch.tensor([0.01]) if activations == "static" else None
    block_n, block_k = block or (0, 0)
    args = [t.to(DEVICE) if t is not None else None for t in (x.to(dtype), weight, scale, input_scale, b)]
    args[4] = args[4].to(dtype) if bias else None
    got = fp8_gemv(*args, block_n, block_k, activations)
    want = fp8_linear_reference(*[a.cpu() if a is not None else None for a in args], block_n, block_k, activations)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="torch._scaled_mm and the fallback are the GPU's")
@pytest.mark.parametrize("n,k,block,activations,bias", CASES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_op_on_the_gpu_against_the_reference(n, k, block, activations, bias, rows):
    """Within bf16's output rounding; _scaled_mm's e4m3 inputs are the reference's."""
    generator = torch.Generator().manual_seed(rows + n)
    weight, scale = _layer(n, k, block, generator)
    x = (torch.randn(rows, k, generator=generator) * 2).to(torch.bfloat16)
    b = torch.randn(n, generator=generator).to(torch.bfloat16) if bias else None
    input_scale = torch.tensor([0.01]) if activations == "static" else None
    block_n, block_k = block or (0, 0)
    want = fp8_linear_reference(x, weight, scale, input_scale, b, block_n, block_k, activations)
    cuda = [t.cuda() if t is not None else None for t in (x, weight, scale, input_scale, b)]
    got = fp8_linear(*cuda, block_n, block_k, activations)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)


@triton.jit
def _rounding_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr, HARDWARE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _round_e4m3(tl.load(x_ptr + i), 1.0, HARDWARE))


@pytest.mark.parametrize("hardware", [False] + ([True] if DEVICE == "cuda" else []), ids=lambda h: f"hardware={h}")
def test_the_kernels_e4m3_rounding_is_torchs(hardware):
    """Every value of a dense sweep over e4m3's range (normals, subnormals, ties, carries into the exponent, past
    448) rounds as torch's cast of the clamped value does: the arithmetic form anywhere, the GPU's conversion
    instruction there."""
    x = torch.cat([torch.linspace(-470, 470, 150001), torch.linspace(-0.03, 0.03, 100001)])
    padded = torch.zeros(triton.next_power_of_2(x.numel()))
    padded[: x.numel()] = x
    y = torch.empty_like(padded, device=DEVICE)
    _rounding_kernel[(padded.numel() // 1024,)](padded.to(DEVICE), y, BLOCK=1024, HARDWARE=hardware)
    assert torch.equal(y.cpu(), padded.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("rows,k", [(1, 64), (5, 200), (33, 4096)])
@pytest.mark.parametrize("static", [False, True], ids=["token", "static"])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_quantize_rows_is_the_references_rounding(rows, k, static, dtype):
    """The one-launch activation quantization (`_scaled_mm`'s input): every e4m3 value and scale the reference's
    (`quantize_activations`: the same products for the scales, the same rounding), rows of very different size."""
    generator = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-3, 2, rows)[:, None]).to(dtype)
    input_scale = torch.tensor([0.05]) if static else None
    q, scale = quantize_rows(x.to(DEVICE), input_scale.to(DEVICE) if static else None)
    want = quantize_activations(x, "static" if static else "token", input_scale, 0)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    torch.testing.assert_close((q.float() * scale).cpu(), want, atol=0, rtol=0)
    if not static:
        torch.testing.assert_close(scale.cpu(), x.float().abs().amax(-1, keepdim=True) * (1 / FP8_MAX), atol=0, rtol=0)


@pytest.mark.parametrize("rows,k,group", [(3, 128, 32), (40, 256, 64)])
def test_quantize_groups_is_the_references_rounding(rows, k, group):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator) * torch.logspace(-2, 2, k)[None, :]  # (groups of other sizes)
    q, scale = quantize_groups(x.to(DEVICE), group)
    assert scale.shape == (rows, k // group)
    got = (q.float().unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2)
    torch.testing.assert_close(got.cpu(), quantize_activations(x, "group", None, group), atol=0, rtol=0)


# (16 x 16: the tiny checkpoints' blocks, narrower than the FP8 tensor cores' K of 32)
@pytest.mark.parametrize(
    "rows,n,k,block", [(1, 64, 128, (16, 32)), (7, 80, 256, (16, 64)), (70, 100, 128, (32, 32)), (5, 48, 64, (16, 16))]
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_block_scaled_matmul_against_the_reference(rows, n, k, block, bias):
    """Past one row, a block-scaled layer's matmul (blocks of N not whole, a tile of rows not whole), float32 under
    the interpreter (to the reference's sums), bf16 on the GPU (to its rounding)."""
    generator = torch.Generator().manual_seed(rows + n)
    weight, scale = _layer(n, k, block, generator)
    x = torch.randn(rows, k, generator=generator) * 2
    b = torch.randn(n, generator=generator) if bias else None
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    want = fp8_linear_reference(x.to(dtype), weight, scale, None, b, *block, "group")
    cuda = [t.to(DEVICE) if t is not None else None for t in (x.to(dtype), weight, scale, b)]
    cuda[3] = cuda[3].to(dtype) if bias else None
    got = block_fp8_linear(cuda[0], cuda[1], cuda[2], cuda[3], *block)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def _rows_float64(x, weight, scale, input_scale, bias, block, activations):
    """dequant(x) @ dequant(W)^T (+ b) in float64: what an FP8 layer computes before its output's rounding."""
    block_n, block_k = block or (0, 0)
    xq = quantize_activations(x, activations, input_scale, block_k).double()
    y = xq @ dequantize_weight(weight, scale, block_n, block_k).double().T
    return y if bias is None else y + bias.double()


def _rotated(y, cos, sin, rot_rows):
    """The first rot_rows columns of y rotated as neox RoPE, head by head (the plain form's `_rotate`, in float64)."""
    heads = y[:, :rot_rows].unflatten(1, (-1, 2 * cos.shape[-1]))
    return torch.cat([_rotate(heads, cos.double(), sin.double()).flatten(1), y[:, rot_rows:]], dim=1)


EPILOGUE_CASES = [
    # (activations, block, config): the kernel's default tile, a tile of pairs set, the gate's and up's block scales
    ("token", None, None),
    ("none", None, (2, 32, 4)),
    ("static", None, None),
    ("group", (16, 32), None),
]


@pytest.mark.parametrize("activations,block,config", EPILOGUE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_fp8_gemv_epilogues_against_float64(activations, block, config, dtype):
    """The one-row matmul with its epilogues against float64: SiLU-and-mul of a gate/up layer (the gate's rows, then
    the up's, each with its own scales), and a qkv layer with a bias whose q and k heads RoPE rotates, v's not."""
    generator = torch.Generator().manual_seed(len(activations))
    k = 128
    input_scale = torch.tensor([0.01]) if activations == "static" else None
    x = (torch.randn(1, k, generator=generator) * 2).to(dtype).float()  # (the reference rounds the kernel's x)
    block_n, block_k = block or (0, 0)
    on = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    weight, scale = _layer(96, k, block, generator)  # gate 48 rows, up 48
    got = fp8_gemv(
        on(x.to(dtype)),
        on(weight),
        on(scale),
        on(input_scale),
        None,
        block_n,
        block_k,
        activations,
        config,
        epilogue="silu_mul",
    )
    gate, up = _rows_float64(x, weight, scale, input_scale, None, block, activations).chunk(2, dim=-1)
    assert got.shape == (1, 48) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), F.silu(gate) * up, atol=tol, rtol=tol)

    heads, kv_heads, head_dim = 4, 2, 16
    n, rot_rows = (heads + 2 * kv_heads) * head_dim, (heads + kv_heads) * head_dim
    weight, scale = _layer(n, k, block, generator)
    bias = torch.randn(n, generator=generator).to(dtype).float()
    cos, sin = RotaryEmbedding(head_dim, 64, 10000.0, None).lookup(torch.tensor([37]), dtype)
    cos, sin = cos.float(), sin.float()
    got = fp8_gemv(
        on(x.to(dtype)),
        on(weight),
        on(scale),
        on(input_scale),
        on(bias.to(dtype)),
        block_n,
        block_k,
        activations,
        config,
        epilogue="rope",
        cos=on(cos.to(dtype)),
        sin=on(sin.to(dtype)),
        rot_rows=rot_rows,
    )
    want = _rotated(_rows_float64(x, weight, scale, input_scale, bias, block, activations), cos, sin, rot_rows)
    assert got.shape == (1, n)
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the ops' GPU forms")
@pytest.mark.parametrize("activations,block,config", EPILOGUE_CASES[:1] + EPILOGUE_CASES[3:])
@pytest.mark.parametrize("rows", [1, 7])
def test_the_epilogue_ops_on_the_gpu_against_float64(activations, block, config, rows):
    """`kiln::fp8_linear_silu_mul` and `kiln::fp8_linear_rope` in bf16: the one-row kernel for one row, the FP8
    matmul and the SiLU-and-mul or rotary kernel past it; each within bf16's rounding of float64."""
    generator = torch.Generator().manual_seed(rows)
    k, block_n, block_k = 256, *(block or (0, 0))
    x = (torch.randn(rows, k, generator=generator) * 2).to(torch.bfloat16)
    weight, scale = _layer(128, k, block, generator)
    got = torch.ops.kiln.fp8_linear_silu_mul(
        x.cuda(), weight.cuda(), scale.cuda(), None, None, block_n, block_k, activations
    )
    gate, up = _rows_float64(x, weight, scale, None, None, block, activations).chunk(2, dim=-1)
    torch.testing.assert_close(got.cpu().double(), F.silu(gate) * up, atol=3e-2, rtol=2e-2)
    head_dim, rot_rows = 32, 96
    cos, sin = RotaryEmbedding(head_dim, 64, 10000.0, None).lookup(torch.arange(rows) * 5, torch.bfloat16)
    got = torch.ops.kiln.fp8_linear_rope(
        x.cuda(),
        weight.cuda(),
        scale.cuda(),
        None,
        None,
        block_n,
        block_k,
        activations,
        cos.cuda(),
        sin.cuda(),
        rot_rows,
    )
    want = _rotated(_rows_float64(x, weight, scale, None, None, block, activations), cos, sin, rot_rows)
    torch.testing.assert_close(got.cpu().double(), want, atol=3e-2, rtol=2e-2)
