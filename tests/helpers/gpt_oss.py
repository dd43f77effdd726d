"""Tiny gpt-oss checkpoints written locally: transformers' GptOssForCausalLM with random weights that make every feature
bite (sinks, biases, the SwiGLU's clamp, a decisive router), saved as its bf16 layout or as OpenAI publishes MXFP4
experts (`*_blocks`, `*_scales`, `quantization_config.quant_method: "mxfp4"`), with a tokenizer that has the harmony
format's special tokens and gpt-oss's chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.backends.kernels import mxfp4

from helpers.models import TINY

HERE = Path(__file__).parent
# the chat template as openai/gpt-oss-20b and -120b ship it (their chat_template.jinja), for the tests of what Kiln
# renders with it
CHAT_TEMPLATE = (HERE / "data" / "gpt_oss_chat_template.jinja").read_text()

# o200k_harmony's special tokens, given the last ids of the tiny vocabulary (the real ones: 199998 on)
HARMONY_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
# the window as published (128) and four layers, sliding and full in turn; heads of 16, four experts (top 2) of 64
# intermediate columns (two 32-value MXFP4 blocks: a block each on two ranks); the clamp at 2 (HF's 7 would not bite
# at these sizes); YaRN as published
TINY_GPT_OSS = dict(
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=128,
    swiglu_limit=2.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    architectures=["GptOssForCausalLM"],
)
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def tiny_gpt_oss_config():
    from transformers import GptOssConfig

    shape = {k: v for k, v in TINY.items() if k not in ("eos_token_id", "bos_token_id", "pad_token_id")}
    return GptOssConfig(**{**shape, **TINY_GPT_OSS})


def harmony_tokenizer(vocab_size: int):
    """A byte-level BPE with the harmony special tokens as the last ids under `vocab_size`, eos `<|return|>`, and
    gpt-oss's chat template."""
    from kiln.engine.text.tokenizer import train_bpe

    corpus = [
        "The weather in Paris is sunny today, and the user asks what to wear outside.",
        "We need to call the tool get_weather with the city, then answer with the result.",
        'Arguments: {"city": "Paris", "unit": "celsius"} and {"location": "Tokyo"}.',
        "Reasoning: low medium high. analysis commentary final functions assistant user developer system",
    ]
    tokenizer = train_bpe(corpus, vocab_size - 16, "<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in HARMONY_TOKENS if t != "<|endoftext|>"]})
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = "<|return|>", "<|endoftext|>", "<|startoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    assert max(tokenizer.convert_tokens_to_ids(list(HARMONY_TOKENS))) < vocab_size
    return tokenizer


def make_tiny_gpt_oss_dir(path: Path, mxfp4_experts: bool, seed: int = 0) -> Path:
    """A tiny gpt-oss checkpoint directory: bf16 layout (transformers' own save), or the experts as MXFP4 blocks and
    scales (the values HF's dequantization gives back are then the model's)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_gpt_oss_config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith("sinks"):  # from below the scores to well above them
                p.normal_(0.0, 1.5)
            elif name.endswith("bias"):  # HF's init leaves the experts' at zero
                p.normal_(0.0, 0.3)
            elif name.endswith("router.weight"):  # decisive: no near-tie for a rounding to tip
                p.mul_(4.0)
    tokenizer = harmony_tokenizer(config.vocab_size)
    ids = tokenizer.convert_tokens_to_ids(["<|return|>", "<|endoftext|>", "<|call|>"])
    model.config.eos_token_id, model.config.pad_token_id = ids[0], ids[1]
    model.generation_config.eos_token_id = ids
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if mxfp4_experts:
        write_mxfp4_experts(path)
    return path


def write_mxfp4_experts(path: Path) -> None:
    """Rewrite a saved checkpoint's experts as OpenAI publishes them: each projection's rows (its outputs: [E, 2I, H]
    for gate_up, [E, H, I] for down) in 32-value blocks, `*_blocks` [E, N, K/32, 16] uint8 and `*_scales`
    [E, N, K/32] uint8; `quantization_config` in config.json."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = weights.pop(name).transpose(1, 2)  # ([E, K, N] as transformers holds it -> by output row)
        packed, scales = mxfp4.quantize(rows)
        weights[f"{name}_blocks"] = packed.unflatten(-1, (-1, mxfp4.BLOCK // 2)).contiguous()
        weights[f"{name}_scales"] = scales.contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))


def hf_gpt_oss(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of a tiny checkpoint (MXFP4 experts dequantized), its experts the plain loop."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    config = json.loads((path / "config.json").read_text())
    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if "quantization_config" in config else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager", **kwargs)
    model.to(dtype)  # (5.17 on the GPU dequantizes MXFP4 experts to bf16 whatever the dtype: exact values there)
    # some transformers releases (5.17, the GPU machine's) fix the clamp at 7.0 and alpha at 1.702 whatever the config
    # says (5.25 reads both from it); the tiny configs' clamp of 2 must bite in the reference too
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "gate_up_proj"):
            module.limit = config["swiglu_limit"]
            module.alpha = config.get("swiglu_alpha", 1.702)
    return model.eval()
