"""An experiment for gpt-oss's decode: its MXFP4 experts as a GEMV a (token, expert) pair, against the product's grouped
matmul (backends/kernels/gpt_oss_moe_triton.py).

At one token the product's kernel moves a fraction of the bandwidth the 16-bit experts' kernel moves (BENCHMARKS.md,
"gpt-oss"). A decode's expert block is 16 rows for `tl.dot`, one of them real, and each K step's
decoded weights go from registers through shared memory into the tensor cores' operand layout. Here a program takes
one pair and BLOCK_N rows of its expert's weights and reduces in registers instead (as Kiln's dense GEMV does): the
nibbles decoded as the product decodes them (`_mxfp4_values`), each weight then one FMA, no layout conversion, no
alignment of pairs into blocks. If the GPU says it wins at a few tokens, it moves into the product for them.

    python scripts/dev/mxfp4_gemv.py                      # the check against the product's kernel (any machine)
    python scripts/dev/mxfp4_gemv.py --bench --model gpt-oss-20b --tokens 1,2,4,8   # the GPU: µs and GB/s, both

(On the CPU, run it with TRITON_INTERPRET=1.)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from kiln.backends.kernels.gpt_oss_moe import Experts
from kiln.backends.kernels.gpt_oss_moe_triton import _mxfp4_values, gpt_oss_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_gpt_oss_moe import expert_tensors  # noqa: E402


@triton.jit
def _mxfp4_rows(acc, a_even, a_odd, w_rows, s_rows, k0, offs_j, j_ok, n_ok):
    """acc [BLOCK_N] plus the rows at `w_rows` (MXFP4, [BLOCK_N] byte pointers; scales at `s_rows`) times the
    activations' BLOCK_K columns from k0, their even and odd ones ([BLOCK_K / 2] each, float32)."""
    mask = n_ok[:, None] & j_ok[None, :]
    packed = tl.load(w_rows[:, None] + (k0 // 2 + offs_j)[None, :], mask=mask, other=0).to(tl.int32)
    scales = tl.load(s_rows[:, None] + (k0 // 32 + offs_j // 16)[None, :], mask=mask, other=127)
    factor = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    products = (
        _mxfp4_values(packed & 15, factor) * a_even[None, :] + _mxfp4_values(packed >> 4, factor) * a_odd[None, :]
    )
    return acc + tl.sum(products, 1)


@triton.jit
def _mxfp4_gemv(
    a_ptr,  # [rows, K]: x (a pair's row its token: pair // TOP_K) or act (a row a pair)
    w_ptr,  # [E, N_total, K / 2] uint8
    scale_ptr,  # [E, N_total, K / 32] uint8
    bias_ptr,  # [E, N_total]
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    experts_ptr,  # [num_pairs] each pair's expert
    N,
    K,
    up_offset,
    alpha,
    limit,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,
    A_ROWS_ARE_TOKENS: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    row = pair // TOP_K if A_ROWS_ARE_TOKENS else pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_row = a_ptr + row.to(tl.int64) * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
    s_rows = scale_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    offs_j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j_ok = offs_j < (K - k0) // 2
        a_even = tl.load(a_row + k0 + 2 * offs_j, mask=j_ok, other=0.0).to(tl.float32)
        a_odd = tl.load(a_row + k0 + 2 * offs_j + 1, mask=j_ok, other=0.0).to(tl.float32)
        acc = _mxfp4_rows(acc, a_even, a_odd, w_rows, s_rows, k0, offs_j, j_ok, n_ok)
        if SWIGLU:
            up_w = w_rows + up_offset * stride_wn
            up_s = s_rows + up_offset * stride_sn
            acc_up = _mxfp4_rows(acc_up, a_even, a_odd, up_w, up_s, k0, offs_j, j_ok, n_ok)
    bias_row = bias_ptr + expert * stride_be
    acc += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if SWIGLU:
        acc_up += tl.load(bias_row + up_offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def _gemv(a, w, scale, bias, out, experts, top_k, rows_are_tokens, block_n, block_k, swiglu=None, weights=None):
    num_pairs, n = out.shape
    alpha, limit = swiglu or (0.0, 0.0)
    _mxfp4_gemv[(num_pairs, triton.cdiv(n, block_n))](
        a,
        w,
        scale,
        bias,
        out,
        weights if weights is not None else out,
        experts,
        n,
        a.shape[1],
        n if swiglu else 0,
        alpha,
        limit,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        scale.stride(0),
        scale.stride(1),
        bias.stride(0),
        out.stride(0),
        TOP_K=top_k,
        A_ROWS_ARE_TOKENS=rows_are_tokens,
        SWIGLU=swiglu is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def gemv_moe(x, weights, experts, layer: Experts, block_n: int = 16, block_k: int = 128) -> torch.Tensor:
    """gpt-oss's MXFP4 experts for a routing (weights, experts [T, k]), a program a pair and BLOCK_N outputs."""
    w13, w13_bias, w2, w2_bias, alpha, limit, w13_scale, w2_scale = layer
    assert block_k % 64 == 0 and w13_bias is not None and w2_bias is not None  # (whole scale blocks; gpt-oss's biases)
    x = x.contiguous()
    num_tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_pairs, inter = num_tokens * top_k, w13.shape[1] // 2
    flat_experts = experts.flatten().to(torch.int32).contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gemv(x, w13, w13_scale, w13_bias, act, flat_experts, top_k, True, block_n, block_k, swiglu=(alpha, limit))
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten().contiguous()
    _gemv(act, w2, w2_scale, w2_bias, y, flat_experts, top_k, False, block_n, block_k, weights=flat_weights)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def layer_of(tensors: dict[str, torch.Tensor]) -> Experts:
    return Experts(
        tensors["w13"],
        tensors["w13_bias"],
        tensors["w2"],
        tensors["w2_bias"],
        1.702,
        7.0,
        tensors["w13_scale"],
        tensors["w2_scale"],
    )


def routing(num_tokens: int, num_experts: int, top_k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    experts = torch.stack([torch.randperm(num_experts, device=device)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, device=device), -1)
    return weights, experts


def check(device: str) -> None:
    """The GEMV's output against the product kernel's, on small random experts (every code, several scales)."""
    torch.manual_seed(0)
    num_experts, hidden, inter, top_k = 6, 128, 64, 2
    tensors = expert_tensors(num_experts, hidden, inter, "mxfp4", device)
    tensors["w13_scale"] = torch.randint(118, 124, tensors["w13_scale"].shape, dtype=torch.uint8, device=device)
    tensors["w2_scale"] = torch.randint(118, 124, tensors["w2_scale"].shape, dtype=torch.uint8, device=device)
    layer = layer_of(tensors)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for num_tokens in (1, 3, 8):
        x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
        weights, experts = routing(num_tokens, num_experts, top_k, device)
        want = gpt_oss_moe(x, weights.to(dtype), experts, layer).float()
        got = gemv_moe(x, weights.to(dtype), experts, layer).float()
        err = (got - want).abs().max().item() / want.abs().max().item()
        print(f"tokens {num_tokens}: largest difference {err:.2e} of the output's largest value")
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


def bench(model: str, tokens: list[int], configs: list[tuple[int, int]], num_layers: int, device: str) -> None:
    """µs a layer (gate_up and down) and GB/s of the chosen experts' bytes: the product kernel and the GEMV's
    tiles, each in a CUDA graph cycling through `num_layers` layers' weights (the L2 cache holds none)."""
    from kiln.engine.models.source import resolve_model  # noqa: PLC0415

    config = resolve_model(model).model_config
    e, hidden, inter, top_k = (
        config.num_experts,
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts_per_tok,
    )
    layers = [layer_of(expert_tensors(e, hidden, inter, "mxfp4", device)) for _ in range(num_layers)]
    per_expert = sum(t[0].numel() * t.element_size() for t in layers[0] if isinstance(t, torch.Tensor))
    card = torch.cuda.get_device_name() if device == "cuda" else "the CPU (Triton's interpreter: no figure)"
    print(f"{model}: MXFP4 experts, {card}, torch {torch.__version__}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"{'tokens':>6} {'kernel':>14} {'us':>9} {'GB/s':>8}")
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
        weights, experts = routing(num_tokens, e, top_k, device)
        args = (x, weights.to(dtype), experts)
        read = experts.unique().numel() * per_expert
        runs = {"product": gpt_oss_moe}
        runs.update({f"gemv {bn}x{bk}": functools.partial(gemv_moe, block_n=bn, block_k=bk) for bn, bk in configs})
        for name, fn in runs.items():
            us = _time_ms(functools.partial(_every_layer, fn, args, layers), device) * 1e3 / num_layers
            print(f"{num_tokens:>6} {name:>14} {us:>9.1f} {read / us / 1e3:>8.0f}", flush=True)


def _every_layer(fn, args, layers):
    return [fn(*args, layer) for layer in layers]


def _time_ms(fn, device: str) -> float:
    """On the GPU: replays of fn captured in a CUDA graph; elsewhere one call (a check that the script runs)."""
    if device == "cuda":
        from bench_attention import graph_time_ms  # noqa: PLC0415

        return graph_time_ms(fn)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", action="store_true")
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--configs", default="16x128,32x128,8x256,16x64", help="the GEMV's BLOCK_NxBLOCK_K tiles")
    p.add_argument("--layers", type=int, default=8, help="layers' weights a timed replay cycles through")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if args.bench:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
        bench(args.model, [int(t) for t in args.tokens.split(",")], configs, args.layers, device)


if __name__ == "__main__":
    main()
