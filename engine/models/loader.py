"""Build a model and fill its weights: from a model directory (safetensors, `pytorch_model*.bin`, or the GGUF file
a prepared directory stands for), or random ("dummy")."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kiln.engine.models import quantization
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.gemma4 import Gemma4ForCausalLM
from kiln.engine.models.gguf_dir import gguf_file_of
from kiln.engine.models.gguf_weights import gguf_tensors
from kiln.engine.models.gpt_oss import GptOssForCausalLM
from kiln.engine.models.layers import RMSNorm
from kiln.engine.models.llama import LlamaForCausalLM
from kiln.engine.models.parallel import ShardId, TensorParallelShard, checkpoint_parts, load_part
from kiln.engine.models.qwen3_5 import Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3_5ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

# Tensors some checkpoints carry that Kiln recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint's language model (Gemma3ForConditionalGeneration: as transformers saves it, and as its
# module tree names it), and the parts Kiln does not serve (config.py warns of them)
_LANGUAGE_MODEL = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_NOT_SERVED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_NOT_SERVED += ("model.visual.", "visual.")  # Qwen3.5's vision tower
_NOT_SERVED += ("model.audio_tower.", "model.embed_vision.", "model.embed_audio.")  # Gemma 4's towers' embedders
# Qwen3.5's and Qwen3-Next's multi-token-prediction layers: kept for speculative decoding, which Kiln does not run yet
_MTP = ("mtp.", "model.mtp.")


def _language_model_name(stored: str) -> str | None:
    """The tensor's name in Kiln's model (a multimodal checkpoint's language model unprefixed); None: skipped."""
    if stored.startswith(_NOT_SERVED + _MTP):
        return None
    for prefix, kiln in _LANGUAGE_MODEL.items():
        if stored.startswith(prefix):
            return kiln + stored.removeprefix(prefix)
    return stored


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and the tensor."""


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    shard: TensorParallelShard | None = None,
) -> nn.Module:
    """The model for one tensor-parallel rank (the whole model by default), weights not yet filled."""
    cls = MODEL_CLASSES[config.architecture]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, max_positions, shard)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.quantization is not None:
        # NOTE: built in 16 bits first, then its linear layers made FP8: start-up needs the 16-bit size for a moment
        quantization.quantize_layers(model, config.quantization, _hf_names(model))
    return model.eval().requires_grad_(False)


def _hf_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The Hugging Face modules of each fused layer ("...qkv_proj": "...q_proj", "...k_proj", "...v_proj")."""
    parts: dict[str, list[str]] = {}
    for hf_name, (fused, _) in model.stacked_params.items():
        parts.setdefault(fused, []).append(hf_name)
    names = {}
    for name, _ in model.named_modules():
        head, _, last = name.rpartition(".")
        if last in parts:
            names[name] = tuple(f"{head}.{hf}" for hf in parts[last])
    return names


def checkpoint_format(model_dir: Path) -> str:
    """What a model directory's weights are: "gguf" (a prepared GGUF directory), "safetensors", or "pt" (only
    `pytorch_model*.bin`)."""
    if gguf_file_of(model_dir) is not None:
        return "gguf"
    if (model_dir / "model.safetensors.index.json").exists() or any(model_dir.glob("*.safetensors")):
        return "safetensors"
    if any(model_dir.glob("pytorch_model*.bin")):
        return "pt"
    raise WeightLoadError(f"no weights Kiln reads in {model_dir} (*.safetensors, pytorch_model*.bin or a GGUF file)")


def _weight_files(model_dir: Path, index_name: str, pattern: str) -> list[Path]:
    index = model_dir / index_name
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightLoadError(f"{index} lists shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob(pattern))
    if not files:
        raise WeightLoadError(f"no {pattern} weights in {model_dir}")
    return files


def safetensors_files(model_dir: Path) -> list[Path]:
    return _weight_files(model_dir, "model.safetensors.index.json", "*.safetensors")


def checkpoint_tensors(model_dir: Path, config: ModelConfig, load_format: str) -> Iterator[tuple[str, str, Any]]:
    """(file, name, tensor) for each tensor of the checkpoint, one at a time: a safetensors slice (a rank reads only its
    rows), a tensor of a memory-mapped `pytorch_model*.bin` (read with `weights_only`), or a dequantized GGUF tensor."""
    found = checkpoint_format(model_dir)
    if load_format not in ("auto", found):
        raise WeightLoadError(f"{model_dir}: --load-format {load_format}, but its weights are {found}")
    if found == "gguf":
        gguf_file = gguf_file_of(model_dir)
        for name, tensor in gguf_tensors(gguf_file, config):
            yield gguf_file.name, name, tensor
    elif found == "pt":
        for path in _weight_files(model_dir, "pytorch_model.bin.index.json", "pytorch_model*.bin"):
            for name, tensor in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
                yield path.name, name, tensor
    else:
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                    yield path.name, stored, f.get_slice(stored)


@torch.no_grad()
def load_checkpoint(model: LlamaForCausalLM, model_dir: Path, load_format: str = "auto") -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; every parameter must be filled."""
    params = dict(model.named_parameters())
    filled: set[tuple[str, ShardId]] = set()
    skipped_mtp = 0
    for file_name, stored, source in checkpoint_tensors(model_dir, model.config, load_format):
        skipped_mtp += stored.startswith(_MTP)
        name = _language_model_name(stored)
        if name is None or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied to the embedding, which is loaded under its own name
        if hasattr(model, "unused_checkpoint_tensor") and model.unused_checkpoint_tensor(name):
            continue
        if (fused := _FUSED_EXPERTS.match(name)) and _stacked_experts(fused) in params:  # (moe.py's experts)
            filled.update(_load_fused_experts(model, fused, file_name, source))
            continue
        target, shard = place_of(model, name)
        if target.endswith((".k_scale", ".v_scale")) and target not in params:
            continue  # KV cache scales with a 16-bit KV cache (startup says so)
        load_tensor(model, target, shard, source, f"{file_name}: tensor {name!r}")
        filled.add((target, shard))
        del source  # NOTE: a dequantized GGUF tensor is freed before the next one is made
    missing = [_describe(target, shard) for target, shard in expected_parts(model) if (target, shard) not in filled]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightLoadError(f"{model_dir}: checkpoint is missing {len(missing)} tensors: {shown}")
    if skipped_mtp:
        logger.info(
            "the checkpoint's %d multi-token-prediction tensors are not loaded (no speculative decoding)", skipped_mtp
        )
    if model.config.norm_weight_offset:  # Gemma's and Qwen3.5's norms scale by 1 + weight: the sum kept
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(model.config.norm_weight_offset)


def _dtype_name(source: Any) -> str:
    """safetensors' name of a tensor's dtype ("F8_E4M3", "BF16", ...)."""
    if hasattr(source, "get_dtype"):
        return source.get_dtype()
    return {torch.float8_e4m3fn: "F8_E4M3"}.get(source.dtype, str(source.dtype).removeprefix("torch."))


# One expert's projection (Qwen's names, Mixtral's w1/w3/w2), stacked into the layer's w13 or w2 (moe.py), and an
# FP8 expert's scales of it, into w13_scale or w2_scale
_EXPERT = re.compile(
    r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|weight_scale)$"
)
_EXPERT_PARTS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1)}
_EXPERT_PARTS |= {"down_proj": ("w2", None), "w2": ("w2", None)}


# Every expert of a layer in one tensor, as transformers holds them and Qwen's 16-bit Qwen3.5/3.6 MoE checkpoints ship
# them (`mlp.experts.gate_up_proj` [E, 2I, H]: each expert's gate's rows then up's; `mlp.experts.down_proj` [E, H, I])
_FUSED_EXPERTS = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def _stacked_experts(fused: re.Match) -> str:
    """The parameter of moe.py's `Experts` a fused experts tensor goes to."""
    return f"{fused['layer']}.mlp.experts.{'w13' if fused['proj'] == 'gate_up_proj' else 'w2'}"


def _load_fused_experts(model: nn.Module, fused: re.Match, file_name: str, source: Any) -> list[tuple[str, ShardId]]:
    """Each expert's part of a fused experts tensor loaded as the checkpoint's tensor of that expert and projection
    would be (moe.py `Experts`: this rank's rows or columns, quantized at load under `--quantization fp8`)."""
    target = _stacked_experts(fused)
    module, param_name = owner_of(model, target)
    if quantization.is_fp8(module) and not quantization.quantized_at_load(module):
        raise WeightLoadError(f"{file_name}: tensor {fused.string!r}: an FP8 checkpoint's experts are read one by one")
    parts = checkpoint_parts(module, param_name)
    num_experts = len(parts) // (2 if param_name == "w13" else 1)
    part_shape = parts[0][1]
    expected = (num_experts, 2 * part_shape[0], part_shape[1]) if param_name == "w13" else (num_experts, *part_shape)
    shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
    if shape != expected:
        raise WeightLoadError(f"{file_name}: tensor {fused.string!r} has shape {shape}, expected {expected}")
    for expert in range(num_experts):
        weights = source[expert : expert + 1][0]  # (one expert read at a time)
        if param_name == "w2":
            load_part(module, param_name, weights, (expert, None))
        else:
            for part, rows in enumerate(weights.split(part_shape[0])):
                load_part(module, param_name, rows, (expert, part))
    return [(target, shard) for shard, _ in parts]


def _shape_fits(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Equal, or both one value (a per-tensor scale ships as [] or [1])."""
    return shape == expected or (len(shape) <= 1 and len(expected) <= 1 and math.prod(shape) == math.prod(expected))


def load_tensor(model: nn.Module, target: str, shard: ShardId, source: Any, what: str) -> None:
    """A checkpoint tensor (`what` names it in errors) into parameter `target` of `model`, or its `shard` of it (a
    part of a fused or stacked parameter, this rank's rows or columns): its place, shape and dtype checked."""
    try:
        module, param_name = owner_of(model, target)
    except AttributeError:
        module, param_name = None, ""
    if not isinstance(getattr(module, param_name, None), nn.Parameter):
        where = model.config.architecture if hasattr(model, "config") else type(model).__name__
        raise WeightLoadError(f"{what} has no place in {where}")
    expected = dict(checkpoint_parts(module, param_name))[shard]
    shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
    if not _shape_fits(shape, expected):
        raise WeightLoadError(f"{what} has shape {shape}, expected {expected}")
    fp8_weight = getattr(module, param_name).dtype == quantization.FP8_DTYPE  # (a layer's weight, experts' w13, w2)
    if fp8_weight and not quantization.quantized_at_load(module) and _dtype_name(source) != "F8_E4M3":
        raise WeightLoadError(f"{what} is {_dtype_name(source)}, expected F8_E4M3")
    load_part(module, param_name, source, shard)


def place_of(model: LlamaForCausalLM, name: str) -> tuple[str, ShardId]:
    """The parameter a checkpoint tensor (a Hugging Face name) goes to, and its shard of it (None: all of it)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router and experts
    name = name.replace(".k_proj.output_scale", ".k_scale").replace(".v_proj.output_scale", ".v_scale")  # (older)
    if name.endswith(".weight_scale_inv"):  # Hugging Face's fine-grained FP8: multiplied, as compressed-tensors' is
        name = name.removesuffix("_inv")
    if (expert := _EXPERT.match(name)) and expert["proj"] in _EXPERT_PARTS:
        param, part = _EXPERT_PARTS[expert["proj"]]
        scale = "_scale" if expert["kind"] == "weight_scale" else ""
        return f"{expert['layer']}.mlp.experts.{param}{scale}", (int(expert["expert"]), part)
    for hf_name, (fused, shard) in model.stacked_params.items():
        if f".{hf_name}." in name:
            return name.replace(hf_name, fused), shard
    return name, None


def owner_of(model: nn.Module, param: str) -> tuple[nn.Module, str]:
    module_name, _, param_name = param.rpartition(".")
    return model.get_submodule(module_name), param_name


def expected_parts(model: nn.Module) -> list[tuple[str, ShardId]]:
    """Every (parameter, shard) a checkpoint must fill."""
    return [
        (name, shard) for name, _ in model.named_parameters() for shard, _ in checkpoint_parts(*owner_of(model, name))
    ]


def _describe(target: str, shard: ShardId) -> str:
    return target if shard is None else f"{target} ({shard})"


# Gemma 4's scales of a layer's output and of its router: random ones would shrink the hidden states to nothing
_SCALES = ("layer_scalar", "router.scale", "router.per_expert_scale")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of realistic scale (norms at 1), for benchmarks and demos without a download.

    Each parameter's whole (unsharded) tensor is drawn and this rank keeps its slice, so the weights are
    the same whatever the tensor-parallel size."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = next(param.dtype for name, param in model.named_parameters() if "norm" in name)
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(_SCALES):
            param.fill_(1.0)
            continue
        module, param_name = owner_of(model, name)
        if hasattr(module, "dummy_source") and (source := module.dummy_source(param_name, generator)) is not None:
            load_part(module, param_name, source, None)  # (weights of a format of their own: gpt-oss's MXFP4)
            continue
        if quantization.is_fp8(module) and not quantization.quantized_at_load(module):
            raise ValueError("dummy weights of an FP8 checkpoint: give its 16-bit sibling with quantization='fp8'")
        parts = checkpoint_parts(module, param_name)
        if not parts:  # (an FP8 layer's scales, made as its weights are quantized)
            continue
        rows = [shape[0] for _, shape in parts]
        full = torch.empty(sum(rows), *parts[0][1][1:], dtype=dtype, device=device)
        full.normal_(0.0, 0.02, generator=generator)
        for (shard, _), source in zip(parts, full.split(rows)):
            load_part(module, param_name, source, shard)


def release_weights(model: nn.Module) -> None:
    """Empty every tensor `model` holds (parameters, buffers, plain tensor attributes): whoever still refers to the
    modules after an engine closes (Dynamo's guards of its trace on some torch versions, a caller) then holds no
    device memory through them."""
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for tensor in held:
            if isinstance(tensor, torch.Tensor):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
