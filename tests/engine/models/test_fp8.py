"""FP8 checkpoints against Hugging Face (fp32, CPU). Tiny Llama, Qwen3 and Qwen3-MoE checkpoints are written here in
each format exactly as it ships (compressed-tensors FP8, FP8_DYNAMIC and FP8_BLOCK as llm-compressor writes them,
Hugging Face's fine-grained FP8 as Qwen3-*-FP8 ships, its experts too), and `--quantization fp8` quantizes a 16-bit
one at load. The reference is the Hugging Face model of the same checkpoint with the dequantized weights, each
quantized layer's input rounded through e4m3 as the format says (a forward pre-hook, or for the experts weight stacks
whose matmuls round their input: this file's own rounding): what an FP8 matmul computes.
"""

from __future__ import annotations

import json
import math
import re
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams
from kiln.engine.models.quantization import FP8_DTYPE

from helpers.fp8 import round_fp8_inputs
from helpers.models import assert_bf16_as_close_as_hf, assert_greedy_matches_hf, make_tiny_model_dir

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
PROMPTS = [[5, 17, 33, 2, 101, 45, 9], list(range(20, 61)), [300, 12]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
BLOCK = (16, 32)  # rows x columns: the tiny models' parts are whole blocks (a real checkpoint's are 128 x 128)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# each layer input's quantization (the parts of a fused layer share their input, and so its calibrated scale)
_INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp"}
_INPUT_OF["down_proj"] = "down"

# format -> (weights, activations)
FORMATS = {
    "ct-fp8": ("tensor", "static"),
    "ct-fp8-dynamic": ("channel", "token"),
    "ct-fp8-block": ("block", "group"),
    "hf-fp8": ("block", "group"),
}


def _quantize(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, scales as the format ships them): w ~ q * s."""
    w = w.float()
    if weights == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        return (w / scale).to(FP8_DTYPE), scale
    if weights == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return (w / scale).to(FP8_DTYPE), scale
    rows, cols = w.shape
    blocks = w.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    return (blocks / scale[:, None, :, None]).reshape(rows, cols).to(FP8_DTYPE), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, weights: str) -> torch.Tensor:
    if weights == "block":
        scale = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return q.float() * scale


def write_fp8_checkpoint(src, dst, fmt: str) -> dict[str, tuple[torch.Tensor, float]]:
    """`src`'s checkpoint in `fmt` at `dst`; returns each quantized layer's (dequantized weight, input scale)."""
    weights, activations = FORMATS[fmt]
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    out, layers = {}, {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if kind != "weight" or proj not in _PROJECTIONS:
            out[name] = tensor
            continue
        q, scale = _quantize(tensor, weights)
        layer = module.rsplit(".", 2)[0]
        # one value per input, as calibration gives (crc32, not hash(): the same scales in every process, so the
        # check is reproducible; a near-tie of two tokens can move with the scales)
        input_scale = 0.02 + 0.01 * (zlib.crc32(f"{layer}.{_INPUT_OF[proj]}".encode()) % 7) / 7
        out[name] = q
        out[f"{module}.weight_scale_inv" if fmt == "hf-fp8" else f"{module}.weight_scale"] = scale
        if activations == "static":
            out[f"{module}.input_scale"] = torch.tensor([input_scale])
        layers[module] = (_dequantize(q, scale, weights), input_scale)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config_of(fmt)
    (dst / "config.json").write_text(json.dumps(config))
    return layers


def _config_of(fmt: str) -> dict:
    if fmt == "hf-fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    weights, activations = FORMATS[fmt]
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "observer": "minmax"}
    scheme = {"weights": {**fp8, "strategy": weights, "dynamic": False, "block_structure": None}}
    if weights == "block":
        scheme["weights"]["block_structure"] = list(BLOCK)
    scheme["input_activations"] = {
        "static": {**fp8, "strategy": "tensor", "dynamic": False},
        "token": {**fp8, "strategy": "token", "dynamic": True, "observer": None},
        "group": {**fp8, "strategy": "group", "dynamic": True, "group_size": BLOCK[1], "observer": None},
    }[activations]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, **scheme}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def fp8_reference(src, layers, activations: str):
    """The Hugging Face model of `src` with the FP8 layers' dequantized weights and e4m3-rounded inputs. A mixture's
    experts run Hugging Face's own expert loop ("eager") over weight stacks whose matmuls round their inputs."""
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager").eval()
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, (weight, _) in layers.items():
        if match := _EXPERT.match(name):
            experts.setdefault(match["experts"], {})[int(match["index"]), match["proj"]] = weight
    for name, module in hf.named_modules():
        if name in layers:
            module.weight.data.copy_(layers[name][0])
        elif name in experts:
            weights, count = experts[name], module.num_experts
            module.gate_up_proj.data.copy_(
                torch.stack([torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]]) for e in range(count)])
            )
            module.down_proj.data.copy_(torch.stack([weights[e, "down_proj"] for e in range(count)]))
    input_scales = {name: input_scale for name, (_, input_scale) in layers.items() if not _EXPERT.match(name)}
    round_fp8_inputs(hf, input_scales, experts, activations, BLOCK[1])
    return hf


# one expert's projection as a checkpoint names it
_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def assert_matches(hf, prompts, outputs, tol: float) -> None:
    """HF's greedy tokens (up to a near-tie of HF's top two, within `tol`, after half of them) and log-probabilities."""
    assert_greedy_matches_hf(hf, prompts, outputs, MAX_TOKENS, tol, near_tie=True)


# A float32 difference in a layer's input (Kiln's norm and HF's sum in other orders) can move one value across an
# e4m3 rounding boundary, a step of 1/16 of it: a few 1e-4 in a log-probability, where unquantized models agree
# to 1e-5.
TOL = 2e-3
# An expert's inputs rounded a token at a time move more: in the tiny Qwen3-MoE, HF's expert inputs 3e-7 larger (float32
# noise) move one log-probability by 8e-3 and leave the others at 1e-6 (which one moves hangs on the batch's shapes)
MOE_TOL = 1e-2


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_fp8_checkpoint_matches_hf_with_its_dequantized_weights(tiny_dir, tmp_path, fmt):
    layers = write_fp8_checkpoint(tiny_dir, tmp_path / fmt, fmt)
    with LLM(str(tmp_path / fmt), enforce_eager=True, max_model_len=128) as llm:
        qkv = llm.engine.executor.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == FP8_DTYPE and llm.engine.executor.model.lm_head.weight.dtype == torch.float32
        assert llm.engine.executor.startup_stats["quantization"].startswith("fp8 (")
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(fp8_reference(tiny_dir, layers, FORMATS[fmt][1]), PROMPTS, outputs, TOL)


@pytest.mark.parametrize("fmt", ["ct-fp8", "hf-fp8"])
def test_compiled_and_chunked_fp8_match_hf(tiny_model_dir_qwen3, tmp_path, fmt):
    layers = write_fp8_checkpoint(tiny_model_dir_qwen3, tmp_path / fmt, fmt)
    engine = dict(max_model_len=128, max_num_batched_tokens=16, compile_cache_dir=str(tmp_path / "cache"))
    with LLM(str(tmp_path / fmt), **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(fp8_reference(tiny_model_dir_qwen3, layers, FORMATS[fmt][1]), PROMPTS, outputs, TOL)


def test_quantization_fp8_quantizes_a_16_bit_checkpoint_at_load(tiny_llama_dir):
    """Per output channel (a scale a row, its largest |w| / 448), activations per token."""
    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128, quantization="fp8") as llm:
        down = llm.engine.executor.model.model.layers[1].mlp.down_proj
        assert down.weight.dtype == FP8_DTYPE and down.weight_scale.shape == (down.out_features,)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    layers = {}
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in _PROJECTIONS:
            layers[name] = (_dequantize(*_quantize(module.weight, "channel"), "channel"), 0.0)
    assert_matches(fp8_reference(tiny_llama_dir, layers, "token"), PROMPTS, outputs, TOL)


def test_dummy_weights_with_quantization_fp8(tiny_llama_dir):
    """`--load-format dummy --quantization fp8`: every preset benchmarks in FP8 (its weights drawn, then quantized)."""
    with LLM(str(tiny_llama_dir), load_format="dummy", quantization="fp8", max_model_len=64, enforce_eager=True) as llm:
        gate_up = llm.engine.executor.model.model.layers[0].mlp.gate_up_proj
        assert gate_up.weight.dtype == FP8_DTYPE and bool((gate_up.weight_scale > 0).all())
        (output,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_tensor_parallel_fp8_matches_one_rank(tiny_llama_dir, tmp_path):
    """TP=2 over gloo: each rank its rows (qkv, gate_up: their per-part scales) or columns (o, down: their blocks)."""
    write_fp8_checkpoint(tiny_llama_dir, tmp_path / "m", "hf-fp8")
    engine = dict(enforce_eager=True, max_model_len=128)
    with LLM(str(tmp_path / "m"), **engine) as llm:
        single = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(tmp_path / "m"), tensor_parallel_size=2, **engine) as llm:
        split = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert math.isclose(x[token].logprob, y[token].logprob, abs_tol=TOL)


def test_a_scale_missing_or_a_16_bit_weight_is_refused_by_name(tiny_llama_dir, tmp_path):
    write_fp8_checkpoint(tiny_llama_dir, tmp_path / "m", "ct-fp8-dynamic")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        LLM(str(tmp_path / "m"), enforce_eager=True, max_model_len=64)
    tensors["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(64, 1)
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' is F32, expected F8_E4M3"):
        LLM(str(tmp_path / "m"), enforce_eager=True, max_model_len=64)


def test_an_fp8_lm_head_or_a_half_ignored_fused_layer_is_refused(tiny_llama_dir, tmp_path):
    write_fp8_checkpoint(tiny_llama_dir, tmp_path / "m", "ct-fp8")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"] = []
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="an FP8 lm_head"):
        LLM(str(tmp_path / "m"), enforce_eager=True, max_model_len=64)
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*k_proj$"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ignoring only some of .*q_proj, .*k_proj, .*v_proj"):
        LLM(str(tmp_path / "m"), enforce_eager=True, max_model_len=64)


def test_a_server_with_quantization_fp8_says_so_in_its_metrics_and_serves(tiny_llama_dir):
    """`kiln serve --quantization fp8`: /metrics names the quantization, and the official client's greedy completion
    is the offline engine's."""
    from helpers.server import Server  # noqa: PLC0415  (imports openai)

    with LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128, quantization="fp8") as llm:
        (offline,) = llm.generate([[5, 17, 33]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    server = Server(tiny_llama_dir, "--quantization", "fp8")
    try:
        metrics = server.get("/metrics")[1].decode()
        (line,) = [line for line in metrics.splitlines() if line.startswith("kiln_model_config_info{")]
        assert 'quantization="fp8 (online: weights per channel, activations token)"' in line
        completion = server.client().completions.create(
            model=server.model, prompt=[5, 17, 33], max_tokens=6, temperature=0.0, logprobs=1
        )
        assert completion.choices[0].logprobs.tokens is not None
        assert completion.choices[0].text == offline.outputs[0].text
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(
    "model,fmt",
    [
        ("qwen3", "ct-fp8"),
        ("qwen3", "ct-fp8-dynamic"),
        ("qwen3", "hf-fp8"),
        ("llama", "ct-fp8-dynamic"),
        ("qwen3_moe", "hf-fp8"),  # (the FP8 experts' grouped matmuls: 16 x 32 blocks)
        ("qwen3_moe", "ct-fp8-dynamic"),  # (a scale a row)
    ],
)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp8_on_the_gpu_matches_hf(request, model, tmp_path, fmt, eager):
    """On the GPU (the one-row kernel for a batch of one, with its SiLU-and-mul, and for Llama compiled its rotary,
    inside; torch._scaled_mm, the block-scaled matmul, CUDA graphs): float32 greedy tokens and log-probabilities
    those of Hugging Face's model with the dequantized weights and e4m3-rounded inputs, and bf16 log-probabilities
    as close to them as that model's own bf16 run.
    The float32 run takes the torch attention backend: the Triton one's dots round their inputs to TF32, and a
    layer's input an ulp of TF32 away moves many e4m3 roundings (0.2 in a log-probability here); its IEEE float32
    still moves one now and then (up to a few 1e-2 here, where unquantized models agree to 1e-5): 5e-2."""
    fixtures = {"qwen3": "tiny_model_dir_qwen3", "llama": "tiny_llama_dir", "qwen3_moe": "tiny_qwen3_moe_dir"}
    model_dir = request.getfixturevalue(fixtures[model])
    layers = write_fp8_checkpoint(model_dir, tmp_path / fmt, fmt)
    hf = fp8_reference(model_dir, layers, FORMATS[fmt][1])
    engine = dict(enforce_eager=eager, max_model_len=128, compile_cache_dir=str(tmp_path / "c"), device="cuda")
    with LLM(str(tmp_path / fmt), dtype="float32", attention_backend="torch", **engine) as llm:
        together = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        alone = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in PROMPTS]  # (one row a step)
    assert_greedy_matches_hf(hf, PROMPTS, together, MAX_TOKENS, 5e-2, near_tie=True)
    assert_greedy_matches_hf(hf, PROMPTS, alone, MAX_TOKENS, 5e-2, near_tie=True)
    with LLM(str(tmp_path / fmt), dtype="bfloat16", **engine) as llm:
        bf16 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf16 = fp8_reference(model_dir, layers, FORMATS[fmt][1]).to(torch.bfloat16).cuda()
    assert_bf16_as_close_as_hf(hf, hf16, PROMPTS, bf16)


def test_an_fp8_warm_start_compiles_nothing_and_has_its_own_cache_key(tiny_llama_dir, tmp_path):
    """The FP8 op is opaque to Dynamo, so the saved graph holds it: a warm start traces and compiles nothing and
    gives the cold start's logprobs; the 16-bit model of the same checkpoint keys another cache entry."""
    engine = dict(max_model_len=128, compile_cache_dir=str(tmp_path / "cache"))

    def start(**extra):
        with LLM(str(tiny_llama_dir), **engine, **extra) as llm:
            outputs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]
            return llm.engine.startup_stats, outputs

    cold, want = start(quantization="fp8")
    warm, got = start(quantization="fp8")
    assert cold["dynamo_traces"] == 1 and warm["dynamo_traces"] == 0 and warm["inductor_compiles"] == 0
    assert got == want
    plain, _ = start()
    assert plain["dynamo_traces"] == 1 and plain["compile_cache_dir"] != cold["compile_cache_dir"]


@pytest.mark.parametrize("fmt", ["hf-fp8", "ct-fp8-dynamic"])
def test_a_mixture_of_experts_fp8_checkpoint_matches_hf(tiny_qwen3_moe_dir, tmp_path, fmt):
    """Qwen3-MoE with every expert's projections FP8 (`experts.N.gate_proj.weight` and its `weight_scale_inv` as
    Qwen3-30B-A3B-FP8 ships them, blocks here of 16 x 32; or a scale a row, as llm-compressor's FP8_DYNAMIC), the
    router in 16 bits: Kiln's FP8 experts (`kiln::fused_moe_fp8`, its CPU form) equal HF's expert loop on the
    dequantized weights with each matmul's input rounded as the format says."""
    layers = write_fp8_checkpoint(tiny_qwen3_moe_dir, tmp_path / fmt, fmt)
    assert any(".experts.7.down_proj" in name for name in layers)
    with LLM(str(tmp_path / fmt), enforce_eager=True, max_model_len=128) as llm:
        experts = llm.engine.executor.model.model.layers[1].mlp.experts
        assert experts.w13.dtype == experts.w2.dtype == FP8_DTYPE
        blocks = (8, 2 * 32 // 16, 64 // 32) if fmt == "hf-fp8" else (8, 2 * 32)  # gate and up: 32 rows each
        assert experts.w13_scale.shape == blocks
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(fp8_reference(tiny_qwen3_moe_dir, layers, FORMATS[fmt][1]), PROMPTS, outputs, MOE_TOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_quantization_fp8_quantizes_a_mixture_of_experts_at_load(tiny_qwen3_moe_dir, tmp_path, compiled):
    """`--quantization fp8` of a 16-bit Qwen3-MoE: every expert's projections too, a scale a row, activations per
    token (compiled: the op in the graph, chunked prefill)."""
    engine = dict(enforce_eager=not compiled, max_model_len=128, compile_cache_dir=str(tmp_path))
    with LLM(str(tiny_qwen3_moe_dir), quantization="fp8", max_num_batched_tokens=16, **engine) as llm:
        experts = llm.engine.executor.model.model.layers[1].mlp.experts
        assert experts.w2.dtype == FP8_DTYPE and experts.w2_scale.shape == (8, 64)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    layers = {}
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in _PROJECTIONS:
            layers[name] = (_dequantize(*_quantize(module.weight, "channel"), "channel"), 0.0)
        elif name.endswith(".mlp.experts"):
            for e, (gate_up, down) in enumerate(zip(module.gate_up_proj, module.down_proj)):
                gate, up = gate_up.chunk(2)
                for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                    layers[f"{name}.{e}.{proj}"] = (_dequantize(*_quantize(w, "channel"), "channel"), 0.0)
    assert_matches(fp8_reference(tiny_qwen3_moe_dir, layers, "token"), PROMPTS, outputs, MOE_TOL)


def test_fp8_experts_refuse_what_they_cannot_hold(tiny_qwen3_moe_dir, tmp_path):
    """Static activation scales (compressed-tensors' FP8) and an ignore list naming some experts but not all: each
    one line at start."""
    write_fp8_checkpoint(tiny_qwen3_moe_dir, tmp_path / "m", "ct-fp8")
    with pytest.raises(ValueError, match="FP8 experts whose activations are 'static'"):
        LLM(str(tmp_path / "m"), enforce_eager=True, max_model_len=64)
    write_fp8_checkpoint(tiny_qwen3_moe_dir, tmp_path / "b", "hf-fp8")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["re:.*experts\\.3\\..*"]
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"ignoring only some of model\.layers\.1\.mlp\.experts's experts"):
        LLM(str(tmp_path / "b"), enforce_eager=True, max_model_len=64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_fp8_kv_cache_holds_more_blocks_and_matches_hf_with_e4m3_keys_and_values(
    tiny_llama_dir, backend, monkeypatch
):
    """`kv_cache_dtype="fp8"`: the same KV memory holds 4x the blocks of a float32 cache (2x a 16-bit one), and the
    model equals Hugging Face's with every key (after the rotary) and value rounded through e4m3, as the cache
    holds them."""
    from transformers.models.llama import modeling_llama  # noqa: PLC0415

    engine = dict(enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=1 << 22, attention_backend=backend)
    with LLM(str(tiny_llama_dir), **engine) as llm:
        blocks = llm.engine.startup_stats["num_kv_blocks"]
    with LLM(str(tiny_llama_dir), kv_cache_dtype="fp8", **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.engine.startup_stats
    assert stats["num_kv_blocks"] == 4 * blocks and stats["kv_cache_dtype"] == "float8_e4m3fn"

    def e4m3(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype)

    rotary = modeling_llama.apply_rotary_pos_emb

    def rotate_and_round(q, k, *args, **kwargs):
        q, k = rotary(q, k, *args, **kwargs)
        return q, e4m3(k)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotate_and_round)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for layer in hf.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda m, args, out: e4m3(out))
    # (every key and value is rounded here, so a float32 difference crossing an e4m3 boundary is likelier than in
    # the layers' inputs: 5x TOL)
    assert_matches(hf, PROMPTS, outputs, 5 * TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_checkpoints_kv_cache_scales_with_an_fp8_kv_cache(tiny_llama_dir, tmp_path, backend, monkeypatch):
    """compressed-tensors' kv_cache_scheme: each attention's k_scale and v_scale; with `kv_cache_dtype="fp8"` the
    cache holds k / k_scale and v / v_scale in e4m3 (the scales here small enough that the largest keys saturate at
    448 * k_scale: read with a scale of 1, they would not), equal to Hugging Face's with keys and values so rounded;
    with a 16-bit cache the scales are loaded past and unused."""
    from transformers.models.llama import modeling_llama  # noqa: PLC0415

    layers = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "m", "ct-fp8")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    k_scale, v_scale = 0.004, 0.02
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k_scale])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)  # (as [] or [1]: both ship)
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    engine = dict(enforce_eager=True, max_model_len=128, attention_backend=backend)
    with LLM(str(tmp_path / "m"), kv_cache_dtype="fp8", **engine) as llm:
        attn = llm.engine.executor.model.model.layers[1].self_attn
        assert attn.k_scale.item() == pytest.approx(k_scale) and attn.v_scale.item() == pytest.approx(v_scale)
        assert "KV cache scales" in llm.engine.startup_stats["quantization"]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(tmp_path / "m"), **engine) as llm:
        assert not hasattr(llm.engine.executor.model.model.layers[1].self_attn, "k_scale")
        plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches(fp8_reference(tiny_llama_dir, layers, "static"), PROMPTS, plain, TOL)

    def e4m3(x, scale):
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype) * scale

    rotary = modeling_llama.apply_rotary_pos_emb

    def rotate_and_round(q, k, *args, **kwargs):
        q, k = rotary(q, k, *args, **kwargs)
        return q, e4m3(k, k_scale)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotate_and_round)
    hf = fp8_reference(tiny_llama_dir, layers, "static")
    assert max(float(p.abs().max()) for n, p in hf.named_parameters() if "k_proj" in n) > 0  # (a reference)
    for layer in hf.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda m, args, out: e4m3(out, v_scale))
    assert_matches(hf, PROMPTS, outputs, 5 * TOL)
