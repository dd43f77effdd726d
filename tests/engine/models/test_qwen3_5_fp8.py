"""FP8 of the Gated DeltaNet hybrids against Hugging Face (fp32, CPU): tiny Qwen3.5 (dense and MoE) checkpoints written
as Qwen writes its -FP8 releases, and a Qwen3-Next one in its fused layout, and `--quantization fp8` of 16-bit ones.

As Qwen writes them (Hugging Face's fine-grained FP8: `quant_method` "fp8", e4m3, dynamic activations, square blocks;
128 x 128 in the releases, 16 x 16 here so that the tiny layers are whole blocks): the multimodal checkpoint's names
(`model.language_model.*`, the vision tower beside), every linear layer of the language model in e4m3 with its
`weight_scale_inv` in bf16 (a scale a block, multiplied), the experts one by one (`mlp.experts.N.gate_proj`), and in
16 bits what `modules_to_not_convert` lists: the embedding, the LM head, the norms, the conv, each linear layer's b and
a (`in_proj_b`, `in_proj_a`; Qwen3-Next's `in_proj_ba`), the router and the shared expert's gate, the vision tower.
The reference is transformers' own load of the same FP8 checkpoint (which dequantizes it on a CPU), each FP8 layer's
input rounded through e4m3 a token and 16 columns at a time, as the format says (helpers/fp8.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from kiln.engine import LLM, SamplingParams
from kiln.engine.models.quantization import FP8_DTYPE

from helpers.fp8 import FP8_MAX, round_fp8_inputs
from helpers.models import assert_bf16_as_close_as_hf, assert_greedy_matches_hf, tiny_hybrid_config

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], list(range(20, 61)), [300, 12], list(range(1, 18))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
BLOCK = 16
# NOTE: weights of std 0.1, not the tiny models' 0.2 (helpers/models.py), under which a tiny hybrid amplifies a small
# difference layer after layer: there one e4m3 rounding that went the other way in layer 1's MLP (Kiln's float32 sums
# and HF's in other orders) had grown to 1.2 in layer 4's output, and moved its prompt's log-probabilities by 0.16
INIT = 0.1
# NOTE: a float32 difference (Kiln's sums and HF's in other orders) can move one of a layer's inputs across an e4m3
# boundary, a step of 1/16 of it, and in a hybrid its effect does not stay at its token: in the tiny Qwen3.5-MoE one
# expert's output at one prompt token moved 8e-3 so (Kiln's experts on HF's own input give HF's to the bit), and
# through attention and the recurrent state that prompt's later log-probabilities up to 8e-2, where the other prompts'
# agree to 1e-6. So every log-probability within MAX_ERROR and all prompts' but one within TOL (without its inputs'
# rounding, or its scales, a layer is off by tenths everywhere).
MAX_ERROR, TOL = 0.15, 2e-3
# the language model's linear layers Qwen's FP8 checkpoints quantize (the experts' too: `mlp.experts.N.gate_proj`)
QUANTIZED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_qkvz|out_proj|gate_proj|up_proj|down_proj)$"
)


def qwen_checkpoint(path: Path, kind: str) -> Path:
    """A tiny 16-bit checkpoint as Qwen ships the model (float32 here): Qwen3.5's multimodal one
    (`model.language_model.*` beside the vision tower's `model.visual.*`), Qwen3-Next's text one."""
    from transformers import (  # noqa: PLC0415
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    from kiln.engine.text.tokenizer import builtin_tokenizer  # noqa: PLC0415

    torch.manual_seed(0)
    text = tiny_hybrid_config(kind)
    text.initializer_range = INIT
    if kind == "qwen3_next":
        hf = AutoModelForCausalLM.from_config(text, dtype=torch.float32)
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        config_class, model_class = {
            "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
            "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration),
        }[kind]
        config = config_class(text_config=text.to_dict(), vision_config=vision)
        config.tie_word_embeddings = False
        hf = model_class(config)
    with torch.no_grad():  # (as make_tiny_model_dir's hybrids: norms, decays and a decisive router that matter)
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                p.normal_(0, 0.3)
            elif name.endswith("A_log"):
                p.uniform_(-3.0, 1.0)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(4.0)
    hf.save_pretrained(path)
    builtin_tokenizer(text.vocab_size).save_pretrained(path)
    return path


def write_qwen_fp8(src: Path, dst: Path) -> list[str]:
    """`src`'s checkpoint at `dst` as Qwen's -FP8 releases are written; returns the FP8 modules' names."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    out, quantized, kept = {}, [], ["lm_head"]
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if QUANTIZED.search(module) and not name.startswith(("model.visual.", "mtp.")):
            scale = _block_scales(tensor)
            full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            out[name] = (tensor / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[f"{module}.weight_scale_inv"] = scale
            quantized.append(module)
        else:
            out[name] = tensor
            if name.endswith(".weight") and module != "lm_head":
                kept.append(module)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": kept,
    }
    (dst / "config.json").write_text(json.dumps(config))
    return quantized


def _block_scales(w: torch.Tensor) -> torch.Tensor:
    """A bf16 scale a block: its largest |w| / 448 (the weights divided by the bf16 value, so that they fit)."""
    rows, columns = w.shape
    blocks = w.float().reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    return (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).to(torch.bfloat16)


def fp8_reference(fp8_dir: Path, quantized: list[str]):
    """Transformers' load of the FP8 checkpoint (dequantized on a CPU), its FP8 layers' inputs rounded per group."""
    dequantized = FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK], dequantize=True)  # (on a GPU too)
    hf = AutoModelForCausalLM.from_pretrained(
        fp8_dir, dtype=torch.float32, experts_implementation="eager", quantization_config=dequantized
    ).eval()
    round_inputs(hf, quantized, "group", BLOCK)
    return hf


def round_inputs(hf, quantized: list[str], activations: str, group: int) -> None:
    """Round the inputs of `hf`'s modules that the checkpoint names `quantized` (AutoModelForCausalLM serves a
    multimodal checkpoint's language model alone: `model.language_model.X` is its `model.X`)."""
    names = [name.replace("model.language_model.", "model.") for name in quantized]
    experts = {name.rsplit(".", 2)[0] for name in names if ".mlp.experts." in name}
    round_fp8_inputs(
        hf, dict.fromkeys((n for n in names if ".mlp.experts." not in n), 0.0), experts, activations, group
    )


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def fp8_hybrid(request, tmp_path_factory):
    """(FP8 checkpoint, the FP8 modules' names, the 16-bit checkpoint) of each hybrid."""
    src = qwen_checkpoint(tmp_path_factory.mktemp(request.param) / "bf16", request.param)
    quantized = write_qwen_fp8(src, src.parent / "fp8")
    return src.parent / "fp8", quantized, src


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_checkpoint_written_as_qwen_writes_it_matches_hf(fp8_hybrid, compiled, tmp_path):
    """Eager, and compiled with chunked prefill (chunks of 9: edges inside and across the conv window). The fused
    projections take each part's block scales: Qwen3.5's in_proj_qkv and in_proj_z into in_proj_qkvz, Qwen3-Next's
    in_proj_qkvz cut by key head; b and a stay 16-bit, as the list says."""
    fp8_dir, quantized, _ = fp8_hybrid
    header = json.loads((fp8_dir / "model.safetensors").read_bytes()[8:].split(b"}}", 1)[0] + b"}}")
    dtypes = {entry["dtype"] for name, entry in header.items() if name.endswith("weight_scale_inv")}
    assert dtypes == {"BF16"} and any("in_proj_" in name for name in quantized)
    engine = dict(max_model_len=256, enforce_eager=not compiled, compile_cache_dir=str(tmp_path))
    with LLM(str(fp8_dir), max_num_batched_tokens=9 if compiled else None, **engine) as llm:
        layer = llm.engine.executor.model.model.layers[0]
        attention = layer.linear_attn
        assert attention.in_proj_qkvz.weight.dtype == attention.out_proj.weight.dtype == FP8_DTYPE
        assert attention.in_proj_ba.weight.dtype == torch.float32
        if hasattr(layer.mlp, "experts"):
            assert layer.mlp.experts.w13.dtype == layer.mlp.shared_expert.down_proj.weight.dtype == FP8_DTYPE
            assert layer.mlp.gate.weight.dtype == torch.float32
        assert (
            llm.engine.executor.startup_stats["quantization"] == "fp8 (fp8: weights per block 16x16, activations group)"
        )
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_close_to_hf(fp8_reference(fp8_dir, quantized), outputs)


def assert_close_to_hf(hf, outputs) -> None:
    """HF's greedy tokens (up to a near-tie of its top two, within MAX_ERROR, after half of them); the log-probability
    of each of Kiln's tokens HF's within MAX_ERROR, and within TOL in at least half the prompts. (An activation rounded
    to e4m3 moves a whole e4m3 step where float32 noise crosses a rounding edge, and that noise depends on how many
    rows a matmul has: Kiln's experts take their own tokens, a chunk's or a step's, HF's the whole sequence; on an
    AVX2 CPU two of four prompts land on such an edge.)"""
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, MAX_ERROR, near_tie=True)
    worst = []
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        got = output.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.double(), dim=-1)
        worst.append(
            max(
                abs(lp[t].logprob - reference[i, t].item())
                for i, (t, lp) in enumerate(zip(got.token_ids, got.logprobs))
            )
        )
    assert max(worst) < MAX_ERROR and sorted(worst)[(len(worst) - 1) // 2] < TOL, worst


def test_quantization_fp8_of_a_16_bit_hybrid(fp8_hybrid):
    """`--quantization fp8` of the 16-bit checkpoint: its linear layers (the experts' too) a scale a row, activations
    per token; b and a left in 16 bits, as Qwen's own FP8 checkpoints leave them."""
    _, quantized, src = fp8_hybrid
    with LLM(str(src), enforce_eager=True, max_model_len=256, quantization="fp8") as llm:
        attention = llm.engine.executor.model.model.layers[0].linear_attn
        assert attention.in_proj_qkvz.weight.dtype == FP8_DTYPE and attention.in_proj_qkvz.weight_scale.dim() == 1
        assert attention.in_proj_ba.weight.dtype == torch.float32
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager").eval()
    in_text_model = {name.replace("model.language_model.", "model.") for name in quantized}
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name in in_text_model:
                module.weight.copy_(_per_row(module.weight))
            elif name.endswith(".mlp.experts"):
                gate, up = module.gate_up_proj.chunk(2, dim=1)
                module.gate_up_proj.copy_(torch.cat([_per_row(gate), _per_row(up)], dim=1))
                module.down_proj.copy_(_per_row(module.down_proj))
    round_inputs(hf, quantized, "token", 0)
    assert_close_to_hf(hf, outputs)


def test_quantization_fp8_of_qwens_16_bit_moe_with_its_experts_fused(tmp_path):
    """Qwen's 16-bit Qwen3.5/3.6 MoE checkpoints ship each layer's experts as one tensor (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj` [E, H, I], as transformers holds them; their FP8 ones, one by one): such a
    checkpoint serves as transformers reads it, and `--quantization fp8` of it equals that of the same weights one by
    one."""
    src = qwen_checkpoint(tmp_path / "experts", "qwen3_5_moe")
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".mlp.experts.0.down_proj.weight")]:
        experts = name.removesuffix(".0.down_proj.weight")
        count = sum(1 for n in tensors if n.startswith(experts + ".") and n.endswith(".down_proj.weight"))
        per_expert = {proj: [tensors.pop(f"{experts}.{e}.{proj}.weight") for e in range(count)] for proj in _PROJ}
        tensors[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([gate, up]) for gate, up in zip(per_expert["gate_proj"], per_expert["up_proj"])]
        )
        tensors[f"{experts}.down_proj"] = torch.stack(per_expert["down_proj"])
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    assert not any(".experts.0." in name for name in tensors)
    engine = dict(enforce_eager=True, max_model_len=256)
    with LLM(str(fused), **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32).eval()
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 1e-4)
    with LLM(str(fused), quantization="fp8", **engine) as llm:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(src), quantization="fp8", **engine) as llm:
        want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == [
            lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)
        ]


_PROJ = ("gate_proj", "up_proj", "down_proj")


def _per_row(w: torch.Tensor) -> torch.Tensor:
    """w through e4m3 a scale a row (its largest |w| / 448), dequantized: what `--quantization fp8` serves."""
    scale = w.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    return (w / scale).to(FP8_DTYPE).float() * scale


def test_tensor_parallel_fp8_hybrid_matches_one_rank(tmp_path):
    """TP=2 over gloo on the dense Qwen3.5 in Qwen's FP8: each rank its key and value heads' rows of in_proj_qkvz
    (each part's block scales), its columns of out_proj and the MLP's down (their blocks)."""
    src = qwen_checkpoint(tmp_path / "bf16", "qwen3_5")
    write_qwen_fp8(src, tmp_path / "fp8")
    engine = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=64)
    with LLM(str(tmp_path / "fp8"), **engine) as llm:
        single = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **engine) as llm:
        split = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(single, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(x[token].logprob - y[token].logprob) < MAX_ERROR


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp8_hybrid_on_the_gpu_matches_hf(fp8_hybrid, eager, tmp_path):
    """On the GPU (the FP8 one-row matmul, the block-scaled matmul and the FP8 experts' grouped matmuls on e4m3 tensor
    cores, the linear-attention kernels; eager, and in CUDA graphs): float32 against transformers' load of the same
    checkpoint (the torch attention backend: see test_fp8.py's GPU test), and bf16 as close to it as that model's own
    bf16 run."""
    fp8_dir, quantized, _ = fp8_hybrid
    hf = fp8_reference(fp8_dir, quantized)
    engine = dict(enforce_eager=eager, max_model_len=256, compile_cache_dir=str(tmp_path / "c"), device="cuda")
    with LLM(str(fp8_dir), dtype="float32", attention_backend="torch", **engine) as llm:
        together = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        alone = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in PROMPTS]  # (one row a step)
    assert_close_to_hf(hf, together)
    assert_close_to_hf(hf, alone)
    with LLM(str(fp8_dir), dtype="bfloat16", **engine) as llm:
        bf16 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_bf16_as_close_as_hf(hf, fp8_reference(fp8_dir, quantized).to(torch.bfloat16).cuda(), PROMPTS, bf16)
