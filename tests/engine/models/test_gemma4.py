"""Gemma 4 (text) against Hugging Face (fp32, CPU), on tiny random models of each kind (helpers.models.GEMMA4): the
31B's layout (full layers of wider heads over one KV head, the value the key's projection, pages half a sliding
layer's), E2B's and E4B's (per-layer embeddings; the last two layers reading earlier layers' KV, their MLP twice as
wide; sliding pages half a full layer's) and 26B-A4B's (experts beside every MLP). Greedy tokens and log-probabilities
equal transformers' own, eager and compiled, chunked across the window, after a prefix hit across the window's edge,
with preemption in the blocks the sizing promises; the KV groups of mixed head dims and the shared layers' (none)."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams
from kiln.engine.models.source import resolve_model

from helpers.models import GEMMA4, assert_greedy_matches_hf, make_tiny_model_dir, skip_uninterpreted_triton

PROMPTS = [list(range(3, 60)), [(7 * i) % 500 + 1 for i in range(70)], list(range(100, 151))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
TOL = 1e-4


@pytest.fixture(scope="module", params=GEMMA4)
def gemma4_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def hf(gemma4_dir):
    return AutoModelForCausalLM.from_pretrained(gemma4_dir, dtype=torch.float32, attn_implementation="eager").eval()


def assert_every_block_back(llm: LLM) -> None:
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks and manager.usage == 0.0


def test_the_config_reads_every_feature(gemma4_dir, hf):
    """(and the checks have teeth: the norms and layer scalars are not HF's ones, the logit cap bites)"""
    config = resolve_model(str(gemma4_dir)).model_config
    kind = gemma4_dir.name.rstrip("0123456789")
    assert config.sliding_window == 8 and config.final_softcap == 3.0 and config.norm_weight_offset == 0.0
    assert (config.head_dim, config.global_head_dim) == (16, 32)
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    full = [i for i in range(config.num_layers) if i not in config.sliding_layers]
    assert {config.head_dim_of(i) for i in full} == {32}
    assert {config.head_dim_of(i) for i in config.sliding_layers} == {16}
    if kind == "gemma4":
        assert config.attention_k_eq_v and (config.num_kv_heads, config.kv_heads_of(full[0])) == (4, 1)
    if kind == "gemma4_e":
        assert config.attention_layers == (0, 1, 2, 3, 4) and config.double_wide_mlp
        assert [config.kv_source_of(layer) for layer in (5, 6)] == [3, 4]
        assert (config.per_layer_input_size, config.per_layer_vocab_size) == (8, 512)
    if kind == "gemma4_moe":
        assert config.moe_layers == tuple(range(5)) and (config.num_experts, config.num_experts_per_tok) == (4, 2)
    scalars = [b for name, b in hf.named_buffers() if name.endswith("layer_scalar")]
    norms = [p for name, p in hf.named_parameters() if name.endswith("norm.weight")]
    assert sum((b - 1).abs().item() > 0.1 for b in scalars) > len(scalars) // 2
    assert all((p - 1).abs().max() > 0.1 for p in norms)
    uncapped = AutoModelForCausalLM.from_pretrained(
        gemma4_dir, dtype=torch.float32, attn_implementation="eager", final_logit_softcapping=None
    ).eval()
    with torch.no_grad():
        prompt = torch.tensor([PROMPTS[0]])
        assert (hf(prompt).logits[0, -1] - uncapped(prompt).logits[0, -1]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("enforce_eager", "budget"), [(True, None), (True, 13), (False, 13)], ids=["eager", "eager-chunked-13", "compiled"]
)
def test_matches_hf(gemma4_dir, hf, tmp_path, enforce_eager, budget):
    """Chunks of 13 tokens: each chunk's window reaches back into the chunk before."""
    engine = dict(max_model_len=256, max_num_batched_tokens=budget, device="cpu", compile_cache_dir=str(tmp_path))
    with LLM(str(gemma4_dir), enforce_eager=enforce_eager, **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_every_block_back(llm)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_the_triton_attention_reads_pages_of_either_size(gemma4_dir, hf):
    """The Triton kernels (under the interpreter) over groups whose layers share a slot's pages: their tables hold
    k * b, their cache tensors start at their part of the page."""
    skip_uninterpreted_triton("triton")
    if gemma4_dir.name.startswith("gemma4_moe"):
        pytest.skip("the MoE model's pages are of one size")
    engine = dict(max_model_len=128, max_num_batched_tokens=16, attention_backend="triton", device="cpu")
    with LLM(str(gemma4_dir), enforce_eager=True, **engine) as llm:
        assert llm.engine.executor.kv_spec.groups.layer_part
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS[:2], outputs, MAX_TOKENS, TOL)


def test_a_prefix_hit_across_the_window_edge(gemma4_dir, hf):
    first = list(range(3, 60))
    second = first[:48] + [400, 401, 402, 403, 404, 405]
    with LLM(str(gemma4_dir), enforce_eager=True, max_model_len=256, device="cpu") as llm:
        llm.generate([first], GREEDY, use_tqdm=False)
        (output,) = llm.generate([second], GREEDY, use_tqdm=False)
        assert output.num_cached_tokens >= 48
    assert_greedy_matches_hf(hf, [second], [output], MAX_TOKENS, TOL)


def test_the_blocks_the_sizing_promises_hold_what_an_all_global_cache_would(gemma4_dir, hf):
    """The KV accounting: only the layers with KV of their own have cache tensors (the shared ones none), blocks are
    as many bytes as the slots' pages of the largest kind, and the least pool start-up accepts for a max_model_len of
    128 (a full group's 32 blocks of 4, each sliding group's window and a step's tokens) runs the prompts equal to HF,
    preempting where it must, in under 60% of what a cache of every layer's whole context takes."""
    engine = dict(enforce_eager=True, device="cpu", block_size=4, max_num_batched_tokens=8, max_model_len=128)
    with LLM(str(gemma4_dir), num_kv_blocks=64, **engine) as llm:
        executor = llm.engine.executor
        spec, config = executor.kv_spec, executor.model_config
        groups = spec.groups
        num_full = sum(1 for w in groups.windows if not w)
        held = sum(-(-(8 - 1 + 8) // 4) + 2 for w in groups.windows if w)
    least = 1 + num_full * 128 // 4 + held
    with LLM(str(gemma4_dir), num_kv_blocks=least, **engine) as llm:
        executor = llm.engine.executor
        assert executor.max_model_len == 128 and len(executor.kv_caches) == len(config.attention_layers)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_every_block_back(llm)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in executor.kv_caches}
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)
    rows = [config.kv_heads_of(layer) * config.head_dim_of(layer) for layer in range(config.num_layers)]
    all_global = 128 * 2 * sum(rows) * 4
    assert sum(storages.values()) <= (least + 1) * spec.bytes_per_block  # (a spare page a slot where pages are shared)
    assert spec.bytes_per_block == 2 * groups.num_slots * 4 * max(rows) * 4
    assert sum(storages.values()) < 0.6 * all_global


def test_the_checkpoints_kv_tensors_of_shared_layers_are_passed_over(tmp_path):
    """Google's checkpoints keep k_proj, v_proj and k_norm for the layers that read another layer's KV (transformers
    ignores them): Kiln does too."""
    d = make_tiny_model_dir(tmp_path / "m", "gemma4_e")
    weights = load_file(d / "model.safetensors")
    for layer in (5, 6):
        weights[f"model.layers.{layer}.self_attn.k_proj.weight"] = torch.zeros(64, 64)
        weights[f"model.layers.{layer}.self_attn.k_norm.weight"] = torch.zeros(32)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with LLM(str(d), enforce_eager=True, max_model_len=128, device="cpu") as llm:
        outputs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS[:1], outputs, MAX_TOKENS, TOL)


def test_bidirectional_attention_is_refused_in_one_line_and_visions_is_causal_text(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m", "gemma4")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": "all"}))
    with pytest.raises(ValueError, match="use_bidirectional_attention='all' is not supported"):
        LLM(str(d), enforce_eager=True, max_model_len=64, device="cpu")
    (d / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": "vision"}))
    assert resolve_model(str(d)).model_config.architecture == "Gemma4ForCausalLM"


def test_the_language_model_of_a_gemma4_for_conditional_generation_checkpoint(tmp_path, caplog):
    """Gemma4ForConditionalGeneration as transformers saves it (`model.language_model.*` beside the vision tower and
    its embedder): Kiln serves the language model with one warning, equal to the whole model on text."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    from helpers.models import tiny_gemma4_config

    torch.manual_seed(0)
    vision = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    text = tiny_gemma4_config("gemma4_e").to_dict()
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision.to_dict())).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(tmp_path)
    make_tiny_model_dir(tmp_path / "tok", "gemma4_e")  # (its tokenizer, beside the checkpoint)
    for f in (tmp_path / "tok").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    with caplog.at_level("WARNING"), LLM(str(tmp_path), enforce_eager=True, max_model_len=256, device="cpu") as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any("vision tower is ignored" in r.getMessage() for r in caplog.records)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# (a float32 difference in a layer's input can move a value across an e4m3 rounding boundary: test_fp8's TOL; the
# experts' inputs, rounded a token at a time, more so: here one log-probability moves 4e-3, the rest stay at 3e-7)
FP8_TOL, FP8_MOE_TOL = 2e-3, 1e-2


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x through e4m3 a scale a token (a row), as `--quantization fp8` rounds a layer's input."""
    scale = x.abs().amax(dim=-1, keepdim=True) * (1 / FP8_MAX)
    return ((x * (1 / scale)).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _quantized(w: torch.Tensor) -> torch.Tensor:
    """w through e4m3 a scale a row (the last dim's), and back."""
    scale = w.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    return ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def _fp8_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """Hugging Face's expert loop (Gemma4TextExperts.forward, its own weights, routing and GELU-tanh) with each
    projection's input rounded through e4m3 a scale a token."""
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        tokens, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(_rounded(hidden_states[tokens]), experts.gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(_rounded(experts.act_fn(gate) * up), experts.down_proj[expert])
        out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None]).to(out.dtype))
    return out


def _fp8_reference(model_dir):
    """Hugging Face's model with every projection's weight (and every expert's) quantized to e4m3 a scale a row and
    back, and its input rounded through e4m3 a scale a token: what `--quantization fp8` computes."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            module.weight.data.copy_(_quantized(module.weight.data))
            module.register_forward_pre_hook(lambda m, args: (_rounded(args[0]),) + args[1:])
        elif name.endswith(".experts"):
            for param in (module.gate_up_proj, module.down_proj):
                param.data.copy_(_quantized(param.data))
            module.forward = types.MethodType(_fp8_experts_forward, module)
    return hf


def test_quantization_fp8_matches_hf_with_e4m3_weights_and_inputs(gemma4_dir):
    """--quantization fp8 (q/k/v, o, gate/up, down and 26B-A4B's experts: a scale a row, inputs a scale a token; the
    per-layer embeddings' small projections, the router and the norms stay 16-bit)."""
    with LLM(str(gemma4_dir), enforce_eager=True, max_model_len=256, device="cpu", quantization="fp8") as llm:
        layer = llm.engine.executor.model.model.layers[-1]
        attn = layer.self_attn
        assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and attn.o_proj.weight.dtype == torch.float8_e4m3fn
        if hasattr(layer, "experts"):
            assert layer.experts.gate_up_proj.dtype == layer.experts.down_proj.dtype == torch.float8_e4m3fn
            assert layer.experts.down_proj_scale.shape == (4, 64) and layer.router.proj.weight.dtype == torch.float32
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tol = FP8_MOE_TOL if gemma4_dir.name.startswith("gemma4_moe") else FP8_TOL
    assert_greedy_matches_hf(_fp8_reference(gemma4_dir), PROMPTS, outputs, MAX_TOKENS, tol, near_tie=True)


def test_fp8_experts_through_the_triton_kernels_and_compiled(tmp_path):
    """26B-A4B's FP8 experts eager through the GPU path's Triton kernels (under the interpreter, which is slow: a short
    prompt and a few tokens; GELU-tanh and the scales a chosen expert in the grouped FP8 matmuls), and compiled (the
    op in the graph, chunked prefill)."""
    skip_uninterpreted_triton("triton")
    model_dir = make_tiny_model_dir(tmp_path / "gemma4_moe", "gemma4_moe")
    hf = _fp8_reference(model_dir)
    engine = dict(max_model_len=128, device="cpu", quantization="fp8", compile_cache_dir=str(tmp_path / "c"))
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM(str(model_dir), enforce_eager=True, **engine) as llm:
        for layer in llm.engine.executor.model.model.layers:
            layer.fused = True  # (the experts' kernels only; the norms and attention stay plain torch)
        fused = llm.generate([PROMPTS[1][:20]], short, use_tqdm=False)
    assert_greedy_matches_hf(hf, [PROMPTS[1][:20]], fused, 4, FP8_MOE_TOL)
    with LLM(str(model_dir), enforce_eager=False, max_num_batched_tokens=13, **engine) as llm:
        compiled = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, compiled, MAX_TOKENS, FP8_MOE_TOL, near_tie=True)


def test_an_fp8_checkpoints_gemma4_experts_are_refused_in_one_line(tmp_path):
    """Kiln quantizes Gemma 4's experts at load; an FP8 checkpoint of them (stacked e4m3 experts and scales of a
    format of their own) is refused, naming the layer, rather than served with scales of one."""
    d = make_tiny_model_dir(tmp_path / "m", "gemma4_moe")
    config = json.loads((d / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": fp8}))
    with pytest.raises(
        ValueError, match=r"an FP8 checkpoint's Gemma 4 experts \(model\.layers\.0\.experts: .*not supported"
    ):
        LLM(str(d), enforce_eager=True, max_model_len=64, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_fp8_experts_on_the_gpu_match_hf(tmp_path, enforce_eager):
    """`--quantization fp8` of 26B-A4B's tiny model on the GPU (the FP8 experts' grouped matmuls on e4m3 tensor cores,
    with GELU-tanh and the scales a chosen expert; eager, and in CUDA graphs): float32 greedy tokens and
    log-probabilities those of Hugging Face's model with e4m3 weights and inputs (the torch attention backend and
    test_fp8.py's tolerance: see its GPU test), together and one row a step; bf16 as close to it as that model's own
    bf16 run."""
    from helpers.models import assert_bf16_as_close_as_hf

    model_dir = make_tiny_model_dir(tmp_path / "gemma4_moe", "gemma4_moe")
    hf = _fp8_reference(model_dir)
    engine = dict(
        enforce_eager=enforce_eager,
        max_model_len=256,
        quantization="fp8",
        compile_cache_dir=str(tmp_path / "c"),
        device="cuda",
        cudagraph_capture_sizes=(1, 2, 4),
    )
    with LLM(str(model_dir), dtype="float32", attention_backend="torch", **engine) as llm:
        assert llm.engine.executor.model.model.layers[0].experts.gate_up_proj.dtype == torch.float8_e4m3fn
        together = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        alone = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in PROMPTS]  # (one row a step)
    assert_greedy_matches_hf(hf, PROMPTS, together, MAX_TOKENS, 5e-2, near_tie=True)
    assert_greedy_matches_hf(hf, PROMPTS, alone, MAX_TOKENS, 5e-2, near_tie=True)
    with LLM(str(model_dir), dtype="bfloat16", **engine) as llm:
        bf16 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_bf16_as_close_as_hf(hf, _fp8_reference(model_dir).to(torch.bfloat16).cuda(), PROMPTS, bf16)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tp2_equals_tp1_and_hf(gemma4_dir, hf, compiled, tmp_path):
    """Two ranks over gloo: each holds two of the four query heads, its share of the sliding layers' KV heads and a
    copy of the full layers' one (31B's, 26B-A4B's), half of every MLP's and expert's columns, half the per-layer
    embedding table's rows."""
    if compiled and not gemma4_dir.name.startswith("gemma4_e"):
        pytest.skip("compiled once, on the model with every kind of layer but experts")
    kwargs = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16, device="cpu")
    single = LLM(str(gemma4_dir), enforce_eager=True, **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(
        str(gemma4_dir), tensor_parallel_size=2, enforce_eager=not compiled, compile_cache_dir=str(tmp_path), **kwargs
    ) as llm:
        layers = llm.engine.executor.model.model.layers
        assert layers[0].self_attn.num_heads == 2 and layers[2].self_attn.num_kv_heads == 1
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for got, want in zip(outputs, single, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert all(abs(lp_got[t].logprob - lp_want[t].logprob) < TOL for t in lp_got)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)


@pytest.mark.parametrize("preset", ["gemma-4-31b", "gemma-4-26b-a4b", "gemma-4-e4b"])
def test_each_gemma4_preset_has_hugging_faces_parameters(preset):
    """Kiln's model of each preset (on the meta device) has Hugging Face's parameters for the same config (30.7B,
    25.2B and 7.5B, as Google's cards say; HF's layer scalars are buffers), the full layers' heads and KV heads, and
    only the layers before the shared ones hold KV."""
    from transformers import AutoConfig

    from kiln.engine.models.loader import build_model
    from kiln.engine.models.presets import PRESETS
    from kiln.engine.models.source import _model_type

    raw = dict(PRESETS[preset])
    hf_config = AutoConfig.for_model(_model_type(raw["architectures"][0]), **raw)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    config = resolve_model(preset).model_config
    ours = build_model(config, torch.bfloat16, torch.device("meta"), 4096)
    scalars = sum(b.numel() for name, b in reference.named_buffers() if name.endswith("layer_scalar"))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) + scalars
    assert round(count / 1e9, 1) == {"gemma-4-31b": 30.7, "gemma-4-26b-a4b": 25.2, "gemma-4-e4b": 7.5}[preset]
    for layer in range(config.num_layers):
        per_layer = hf_config.per_layer_config[layer]
        assert (config.head_dim_of(layer), config.kv_heads_of(layer)) == (
            per_layer.head_dim,
            per_layer.num_key_value_heads,
        )
    shared = hf_config.kv_sharing_modes.count("reuse")
    assert config.attention_layers == tuple(range(config.num_layers - shared))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_gemma4_on_the_gpu_matches_hf(gemma4_dir, hf, tmp_path, enforce_eager):
    """On the GPU (the Triton attention over pages of two sizes, full and piecewise CUDA graphs, the experts' GELU and
    scales in the grouped kernels): float32 greedy tokens and log-probabilities Hugging Face's (within TF32's rounding
    of the attention's dots), and bf16 log-probabilities as close to them as Hugging Face's own bf16 run."""
    from helpers.models import assert_bf16_as_close_as_hf

    engine = dict(
        max_model_len=256,
        block_size=4,
        compile_cache_dir=str(tmp_path),
        device="cuda",
        cudagraph_capture_sizes=(1, 2, 4),
    )
    with LLM(str(gemma4_dir), enforce_eager=enforce_eager, dtype="float32", **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_every_block_back(llm)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 5e-3, near_tie=True)
    with LLM(str(gemma4_dir), enforce_eager=enforce_eager, dtype="bfloat16", **engine) as llm:
        bf16 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf16 = AutoModelForCausalLM.from_pretrained(gemma4_dir, dtype=torch.bfloat16, attn_implementation="eager")
    assert_bf16_as_close_as_hf(hf, hf16.cuda().eval(), PROMPTS, bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("preset", ["gemma-4-e4b", "gemma-4-26b-a4b"])
def test_a_gemma4_preset_runs_in_cuda_graphs(preset, tmp_path):
    """A real shape with dummy weights (heads of 512 in the Triton kernels, 128 experts of 704): compiled, captured,
    and a decode batch of 8 served; the KV cache holds more context than with every layer global."""
    engine = dict(
        load_format="dummy", max_model_len=8192, compile_cache_dir=str(tmp_path), cudagraph_capture_sizes=(1, 8)
    )
    with LLM(preset, max_num_seqs=8, **engine) as llm:
        outputs = llm.generate([[5, 6, 7] * 100] * 8, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
        spec = llm.engine.executor.kv_spec
        config = llm.engine.model_config
        rows = [config.kv_heads_of(layer) * config.head_dim_of(layer) for layer in range(config.num_layers)]
        all_global = llm.engine.num_kv_blocks * spec.bytes_per_block // (2 * sum(rows) * spec.dtype.itemsize)
        assert llm.engine.startup_stats["kv_cache_tokens"] > all_global
