"""Gemma 2 and Gemma 3 (text) against Hugging Face (fp32, CPU): tiny models of three layers, two sliding (window 8)
and one global; GeGLU, embeddings scaled by sqrt(hidden), the four norms a layer with weights 1 + the checkpoint's,
query_pre_attn_scalar, tied embeddings; Gemma 2's attention scores and logits soft-capped (at 2.5 and 3, so that
the caps bite), Gemma 3's q/k norms and its two RoPEs (base 10k on the sliding layers, 1M with linear scaling x2 on
the global one). Prompts of 50 and more, so that the windows matter. Eager and compiled, chunked prefill, a prefix
hit across the window's edge, both attention backends (Triton's under the interpreter)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

from helpers.models import (
    assert_bf16_as_close_as_hf,
    assert_greedy_matches_hf,
    make_tiny_model_dir,
    skip_uninterpreted_triton,
)

PROMPTS = [list(range(3, 60)), [(7 * i) % 500 + 1 for i in range(70)], list(range(100, 151))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def hf(gemma_dir):
    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_the_model_is_the_one_described(gemma_dir, hf):
    """(the checks have teeth: the norms' weights are not HF's zeros, two of the three layers slide, and Gemma 2's
    caps bite: without them the same model gives other logits)"""
    config = hf.config
    assert config.layer_types.count("sliding_attention") == 2
    norms = [p for name, p in hf.named_parameters() if name.endswith("norm.weight")]
    per_layer = 6 if type(hf).__name__ == "Gemma3ForCausalLM" else 4  # (Gemma 3's q/k norms besides the four)
    assert len(norms) == 3 * per_layer + 1 and all(p.abs().max() > 0.1 for p in norms)
    if type(hf).__name__ == "Gemma2ForCausalLM":
        uncapped = AutoModelForCausalLM.from_pretrained(
            gemma_dir, dtype=torch.float32, attn_implementation="eager", attn_logit_softcapping=None
        ).eval()
        with torch.no_grad():
            prompt = torch.tensor([PROMPTS[0]])
            assert (hf(prompt).logits[0, -1] - uncapped(prompt).logits[0, -1]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("budget", [None, 13], ids=["whole-prefill", "chunked-13"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_gemma3_matches_hf(gemma_dir, hf, tmp_path, backend, budget, enforce_eager):
    skip_uninterpreted_triton(backend)
    engine = dict(max_model_len=256, max_num_batched_tokens=budget, attention_backend=backend, device="cpu")
    with LLM(str(gemma_dir), enforce_eager=enforce_eager, compile_cache_dir=str(tmp_path), **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_gemma3_prefix_hit_across_the_window_edge(gemma_dir, hf, backend):
    skip_uninterpreted_triton(backend)
    first = list(range(3, 60))
    second = first[:48] + [400, 401, 402, 403, 404, 405]
    with LLM(str(gemma_dir), enforce_eager=True, max_model_len=256, attention_backend=backend, device="cpu") as llm:
        llm.generate([first], GREEDY, use_tqdm=False)
        (output,) = llm.generate([second], GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.kv.prefix_cache_hits >= 48
    assert_greedy_matches_hf(hf, [second], [output], MAX_TOKENS, 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_sliding_layers_keep_only_their_windows_blocks(gemma_dir, hf, backend):
    """A block table a KV group (the global layer's, each sliding layer's), over one pool: the sliding layers'
    blocks behind the window go back as it moves. 47 usable blocks of 4 tokens start a max_model_len of 128 (32
    blocks a layer: 96 if every layer kept its whole context) and run the prompts and their tokens equal to HF's,
    preempting where they must; every block comes back."""
    skip_uninterpreted_triton(backend)
    engine = dict(enforce_eager=True, attention_backend=backend, device="cpu", block_size=4, num_kv_blocks=48)
    with LLM(str(gemma_dir), max_model_len=128, max_num_batched_tokens=8, **engine) as llm:
        manager = llm.engine.kv_cache_manager
        assert manager.groups.windows == (0, 8, 8) and len(llm.engine.executor.kv_caches) == 3
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert manager.num_free_blocks == 47 and manager.usage == 0.0
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 1e-4)


def test_gemma_variants_kiln_does_not_compute_are_refused_in_one_line(gemma_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gemma_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        LLM(str(d), enforce_eager=True, max_model_len=64, device="cpu")


def test_the_language_model_of_a_gemma3_for_conditional_generation_checkpoint(tmp_path, caplog):
    """A Gemma3ForConditionalGeneration checkpoint (a SigLIP vision tower and its projector beside the language
    model, under the `language_model.` prefix transformers saves): Kiln serves the language model, with one warning
    for the vision tower, and its text-only greedy output is Hugging Face's multimodal model's on the same ids."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig  # noqa: PLC0415

    from helpers.models import tiny_hf_config  # noqa: PLC0415

    torch.manual_seed(0)
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    text = tiny_hf_config("gemma3").to_dict()
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=16)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    make_tiny_model_dir(tmp_path / "tok", "gemma3")  # (its tokenizer, beside the checkpoint)
    for f in (tmp_path / "tok").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    with caplog.at_level("WARNING"), LLM(str(tmp_path), enforce_eager=True, max_model_len=256, device="cpu") as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any("vision tower is ignored" in r.getMessage() for r in caplog.records)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 1e-4)


@pytest.mark.parametrize("preset", ["gemma-2-9b", "gemma-3-1b", "gemma-3-12b", "gemma-3-27b"])
def test_each_gemma_preset_has_hugging_faces_parameters(preset):
    """Kiln's model of each preset (on the meta device) has the parameter count of Hugging Face's model of the same
    config (its 4 norms a layer, q/k norms, tied embeddings), and the layers slide as the config's pattern says."""
    from transformers import AutoConfig  # noqa: PLC0415

    from kiln.engine.models.loader import build_model  # noqa: PLC0415
    from kiln.engine.models.presets import PRESETS  # noqa: PLC0415
    from kiln.engine.models.source import _model_type, resolve_model  # noqa: PLC0415

    raw = dict(PRESETS[preset])
    hf_config = AutoConfig.for_model(_model_type(raw["architectures"][0]), **raw)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    model_config = resolve_model(preset).model_config
    ours = build_model(model_config, torch.bfloat16, torch.device("meta"), 4096)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
    sliding = [i for i, kind in enumerate(hf_config.layer_types) if kind == "sliding_attention"]
    assert list(model_config.sliding_layers) == sliding and model_config.sliding_window == hf_config.sliding_window


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_gemma_on_the_gpu_matches_hf(gemma_dir, hf, tmp_path, enforce_eager):
    """On the GPU (the Triton kernels' windows and soft caps, a block table a KV group in full and piecewise CUDA
    graphs, the sliding groups' blocks freed as their windows move): float32 greedy tokens and log-probabilities
    Hugging Face's (within TF32's rounding of the attention's dots), and bf16 log-probabilities as close to them as
    Hugging Face's own bf16 run."""
    # three prompts: graphs of one to four rows are all that decode replays
    engine = dict(
        max_model_len=256,
        block_size=4,
        compile_cache_dir=str(tmp_path),
        device="cuda",
        cudagraph_capture_sizes=(1, 2, 4),
    )
    with LLM(str(gemma_dir), enforce_eager=enforce_eager, dtype="float32", **engine) as llm:
        assert llm.engine.kv_cache_manager.groups.num_groups == 3
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.kv_cache_manager.usage == 0.0
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 5e-3, near_tie=True)
    with LLM(str(gemma_dir), enforce_eager=enforce_eager, dtype="bfloat16", **engine) as llm:
        bf16 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf16 = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.bfloat16, attn_implementation="eager")
    assert_bf16_as_close_as_hf(hf, hf16.cuda().eval(), PROMPTS, bf16)
