"""Resolve a `model` argument: a built-in preset name or a local Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from kiln.engine.models.config import ModelConfig
from kiln.engine.presets import PRESETS


@dataclass(frozen=True)
class ModelSource:
    name: str
    model_dir: Path | None  # None for a preset
    hf_config: PretrainedConfig
    model_config: ModelConfig

    @property
    def is_preset(self) -> bool:
        return self.model_dir is None


def resolve_model(model: str) -> ModelSource:
    if model in PRESETS:
        raw = dict(PRESETS[model])
        hf_config = AutoConfig.for_model(_model_type(raw["architectures"][0]), **raw)
        return ModelSource(model, None, hf_config, ModelConfig.from_hf(hf_config, _as_tuple(raw["eos_token_id"])))
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a built-in preset ({', '.join(sorted(PRESETS))})"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"model path {model!r} is not a directory")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{path / 'config.json'}: cannot be read as a model config: {e}") from None
    return ModelSource(model, path, hf_config, ModelConfig.from_hf(hf_config, _eos_token_ids(path, hf_config)))


def _model_type(architecture: str) -> str:
    return {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}[architecture]  # fmt: skip


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _eos_token_ids(path: Path, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """generation_config.json's EOS ids win (Llama 3 lists several there); else config.json's."""
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if eos is not None:
            return _as_tuple(eos)
    return _as_tuple(getattr(hf_config, "eos_token_id", None))
