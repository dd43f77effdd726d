"""Build a model and fill its weights: from a local Hugging Face directory, or random ("dummy")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kiln.engine.models.config import ModelConfig
from kiln.engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

# Tensors some checkpoints carry that Kiln recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and the tensor."""


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> nn.Module:
    cls = MODEL_CLASSES[config.architecture]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval().requires_grad_(False)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightLoadError(f"{index} lists shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_checkpoint(model_dir: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield path, name, f.get_tensor(name)


@torch.no_grad()
def load_checkpoint(model: LlamaForCausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; every parameter must be filled."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for path, name, tensor in iterate_checkpoint(model_dir):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied to the embedding, which is loaded under its own name
        target, rows = _target_of(model, name)
        if target not in params:
            raise WeightLoadError(f"{path.name}: tensor {name!r} has no place in {model.config.architecture}")
        param = params[target]
        dest = param if rows is None else param[rows[0] : rows[1]]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightLoadError(
                f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled.add(name if rows is None else f"{target}[{rows[0]}:{rows[1]}]")
    missing = [n for n in _expected_names(model) if n not in filled]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightLoadError(f"{model_dir}: checkpoint is missing {len(missing)} tensors: {shown}")


def _target_of(model: LlamaForCausalLM, name: str) -> tuple[str, tuple[int, int] | None]:
    for hf_name, (fused, shard) in model.stacked_params.items():
        if f".{hf_name}." in name:
            return name.replace(hf_name, fused), model.shard_slice(shard)
    return name, None


def _expected_names(model: LlamaForCausalLM) -> list[str]:
    names = []
    for name, _ in model.named_parameters():
        fused = [(hf, shard) for hf, (f, shard) in model.stacked_params.items() if f".{f}." in name]
        if not fused:
            names.append(name)
        for _, shard in fused:
            if name.endswith("bias") or name.endswith("weight"):
                start, end = model.shard_slice(shard)
                names.append(f"{name}[{start}:{end}]")
    return names


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of realistic scale (norms at 1), for benchmarks and demos without a download."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
