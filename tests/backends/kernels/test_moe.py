"""The grouped expert kernels (`kiln::fused_moe`'s GPU form) against a float64 loop over the experts (Triton's
interpreter on CPU): uneven expert loads, experts no token chose, one expert chosen by every token, tied routing
weights, one token and many; the routing kernel against torch's softmax and top-k; the alignment's layout on its
own; the whole op from the router's logits; and a tiny mixture of experts through the kernels against Hugging
Face."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.backends.kernels.moe import fused_moe_reference
from kiln.backends.kernels.moe_routing import align, align_reference, route_and_align, route_reference
from kiln.backends.kernels.moe_triton import experts_forward, fused_moe, tile_config

from helpers.kernels import DEVICE, DTYPES, close


def _routing(num_tokens: int, num_experts: int, top_k: int, kind: str, generator: torch.Generator):
    """(weights [T, k], experts [T, k]) of one kind of load."""
    if kind == "random":
        logits = torch.randn(num_tokens, num_experts, generator=generator)
    elif kind == "skewed":  # most tokens pick the same few experts; the last experts see none
        logits = torch.randn(num_tokens, num_experts, generator=generator)
        logits[:, : top_k + 1] += 4.0
        logits[:, -2:] -= 100.0
    else:  # "ties": every logit equal, so every token picks experts 0..k-1 with weight 1/E each
        logits = torch.zeros(num_tokens, num_experts)
    weights, experts = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights, experts.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k,kind",
    [
        (1, 64, 32, 8, 2, "random"),  # a batch-1 decode: k experts, one row each
        (7, 96, 48, 8, 3, "skewed"),  # K and N not multiples of the tiles; empty experts
        (33, 64, 32, 6, 2, "ties"),  # every token on the same two experts
        (70, 64, 64, 16, 4, "random"),  # past the decode tile: 280 pairs, BLOCK_N 64
        (5, 64, 32, 4, 1, "random"),  # top-1
    ],
)
def test_fused_moe_against_float64(dtype, num_tokens, hidden, inter, num_experts, top_k, kind):
    generator = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) * inter**-0.5
    weights, experts = _routing(num_tokens, num_experts, top_k, kind, generator)
    reference = fused_moe_reference(x.double(), w13.double(), w2.double(), weights.double(), experts)
    args = [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), experts)]
    out = experts_forward(*args)
    assert out.shape == x.shape and out.dtype == dtype
    close(out.cpu(), reference.to(dtype), dtype)


@pytest.mark.parametrize("num_pairs", [300, 5000, 20000])
def test_every_prefill_tile_against_float64(num_pairs):
    """The tiles of longer steps (BLOCK_M 16, 64 and 128: 64 x 64 and 128 x 128 blocks), on a few tokens' pairs."""
    generator = torch.Generator().manual_seed(num_pairs)
    num_tokens, hidden, inter, num_experts, top_k = 40, 128, 192, 8, 2
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) * inter**-0.5
    weights, experts = _routing(num_tokens, num_experts, top_k, "skewed", generator)
    reference = fused_moe_reference(x.double(), w13.double(), w2.double(), weights.double(), experts)
    config = tile_config(num_pairs, 2 * inter, hidden)
    out = experts_forward(*[t.to(DEVICE) for t in (x, w13, w2, weights, experts)], config=config)
    close(out.cpu(), reference.float(), torch.float32)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,renormalise",
    [(1, 128, 8, True), (5, 8, 2, True), (37, 60, 4, False), (64, 128, 8, True), (3, 256, 8, True), (600, 16, 8, True)],
)
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_equals_softmax_and_topk(num_tokens, num_experts, top_k, renormalise, weights_dtype):
    """The kernels' experts and weights equal torch's (the single program up to 128 pairs, the parallel form
    past it: 600 x 8 pairs in 19 chunks), and their layout the alignment's of those experts; on an exact tie the lowest
    index."""
    generator = torch.Generator().manual_seed(num_tokens + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    weights, experts, sorted_pairs, block_expert = route_and_align(
        logits.to(DEVICE), top_k, renormalise, weights_dtype, 16
    )
    want_weights, want_experts = route_reference(logits, top_k, renormalise, weights_dtype)
    assert torch.equal(experts.cpu(), want_experts) and weights.dtype == weights_dtype
    tol = 1e-6 if weights_dtype == torch.float32 else 2**-8  # (bf16: the same float32 value may round a ulp apart)
    torch.testing.assert_close(weights.cpu().float(), want_weights.float(), atol=tol, rtol=tol)
    want_pairs, want_blocks = align_reference(want_experts, num_experts, 16)
    assert torch.equal(sorted_pairs.cpu(), want_pairs) and torch.equal(block_expert.cpu(), want_blocks)
    _, tied, _, _ = route_and_align(torch.zeros(2, 8, device=DEVICE), 3, True, torch.float32, 16)
    assert tied.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_op_from_router_logits_against_float64(dtype):
    """`kiln::fused_moe`'s GPU form end to end (routing included) against torch's routing and the float64 loop."""
    generator = torch.Generator().manual_seed(7)
    num_tokens, hidden, inter, num_experts, top_k = 9, 64, 32, 16, 4
    x = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) * inter**-0.5
    weights, experts = route_reference(logits, top_k, True, torch.float64)
    reference = fused_moe_reference(x.double(), w13.double(), w2.double(), weights, experts)
    args = [t.to(DEVICE, dtype) for t in (x, logits, w13, w2)]
    out = fused_moe(*args, top_k, True, torch.float32)
    close(out.cpu(), reference.to(dtype), dtype)


@pytest.mark.parametrize("num_tokens", [1, 70], ids=["decode", "prefill"])
def test_gemma4s_experts_gelu_and_scales_against_float64(num_tokens):
    """Gemma 4's experts: GELU's tanh form for the activation, the renormalised top-k weights in float32 times each
    chosen expert's scale; the kernels and the op's plain form against float64 HF-style math."""
    generator = torch.Generator().manual_seed(num_tokens)
    hidden, inter, num_experts, top_k = 64, 48, 8, 2
    x = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) * inter**-0.5
    scales = torch.rand(num_experts, generator=generator) + 0.5
    probs, experts = torch.topk(logits.double().softmax(-1), top_k, dim=-1)
    weights = probs / probs.sum(-1, keepdim=True) * scales.double()[experts]
    reference = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            gate, up = (w13[experts[t, j]].double() @ x[t].double()).chunk(2)
            act = torch.nn.functional.gelu(gate, approximate="tanh") * up
            reference[t] += weights[t, j] * (w2[experts[t, j]].double() @ act)
    args = [t.to(DEVICE) for t in (x, logits, w13, w2)]
    out = fused_moe(*args, top_k, True, torch.float32, expert_scales=scales.to(DEVICE), gelu=True)
    close(out.cpu(), reference.float(), torch.float32)
    plain = torch.ops.kiln.fused_moe(x, logits, w13, w2, top_k, True, True, scales, True)
    torch.testing.assert_close(plain.double(), reference, atol=1e-5, rtol=1e-5)
    silu = torch.ops.kiln.fused_moe(x, logits, w13, w2, top_k, True, True, None, False)
    assert (silu - plain).abs().max() > 1e-2  # (the activation and the scales matter here)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m",
    [
        (37, 12, 3, 16),
        (37, 12, 3, 32),
        (1, 128, 8, 16),
        (300, 128, 8, 64),
        (50, 256, 8, 16),
        (3, 8, 2, 16),
        (600, 64, 8, 64),
        (500, 12, 3, 32),
    ],
)
def test_align_sorts_every_pair_once_into_blocks_of_one_expert(num_tokens, num_experts, top_k, block_m):
    """The kernels' layout (the single program's, the parallel form's past 128 pairs, in chunks of 256 or,
    with k = 3, 255) equals the torch ops' (a stable sort by expert), and that layout is right."""
    generator = torch.Generator().manual_seed(block_m + num_tokens)
    _, experts = _routing(num_tokens, num_experts, top_k, "skewed", generator)
    sorted_pairs, block_expert = align(experts.to(DEVICE), num_experts, block_m)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    want_pairs, want_blocks = align_reference(experts, num_experts, block_m)
    assert torch.equal(sorted_pairs, want_pairs) and torch.equal(block_expert, want_blocks)
    num_pairs = experts.numel()
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair once, the rest padding
    flat = experts.flatten()
    for block, expert in enumerate(block_expert.tolist()):
        pairs = sorted_pairs[block * block_m : (block + 1) * block_m]
        pairs = pairs[pairs < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and (flat[pairs] == expert).all()
    used = int((block_expert >= 0).sum())
    blocks_needed = sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))
    assert used == blocks_needed  # no block wasted on padding


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's exact fp32; on the GPU: test_moe_on_the_gpu_matches_hf")
def test_tiny_moe_through_the_kernels_matches_hf(tiny_moe_dir):
    """Eager with the GPU path's kernels (here under the interpreter) for attention, norms and the experts."""
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.models.layers import use_fused_kernels

    llm = LLM(str(tiny_moe_dir), enforce_eager=True, max_model_len=128, attention_backend="triton", device="cpu")
    use_fused_kernels(llm.engine.executor.model, True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 33, 2, 101, 45, 9], list(range(20, 41))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
