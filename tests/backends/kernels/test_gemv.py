"""The one-row matmul (`kiln::linear` and its fused forms) against float64 references (Triton's interpreter on CPU),
and the ops' choice of kernel per call, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.kernels import gemv
from kiln.engine.models.layers import RotaryEmbedding, _rotate

from helpers.kernels import DEVICE, DTYPES, close


def matmul_reference(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,config", [(40, 96, None), (33, 100, None), (24, 64, (16, 32, 4)), (7, 48, (1, 16, 1))])
def test_gemv_against_float64(dtype, n, k, config):
    """N not a multiple of the row tile, K a multiple of the K tile or not, with and without bias."""
    torch.manual_seed(n)
    weight = torch.randn(n, k, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    for b in (None, bias):
        out = gemv.gemv(x, weight, b, config)
        assert out.shape == (1, n) and out.dtype == dtype
        close(out, matmul_reference(x, weight, b).to(dtype), dtype)


@pytest.fixture
def gemv_calls(monkeypatch):
    """The shape of x at every call of the one-row kernel (which still runs)."""
    calls, kernel = [], gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append(tuple(a[0].shape)) or kernel(*a))
    return calls


def test_linear_op_takes_the_kernel_for_one_row_and_f_linear_beyond(gemv_calls):
    weight, bias = torch.randn(24, 40, device=DEVICE), torch.randn(24, device=DEVICE)
    for shape in ((1, 40), (1, 1, 40), (2, 40), (9, 40), (40, 2)):
        x = torch.randn(*shape, device=DEVICE)
        x = x.T[:1] if shape == (40, 2) else x  # one row, not contiguous
        out = torch.ops.kiln.linear(x, weight, bias)
        assert out.shape == (*x.shape[:-1], 24)
        close(out, matmul_reference(x, weight, bias).float(), torch.float32)
    assert gemv_calls == [(1, 40), (1, 1, 40)]


def test_linear_op_compiled_by_inductor_chooses_at_run_time(gemv_calls):
    """Traced, `kiln::linear` is an opaque node that Inductor calls as an extern with a symbolic row count:
    the compiled code equals eager, and the one-row kernel runs for one row only, decided per call."""
    weight, bias = torch.randn(24, 40, device=DEVICE), torch.randn(24, device=DEVICE)

    def f(x):
        return torch.relu(torch.ops.kiln.linear(x * 2, weight, bias)) + 1

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for rows in (3, 1, 5):
        x = torch.randn(rows, 40, device=DEVICE)
        close(compiled(x), torch.relu((x * 2).double() @ weight.double().T + bias.double()).float() + 1, torch.float32)
    assert gemv_calls == [(1, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_gemv_on_gpu_at_model_shapes(n, k):
    """bf16 at the 0.6-1B models' layer shapes, default configs, against float64 and beside cuBLAS."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = matmul_reference(x, weight, None)
    ours, cublas = gemv.gemv(x, weight), torch.nn.functional.linear(x, weight)
    # within a bf16 rounding of the exact result, as cuBLAS is
    torch.testing.assert_close(ours.double(), ref, atol=2e-2, rtol=1e-2)
    assert (ours.double() - ref).abs().max() <= 2 * (cublas.double() - ref).abs().max() + 1e-3


def silu_mul_reference(x, weight):
    gate, up = matmul_reference(x, weight, None).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_reference(x, weight, bias, cos, sin, rot_rows):
    """F.linear in float64, then the first rot_rows columns rotated per head (the plain form's `_rotate`)."""
    y = matmul_reference(x, weight, bias)
    heads = y[:, :rot_rows].unflatten(1, (-1, 2 * cos.shape[-1]))
    return torch.cat([_rotate(heads, cos.double(), sin.double()).flatten(1), y[:, rot_rows:]], dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,config", [(48, 96, None), (34, 100, None), (64, 64, (4, 32, 4)), (14, 48, (1, 16, 1))])
def test_gemv_silu_mul_against_float64(dtype, n, k, config):
    """The gate's rows then the up's in one weight, N/2 outputs not a multiple of the row tile, K a multiple of
    the K tile or not."""
    torch.manual_seed(n)
    weight, x = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5, torch.randn(1, k, device=DEVICE, dtype=dtype)
    out = gemv.gemv_silu_mul(x, weight, config)
    assert out.shape == (1, n // 2) and out.dtype == dtype
    close(out, silu_mul_reference(x, weight).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,k,config",
    [(4, 2, 16, 96, None), (2, 1, 24, 100, None), (4, 1, 8, 64, (2, 32, 4)), (3, 3, 12, 48, (8, 16, 1))],
)
def test_gemv_rope_against_float64(dtype, heads, kv_heads, head_dim, k, config):
    """q, k and v rows of a fused projection with a bias; q's and k's heads rotated by the token's cos, sin, v's
    not; head_dim/2 not a power of two (12), a program's pairs spanning heads (8 pairs of 4-row halves)."""
    torch.manual_seed(head_dim)
    n, rot_rows = (heads + 2 * kv_heads) * head_dim, (heads + kv_heads) * head_dim
    weight, bias = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5, torch.randn(n, device=DEVICE, dtype=dtype)
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    cos, sin = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE).lookup(torch.tensor([37], device=DEVICE), dtype)
    out = gemv.gemv_rope(x, weight, bias, cos, sin, rot_rows, config)
    assert out.shape == (1, n) and out.dtype == dtype
    close(out, rope_reference(x, weight, bias, cos, sin, rot_rows).to(dtype), dtype)


def test_fused_projection_ops_take_the_kernel_for_one_row_only_and_compile(monkeypatch):
    """`kiln::linear_silu_mul` and `kiln::linear_rope`: the one-row kernels for one row, F.linear and the SiLU or
    rotary kernel beyond; equal to the float64 references either way, eager and compiled by Inductor with a
    symbolic row count."""
    calls = []
    for name in ("gemv_silu_mul", "gemv_rope"):
        kernel = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    torch.manual_seed(0)
    head_dim, rot_rows = 8, 48
    weight, bias = torch.randn(64, 40, device=DEVICE) / 40**0.5, torch.randn(64, device=DEVICE)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)

    def both(x, cos, sin):
        rotated = torch.ops.kiln.linear_rope(x, weight, bias, cos, sin, rot_rows)
        return torch.ops.kiln.linear_silu_mul(x, weight), rotated

    compiled = torch.compile(both, fullgraph=True, dynamic=True)
    for rows in (3, 1, 5, 1):
        x = torch.randn(rows, 40, device=DEVICE)
        cos, sin = rope.lookup(torch.arange(rows, device=DEVICE) * 7, torch.float32)
        for fn in (both, compiled):
            silu_mul, rotated = fn(x, cos, sin)
            close(silu_mul, silu_mul_reference(x, weight).float(), torch.float32)
            close(rotated, rope_reference(x, weight, bias, cos, sin, rot_rows).float(), torch.float32)
    assert sorted(calls) == ["gemv_rope"] * 4 + ["gemv_silu_mul"] * 4  # (Inductor may order the two either way)


def add_norm_reference(x, residual, norm_weight, eps):
    """(rms_norm(x + residual) * norm_weight in float64, x + residual in x's dtype)."""
    h = x + residual
    h64 = h.double()
    return h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double(), h


def projection_reference(x, weight, bias, epilogue, cos, sin, rot_rows):
    if epilogue == "silu_mul":
        return silu_mul_reference(x, weight)
    if epilogue == "rope":
        return rope_reference(x, weight, bias, cos, sin, rot_rows)
    return matmul_reference(x, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue", ["", "silu_mul", "rope"])
@pytest.mark.parametrize("k,config", [(100, None), (96, (2, 32, 4))])
def test_add_norm_linear_op_one_row_and_beyond_eager_and_compiled(monkeypatch, dtype, epilogue, k, config):
    """`kiln::add_norm_linear`: the projection of rms_norm(x + residual), and x + residual, against float64; one
    row takes the one-row kernel with the norm inside it (K in one or several chunks, a multiple of the chunk or
    not), more rows the add + norm kernel then the projection; eager and compiled by Inductor with a symbolic row
    count."""
    launches = []
    launch = gemv._launch
    monkeypatch.setattr(
        gemv, "_launch", lambda *a, **kw: launches.append(kw.get("norm") is not None) or launch(*a, **kw)
    )
    if config is not None:
        monkeypatch.setattr(gemv, "default_config", lambda n, k: config)
    torch.manual_seed(k)
    head_dim, rot_rows, eps = 8, 48, 1e-5
    weight = torch.randn(64, k, device=DEVICE, dtype=dtype) / k**0.5
    bias = torch.randn(64, device=DEVICE, dtype=dtype) if epilogue != "silu_mul" else None
    norm_weight = torch.randn(k, device=DEVICE, dtype=dtype)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)

    def op(x, residual, cos, sin):
        return torch.ops.kiln.add_norm_linear(x, residual, norm_weight, eps, weight, bias, epilogue, cos, sin, rot_rows)

    # each case's `op` closes over new weights, a recompile of the same code: without a reset, the cases past
    # Dynamo's recompile limit (8) would fail with fullgraph
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True, dynamic=True)
    for rows in (3, 1, 5, 1):
        x, residual = (torch.randn(rows, k, device=DEVICE, dtype=dtype) for _ in range(2))
        cos, sin = rope.lookup(torch.arange(rows, device=DEVICE) * 7, dtype)
        normed, h_ref = add_norm_reference(x, residual, norm_weight, eps)
        ref = projection_reference(normed, weight, bias, epilogue, cos, sin, rot_rows)
        for fn in (op, compiled):
            y, h = fn(x, residual, cos, sin)
            assert y.dtype == h.dtype == dtype and y.shape == ref.shape
            close(h, h_ref, dtype)
            close(y, ref.to(dtype), dtype)
    assert launches.count(True) == 4  # the one-row calls, eager and compiled, and no other call has the norm


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b"])
def test_fused_one_row_kernels_on_gpu_at_model_shapes(model, monkeypatch):
    """bf16 at the presets' gate_up and qkv shapes, default configs, against float64 (the norm inside the matmul
    at every K, not only where the model puts it)."""
    monkeypatch.setattr(gemv, "NORM_MAX_K", 1 << 30)
    from kiln.engine.models.presets import PRESETS

    p = PRESETS[model]
    hidden, head_dim = p["hidden_size"], p.get("head_dim", p["hidden_size"] // p["num_attention_heads"])
    q, kv = p["num_attention_heads"] * head_dim, p["num_key_value_heads"] * head_dim
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(2 * p["intermediate_size"], hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    torch.testing.assert_close(
        gemv.gemv_silu_mul(x, gate_up).double(), silu_mul_reference(x, gate_up), atol=2e-2, rtol=2e-2
    )
    qkv = torch.randn(q + 2 * kv, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None).to("cuda")
    cos, sin = rope.lookup(torch.tensor([3001], device="cuda"), torch.bfloat16)
    torch.testing.assert_close(
        gemv.gemv_rope(x, qkv, None, cos, sin, q + kv).double(),
        rope_reference(x, qkv, None, cos, sin, q + kv),
        atol=3e-2,
        rtol=2e-2,
    )
    # the layer norm inside the matmul (x + residual of a real scale: the residual stream grows layer by layer)
    x, residual = (torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(2))
    norm_weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    normed, h_ref = add_norm_reference(x, residual, norm_weight, 1e-6)
    y, h = gemv.add_norm_linear(x, residual, norm_weight, 1e-6, gate_up, epilogue="silu_mul")
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(y.double(), silu_mul_reference(normed, gate_up), atol=2e-2, rtol=2e-2)
    y, h = gemv.add_norm_linear(x, residual, norm_weight, 1e-6, qkv, None, "rope", cos, sin, q + kv)
    torch.testing.assert_close(y.double(), rope_reference(normed, qkv, None, cos, sin, q + kv), atol=3e-2, rtol=2e-2)
