"""Registers, spilled bytes and shared memory of Kiln's hot Triton kernels, compiled for the H200 on any machine.

Triton compiles for whatever target it is given (sm_90 here) without a GPU, and its bundled `cuobjdump` reads
the resources of the result. A kernel that runs out of registers spills to local memory (STACK > 0): 6d67307's
decode kernel (each K/V tile patched with the new token in registers) used 255 registers and 936 bytes of stack
against the kept kernel's 205 and none, and ran long contexts 1.5x slower on the H200. This shows such a change
before a device call; so does BUF, whether a kernel's loop keeps more than one K/V tile in flight (Triton's pipeliner
double-buffers a loop's loads only where their addresses do not hang on a load of the same iteration). The kernels
at the presets' shapes and the launch configs the backends choose, built as Triton's launcher builds them (aligned
pointers and strides):

    python scripts/dev/kernel_resources.py            # the table
    python scripts/dev/kernel_resources.py --check    # exits 1 if any kernel spills (but FEW_SPILL_ALLOWED, below)
    python scripts/dev/kernel_resources.py --families decode,gemv --models llama-3.1-8b
    python scripts/dev/kernel_resources.py --sample   # one variant of each kernel and code path (a compile check)

(Run it without TRITON_INTERPRET: under the interpreter there are no compiled kernels to read.)
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.backends.attention import decode_merge
from kiln.backends.attention import decode_plan as plan
from kiln.backends.attention import triton_decode as td
from kiln.backends.attention import triton_unified as ta
from kiln.backends.kernels import fp8_block, fp8_gemv, fp8_quant, gemv, gpt_oss_moe_triton, moe_fp8_triton, moe_routing
from kiln.backends.kernels import fused as fused_kernels
from kiln.backends.linear_attention import triton_conv, triton_delta_rule, triton_norm
from kiln.compile import pin_triton_setup
from kiln.engine.models.presets import PRESETS

TARGET = GPUTarget("cuda", 90, 32)
MODELS = ("llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b")
FAMILIES = ("decode", "prefill", "gemv", "qk_norm_rope", "window", "softcap", "fp8_kv", "fp8_gemv", "fp8_quant")
FAMILIES += ("fp8_block", "moe_routing", "gated_delta_net", "moe_fp8", "sinks", "gpt_oss_moe")
POINTERS = {  # pointer arguments that are not the model's dtype (bf16)
    "part_acc_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "arrivals_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "sinks_ptr": "*fp32",
}
FLOATS = {"qk_scale", "eps", "scale", "alpha", "limit"}
# strides that are not multiples of 16 at run time (Triton's launcher then gives no alignment hint): the conv
# weight's rows, K = 4 elements
UNALIGNED = {"stride_w_d"}


def compile_for_h200(kernel, constexprs: dict, num_warps: int, num_stages: int = 3, pointers: dict | None = None):
    """The kernel compiled for sm_90 with these constexprs; every other argument a bf16 pointer (`*_ptr`, but
    those in POINTERS and `pointers`), a float (FLOATS) or an int32."""
    pointers = POINTERS | (pointers or {})
    # NOTE: ASTSource applies no defaults: a defaulted argument left out would become a runtime one (and the build not
    # the launched one), so each takes its default here (a probe's off switch, a None pointer)
    constexprs = {p.name: p.default for p in kernel.params if p.has_default} | constexprs
    names = kernel.arg_names

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return pointers.get(name, "*bf16")
        return "fp32" if name in FLOATS else "i32"

    # As Triton's launcher specialises them: every pointer 16-byte aligned (torch's allocations are), and the strides
    # multiples of 16 (the block table's is max_model_len / 16: a multiple of 16 from 256 tokens on, for lengths of
    # 256-token steps). NOTE: without these hints Triton cannot prove its loads aligned and pipelines no loop (no
    # cp.async): the kernel compiled here was then not the one that runs.
    aligned = [n for n in names if n not in constexprs and (n.endswith("_ptr") or n.startswith("stride"))]
    aligned = [n for n in aligned if n not in UNALIGNED]
    source = ASTSource(
        fn=kernel,
        signature={n: arg_type(n) for n in names},
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled) -> dict[str, int]:
    """REG, STACK (spilled bytes) and LOCAL of the compiled kernel as `cuobjdump` reports them, and SHARED: the
    dynamic shared memory Triton asks for at launch (cuobjdump sees only the static part)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        report = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", report)}
    waits = [int(n) for n in re.findall(r"async_wait[^{\n]*\{num = (\d+)", compiled.asm["ttgir"])]
    return {**found, "SHARED": compiled.metadata.shared, "BUF": max(waits, default=-1)}


def shapes(model: str) -> dict:
    p = PRESETS[model]
    head_dim = p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"]
    return dict(
        hidden=p["hidden_size"],
        inter=p.get("intermediate_size") or p.get("moe_intermediate_size"),  # (a mixture of experts' own size)
        heads=p["num_attention_heads"],
        kv_heads=p["num_key_value_heads"],
        head_dim=head_dim,
    )


def decode_variants(model: str, window: int = 0, softcap: float = 0.0, kv_bytes: int = 2, sinks: bool = False):
    """The decode kernel as `split_kv_decode` launches it: one split and many, each launch config (an FP8 cache's
    with `kv_bytes` 1; with attention `sinks`, gpt-oss's)."""
    s = shapes(model)
    q_per_kv = s["heads"] // s["kv_heads"]
    head_dim_p = triton.next_power_of_2(s["head_dim"])
    configs = [plan.DECODE_CONFIG, plan.DECODE_CONFIG_FEW, plan.DECODE_CONFIG_MANY]
    if s["head_dim"] >= 256 and kv_bytes == 2:  # (batch 1 on a small grid: decode_config's wide-head warps)
        configs.append(plan.decode_config(plan.WIDE_FEW_MAX_PROGRAMS, 1, head_dim=256))
    for num_splits in (1, 64):
        for tile_n, warps, stages in configs:
            if num_splits > 1 and (tile_n, warps, stages) == plan.DECODE_CONFIG_MANY:
                continue  # never launched: it is chosen from 2,048 programs on, where decode_num_splits gives one split
            if kv_bytes == 1:
                tile_n, warps, stages = plan.fp8_decode_config((tile_n, warps, stages), s["head_dim"])
            constexprs = dict(
                NUM_HEADS=s["heads"],
                NUM_KV_HEADS=s["kv_heads"],
                Q_PER_KV=q_per_kv,
                GROUP=max(16, triton.next_power_of_2(q_per_kv)),
                HEAD_DIM=s["head_dim"],
                HEAD_DIM_P=head_dim_p,
                BLOCK_SIZE=16,
                TILE_N=tile_n,
                NUM_SPLITS=num_splits,
                MERGE_CHUNK=decode_merge.merge_chunk(q_per_kv, head_dim_p, num_splits, warps),
                LEAN=s["head_dim"] == head_dim_p and not softcap,
                USE_PDL=True,
                WINDOW=window,
                SOFTCAP=softcap,
                HAS_SINKS=sinks,
            )
            yield f"splits {num_splits}, {tile_n}x{warps}x{stages}", td._decode_split_kernel, constexprs, warps, stages


def prefill_variants(model: str, window: int = 0, softcap: float = 0.0, sinks: bool = False):
    """The unified (prefill and mixed) kernel at a long query (BLOCK_M 64) and a short one (16)."""
    s = shapes(model)
    q_per_kv = s["heads"] // s["kv_heads"]
    group = triton.next_power_of_2(q_per_kv)
    for block_m in (64, 16):
        constexprs = dict(
            NUM_KV_HEADS=s["kv_heads"],
            Q_PER_KV=q_per_kv,
            GROUP=group,
            BLOCK_Q=max(block_m // group, 1),
            HEAD_DIM=s["head_dim"],
            HEAD_DIM_P=triton.next_power_of_2(s["head_dim"]),
            BLOCK_SIZE=16,
            TILE_N=32,
            LEAN=s["head_dim"] == triton.next_power_of_2(s["head_dim"]) and not softcap,
            WINDOW=window,
            SOFTCAP=softcap,
            HAS_SINKS=sinks,
        )
        yield f"block_m {block_m}", ta._unified_attention_kernel, constexprs, 4, 3


def window_variants(model: str):
    """Decode and prefill of a sliding layer (a window of 1,024 tokens, Gemma's and Mistral's order)."""
    yield from (("decode " + v, *rest) for v, *rest in decode_variants(model, window=1024))
    yield from (("prefill " + v, *rest) for v, *rest in prefill_variants(model, window=1024))


def softcap_variants(model: str):
    """Decode and prefill with Gemma 2's score cap (50, in the kernels' log2 units), which takes the general loops."""
    cap = 50.0 * 1.4426950408889634
    yield from (("decode " + v, *rest) for v, *rest in decode_variants(model, softcap=cap))
    yield from (("prefill " + v, *rest) for v, *rest in prefill_variants(model, softcap=cap))


def sinks_variants(model: str):
    """Decode and prefill with gpt-oss's attention sinks (each row starts from its head's; split 0 alone in the
    decode), in full layers and in sliding ones (its window of 128)."""
    for window in (0, 128):
        where = f"window {window} " if window else ""
        yield from ((f"decode {where}" + v, *rest) for v, *rest in decode_variants(model, window=window, sinks=True))
        yield from ((f"prefill {where}" + v, *rest) for v, *rest in prefill_variants(model, window=window, sinks=True))


def gpt_oss_moe_variants(model: str):
    """gpt-oss's experts (`kiln::gpt_oss_moe`) at gpt-oss-120b's layer (hidden 2,880, intermediate 2,880; the model's
    shapes do not enter): both matmuls (gate/up with the clamped SwiGLU, down with the routing weight) at each tile
    `tile_config` gives, MXFP4 weights (uint8 bytes and scales) and a 16-bit pair."""
    ints = {"sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32"}
    for mxfp4 in (True, False):
        pointers = ints | ({"w_ptr": "*u8", "scale_ptr": "*u8"} if mxfp4 else {})
        for num_pairs in (4, 512, 4096, 16384):
            config = gpt_oss_moe_triton.tile_config(num_pairs, 2880, mxfp4)
            warps, stages = config.pop("num_warps"), config.pop("num_stages")
            tile = "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            for swiglu in (True, False):
                constexprs = dict(config, TOP_K=4, A_ROWS_ARE_TOKENS=swiglu, SWIGLU=swiglu, MXFP4=mxfp4)
                constexprs |= dict(HAS_BIAS=True, MUL_WEIGHT=not swiglu, PRECISION="tf32")
                name = f"{'mxfp4' if mxfp4 else 'bf16'} {'gate_up' if swiglu else 'down'} {tile}"
                yield name, gpt_oss_moe_triton._gpt_oss_matmul, constexprs, warps, stages, pointers


FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "cache_ptr": "*fp8e4nv"}


def fp8_kv_variants(model: str):
    """The kernels that read and write an FP8 KV cache (`--kv-cache-dtype fp8`): decode (which writes the new token),
    prefill, and the prefill's cache write."""
    yield from (("decode " + v, *rest, FP8_CACHE) for v, *rest in decode_variants(model, kv_bytes=1))
    yield from (("prefill " + v, *rest, FP8_CACHE) for v, *rest in prefill_variants(model))
    s = shapes(model)
    row = s["kv_heads"] * s["head_dim"]
    constexprs = dict(ROW=row, BLOCK=triton.next_power_of_2(row))
    yield "kv write", ta._kv_write_kernel, constexprs, 4, 3, FP8_CACHE


def fp8_quant_variants(model: str):
    """The activations' e4m3 rounding before `torch._scaled_mm` (past one row), per token and static."""
    k = shapes(model)["hidden"]
    pointers = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "in_scale_ptr": "*fp32"}
    for static in (False, True):
        constexprs = dict(STATIC=static, BLOCK_K=min(2048, triton.next_power_of_2(k)), HW_ROUND=True)
        yield "static" if static else "token", fp8_quant._quantize_rows_kernel, constexprs, 4, 3, pointers


def fp8_block_variants(model: str):
    """A block-scaled layer (128 x 128 blocks) past one row: the matmul at a prefill's tile and a few rows' tile,
    and the activations' rounding per 128 columns."""
    pointers = {"y_ptr": "*bf16", "a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv"}
    pointers |= {"w_scale_ptr": "*fp32", "b_ptr": "*bf16"}
    for block_m, block_n, warps, stages in ((64, 128, 8, 3), (16, 128, 4, 4)):
        constexprs = dict(SCALE_ROWS=128, HAS_BIAS=False, FP8_DOT=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128)
        yield f"matmul {block_m}x{block_n}", fp8_block._block_fp8_matmul_kernel, constexprs, warps, stages, pointers
    quant = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "in_scale_ptr": "*fp32"}
    constexprs = dict(STATIC=False, BLOCK_K=128, HW_ROUND=True, GROUPED=True)
    yield "groups of 128", fp8_quant._quantize_rows_kernel, constexprs, 4, 3, quant


def moe_routing_variants(model: str):
    """A mixture of experts' routing (128 experts, top-8, qwen3-30b-a3b's): the single program, and the parallel
    form's three kernels (the model's shapes do not enter)."""
    ints = {n: "*i32" for n in ("experts_ptr", "sorted_pairs_ptr", "block_expert_ptr", "counts_ptr", "offsets_ptr")}
    e_pad, top_k, chunk = 128, 8, 64
    common = dict(TOP_K=top_k, RENORMALISE=True, ROUTE=True, E_PAD=e_pad, K_PAD=top_k)
    yield (
        "single program",
        moe_routing._route_and_align_kernel,
        dict(common, BLOCK_M=16, CHUNK_T=16, CHUNK=chunk),
        8,
        3,
        ints,
    )
    chunk_t = moe_routing.CHUNK_PAIRS // top_k
    yield "count", moe_routing._count_kernel, dict(common, CHUNK_T=chunk_t, ROUTE_T=16, PAIRS_PAD=256), 8, 3, ints
    offsets = dict(BLOCK_M=64, E_PAD=e_pad, CHUNK=chunk)
    yield "offsets", moe_routing._offsets_kernel, offsets, 8, 3, ints
    place = dict(PAIRS=chunk_t * top_k, E_PAD=e_pad, CHUNK=chunk)
    yield "place", moe_routing._place_kernel, place, 8, 3, ints


def gated_delta_net_variants(model: str):
    """Gated DeltaNet's kernels at Qwen3.6-35B-A3B's linear-attention layers (16 key heads, 32 value heads of
    128, a conv of 8,192 channels and width 4, bf16; the model's shapes do not enter): the delta rule's chunked
    prefill (the UT transform, the scan over chunks) and decode step, the conv's prefill (outputs, state) and decode
    step, the gated norm."""
    heads = dict(Q_PER_K=32 // 16, DK=128, DK_P=128)
    chunk = dict(heads, CHUNK=triton_delta_rule.CHUNK, PRECISION="tf32")
    ints = ("chunk_request_ptr", "first_chunk_ptr", "state_slots_ptr", "token_request_ptr", "counts_ptr", "keep_ptr")
    pointers = {n: "*i32" for n in ints}
    pointers |= {n: "*fp32" for n in ("states_ptr", "a_ptr", "scores_ptr", "norms_ptr", "g_ptr", "fg_ptr", "fbeta_ptr")}
    yield "ut transform", triton_delta_rule._ut_transform_kernel, chunk, 4, 3, pointers
    block_v, warps, stages = triton_delta_rule.SCAN_CONFIG
    for fold in (False, True):  # (speculative decoding's: the kept tokens of a verification step folded in first)
        name = " (fold)" if fold else ""
        scan = dict(chunk, DV=128, BLOCK_V=block_v, SPLIT=True, FOLD=fold)
        yield f"chunk scan{name}", triton_delta_rule._chunk_scan_kernel, scan, warps, stages, pointers
        step = dict(heads, DV=128, BLOCK_V=triton_delta_rule.STEP_BLOCK_V, FOLD=fold)
        yield f"recurrent step{name}", triton_delta_rule._recurrent_kernel, step, 4, 3, pointers
    conv = dict(D=8192, K=4, BLOCK_D=triton_conv.BLOCK_D)
    yield "conv", triton_conv._causal_conv1d_kernel, dict(conv, BLOCK_T=triton_conv.BLOCK_T), 4, 3, pointers
    yield "conv state", triton_conv._conv_state_kernel, dict(conv, ROWS_P=4), 4, 3, pointers
    yield "conv step", triton_conv._conv_update_kernel, dict(conv, ROWS_P=4), 4, 3, pointers
    rows = triton_norm.ROW_ELEMENTS // 128
    norm = dict(D=128, BLOCK_D=128, ROWS=rows, ROUND_PRODUCT=True)
    yield "gated norm", triton_norm._gated_rms_norm_kernel, norm, 4, 3, pointers


def moe_fp8_variants(model: str):
    """FP8 experts' grouped matmuls at qwen3.6-35b-a3b's experts (hidden 2,048, 512 columns each; the model's shapes do
    not enter): gate/up with its SiLU-and-mul and down with the routing weight, at each of `tile_config`'s tiles,
    with 128 x 128 blocks (Qwen's FP8 checkpoints: a group's scale stride 1, as Triton's launcher specialises it) and
    with a scale a row (`--quantization fp8`)."""
    hidden, inter = 2048, 512
    pointers = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}
    pointers |= {"out_ptr": "*bf16", "weights_ptr": "*bf16", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32"}
    for num_pairs in (8, 256, 4096, 16384):
        config = moe_fp8_triton.fp8_tile_config(num_pairs, 2 * inter, hidden)
        tile = f"{config['BLOCK_M']}x{config['BLOCK_N']}"
        for gemm, silu_mul in (("gate_up", True), ("down", False)):
            common = dict(TOP_K=8, A_ROWS_ARE_TOKENS=silu_mul, SILU_MUL=silu_mul, MUL_WEIGHT=not silu_mul)
            common |= dict(FP8_DOT=True, **config)
            blocks = dict(common, BLOCK_K=min(config["BLOCK_K"], 128), SCALE_N=128, GROUP_K=128, GROUPED=True)
            blocks |= dict(stride_ask=1, stride_wsk=1)
            warps, stages = blocks.pop("num_warps"), blocks.pop("num_stages")
            yield f"{gemm} {tile} blocks", moe_fp8_triton._grouped_fp8_matmul, blocks, warps, stages, pointers
            rows = dict(common, SCALE_N=1, GROUP_K=config["BLOCK_K"], GROUPED=False)
            rows.pop("num_warps"), rows.pop("num_stages")
            yield f"{gemm} {tile} rows", moe_fp8_triton._grouped_fp8_matmul, rows, warps, stages, pointers


def fp8_gemv_variants(model: str):
    """The FP8 one-row matmul at the model's four layers, with the epilogues the models use (per-token activations):
    per-channel weights with dynamic per-token and static activations, and 128x128 blocks with per-group
    activations (DeepSeek's and Qwen3's FP8 format)."""
    s = shapes(model)
    layers = {
        "qkv": (s["hidden"], "rope"),
        "o": (s["heads"] * s["head_dim"], ""),
        "gate_up": (s["hidden"], "silu_mul"),
        "down": (s["inter"], ""),
    }
    pointers = {
        "w_ptr": "*fp8e4nv",
        "w_scale_ptr": "*fp32",
        "in_scale_ptr": "*fp32",
        "cos_ptr": "*bf16",
        "sin_ptr": "*bf16",
    }
    for (layer, (k, epilogue)), act in itertools.product(layers.items(), ("token", "static", "group")):
        blocked = act == "group"
        for ep in dict.fromkeys(("", epilogue if act == "token" else "")):
            block_rows, chunk = 16, 128 if blocked else min(2048, k)  # (fp8_gemv's default, 8 warps)
            constexprs = dict(
                ACT=act,
                BLOCKED=blocked,
                SCALE_ROWS=128 if blocked else 1,
                HAS_BIAS=False,
                EPILOGUE=ep,
                HALF=s["head_dim"] // 2,
                BLOCK_N=block_rows // 2 if ep else block_rows,
                BLOCK_K=triton.next_power_of_2(chunk),
                HW_ROUND=True,
                USE_PDL=True,
            )
            yield f"{layer} {act}{' ' + ep if ep else ''}", fp8_gemv._fp8_gemv_kernel, constexprs, 8, 3, pointers


def gemv_variants(model: str):
    """The one-row matmul at the model's four layers, with the epilogues the models use, default configs."""
    s = shapes(model)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layers = {
        "qkv": (q + 2 * kv, s["hidden"], "rope"),
        "o": (s["hidden"], q, ""),
        "gate_up": (2 * s["inter"], s["hidden"], "silu_mul"),
        "down": (s["hidden"], s["inter"], ""),
    }
    for layer, (n, k, epilogue) in layers.items():
        # the layer norm comes inside the projections that follow one (qkv, gate_up)
        for ep, norm in itertools.product(dict.fromkeys(("", epilogue)), (False, True) if epilogue else (False,)):
            block_n, block_k, warps = gemv.default_config(n, k)
            if ep:
                block_n = max(1, block_n // 2)
            constexprs = dict(
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                EVEN_K=k % block_k == 0,
                HAS_BIAS=False,
                EPILOGUE=ep,
                HALF=s["head_dim"] // 2,
                NORM=norm,
                USE_PDL=True,
            )
            yield f"{layer} {ep or 'plain'}{' +norm' if norm else ''}", gemv._gemv_kernel, constexprs, warps, 3


def qk_norm_rope_variants(model: str):
    s = shapes(model)
    half = s["head_dim"] // 2
    constexprs = dict(NUM_Q_HEADS=s["heads"], HALF=half, HALF_P=triton.next_power_of_2(half), USE_PDL=True)
    yield "", fused_kernels._qk_norm_rope_kernel, constexprs, 4, 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--check", action="store_true", help="exit 1 if any kernel spills registers")
    p.add_argument(
        "--sample",
        action="store_true",
        help="compile only the first variant of each kernel, cache dtype and code path (ACT, EPILOGUE, NORM): the "
        "interpreter runs kernels that Triton's compiler refuses (a global not a constexpr, branches returning "
        "two types), and this finds them in a minute",
    )
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_resources.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    pin_triton_setup()  # the ptxas and libdevice the engine compiles with (torch's, where its Inductor has them)
    ptxas = os.environ.get("TRITON_PTXAS_PATH", "Triton's own")
    print(
        f"Kiln's Triton kernels compiled for sm_90 (triton {triton.__version__}, ptxas {ptxas}); STACK = bytes "
        "spilled a thread; BUF = the most copy groups a loop's wait leaves in flight (0: one buffer, each "
        "iteration waits for all its loads; -1: no pipelined loop)"
    )
    print(f"{'model':14} {'kernel':22} {'variant':28} {'REG':>4} {'STACK':>6} {'SHARED':>7} {'BUF':>4}")
    seen: dict[tuple, dict[str, int]] = {}
    spills = []
    families = {
        "decode": decode_variants,
        "prefill": prefill_variants,
        "gemv": gemv_variants,
        "qk_norm_rope": qk_norm_rope_variants,
        "window": window_variants,
        "softcap": softcap_variants,
        "fp8_kv": fp8_kv_variants,
        "fp8_gemv": fp8_gemv_variants,
        "fp8_quant": fp8_quant_variants,
        "fp8_block": fp8_block_variants,
        "moe_routing": moe_routing_variants,
        "gated_delta_net": gated_delta_net_variants,
        "moe_fp8": moe_fp8_variants,
        "sinks": sinks_variants,
        "gpt_oss_moe": gpt_oss_moe_variants,
    }
    for model in args.models.split(","):
        for family in args.families.split(","):
            variants = families[family]
            if family == "qk_norm_rope" and not PRESETS[model]["architectures"][0].startswith("Qwen3"):
                continue  # only Qwen3 normalises q and k
            sampled = set()
            for variant, kernel, constexprs, warps, stages, *pointers in variants(model):
                pointers = pointers[0] if pointers else {}
                path = (kernel.fn.__name__, tuple(pointers.items()), *(constexprs.get(n) for n in SAMPLED))
                if args.sample and path in sampled:
                    continue
                sampled.add(path)
                key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), warps, stages, tuple(pointers.items()))
                if key not in seen:  # several layers share a specialisation
                    seen[key] = resources(compile_for_h200(kernel, constexprs, warps, stages, pointers))
                r = seen[key]
                spilled = r.get("STACK", 0) + r.get("LOCAL", 0)
                if spilled > spill_allowed(family, variant):
                    spills.append(f"{model} {family} {variant}")
                print(
                    f"{model:14} {family:22} {variant:28} {r.get('REG', 0):4} {spilled:6} {r.get('SHARED', 0):7} "
                    f"{r['BUF']:4}",
                    flush=True,
                )
    if spills:
        print("spills: " + "; ".join(spills))
    if args.check and spills:
        sys.exit(1)


# constexprs that choose code paths (--sample compiles each)
SAMPLED = (
    "ACT",
    "EPILOGUE",
    "NORM",
    "STATIC",
    "BLOCK_M",
    "GROUPED",
    "SILU_MUL",
    "SWIGLU",
    "MXFP4",
    "HAS_SINKS",
    "WINDOW",
)


# NOTE: the decode kernel's few-request config (a 128-key tile, 4 warps; with sinks too) may spill a few bytes a thread
# at head_dim 128 (8 under some Triton versions), and is faster in the batch-1 step all the same; a spill that size
# passes the check.
# A spill of hundreds of bytes (a decode kernel that patched its tiles in registers) made long contexts 1.5x slower.
FEW_SPILL_ALLOWED = 128


def spill_allowed(family: str, variant: str) -> int:
    few = "x".join(str(v) for v in plan.DECODE_CONFIG_FEW)
    decode = family == "decode" or (family == "sinks" and variant.startswith("decode"))
    return FEW_SPILL_ALLOWED if decode and variant.removesuffix("l").endswith(f", {few}") else 0


if __name__ == "__main__":
    main()
