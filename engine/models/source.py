"""Resolve a `model` argument: a built-in preset name or a local Hugging Face directory.

What transformers makes of a model's config can be kept (`resolve_model`'s `memo_dir`; the engine keeps it beside
its compile cache), keyed by the config files' bytes and the code and versions that read them: a start that finds
it builds the model without importing transformers' model classes. (Those imports are slow: with transformers 5.17
and scikit-learn installed, as on the H200, a config class's docstring decorator imports transformers' generation
code and, through it, scikit-learn, ~1 s of a warm start.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.compile.cache import atomic_write_bytes
from kiln.engine.models import config as config_module
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.presets import PRESETS
from kiln.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class ModelSource:
    name: str
    model_dir: Path | None  # None for a preset
    model_config: ModelConfig
    checkpoint_dtype_name: str | None = None  # the config's `dtype` (`torch_dtype`), e.g. "bfloat16"

    @property
    def is_preset(self) -> bool:
        return self.model_dir is None

    @property
    def checkpoint_dtype(self) -> torch.dtype | None:
        dtype = getattr(torch, self.checkpoint_dtype_name or "", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    @cached_property
    def hf_config(self) -> PretrainedConfig:
        """transformers' config object, read when first asked for (the engine needs only `model_config`; the
        benchmarks' Hugging Face peers ask)."""
        return _hf_config(self.name, self.model_dir)


def resolve_model(model: str, memo_dir: Path | None = None) -> ModelSource:
    """The model's source and config. With `memo_dir`, the resolved config is read from there when kept for these
    config files, else resolved through transformers and kept there (a memo that cannot be read or written is
    passed over with a warning: it only saves time)."""
    model_dir = _model_dir(model)
    key = _memo_key(model, model_dir) if memo_dir is not None else None
    if key is not None and (kept := _read_memo(memo_dir / f"{key}.json")) is not None:
        return ModelSource(model, model_dir, *kept)
    hf_config = _hf_config(model, model_dir)
    if model_dir is None:
        eos = _as_tuple(PRESETS[model]["eos_token_id"])
    else:
        eos = _eos_token_ids(model_dir, hf_config)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
    source = ModelSource(model, model_dir, ModelConfig.from_hf(hf_config, eos), dtype_name)
    if key is not None and _memo_key(model, model_dir) == key:  # (not if the files changed while being read)
        _write_memo(memo_dir / f"{key}.json", source)
    return source


def _read_memo(path: Path) -> tuple[ModelConfig, str | None] | None:
    try:
        kept = json.loads(path.read_text())
        fields = {**kept["model_config"], "eos_token_ids": tuple(kept["model_config"]["eos_token_ids"])}
        return ModelConfig(**fields), kept["checkpoint_dtype"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # damaged or unreadable: resolved again
        logger.warning("model config memo %s unreadable (%s); resolving the config again", path, e)
        return None


def _write_memo(path: Path, source: ModelSource) -> None:
    kept = {"model_config": dataclasses.asdict(source.model_config), "checkpoint_dtype": source.checkpoint_dtype_name}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(kept, indent=1).encode())
    except OSError as e:
        logger.warning("model config memo %s not kept (%s)", path, e)


def _model_dir(model: str) -> Path | None:
    """None for a preset; else the model's directory, checked."""
    if model in PRESETS:
        return None
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a built-in preset ({', '.join(sorted(PRESETS))})"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"model path {model!r} is not a directory")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    return path


def _hf_config(model: str, model_dir: Path | None) -> PretrainedConfig:
    from transformers import AutoConfig  # noqa: PLC0415 (see the module's docstring)

    if model_dir is None:
        raw = dict(PRESETS[model])
        return AutoConfig.for_model(_model_type(raw["architectures"][0]), **raw)
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{model_dir / 'config.json'}: cannot be read as a model config: {e}") from None


def _memo_key(model: str, model_dir: Path | None) -> str:
    """A hash of what a resolved config depends on: the preset or the directory's config files, transformers'
    version, and the source of the code that turns its config into a `ModelConfig`."""
    h = hashlib.sha256()
    if model_dir is None:
        h.update(json.dumps(PRESETS[model], sort_keys=True).encode())
    else:
        for path in (model_dir / "config.json", model_dir / "generation_config.json",
                     model_dir / "tokenizer_config.json"):  # fmt: skip
            h.update(path.read_bytes() if path.exists() else b"(none)")
        tokenizer = model_dir / "tokenizer.json"  # (only its size: it can be tens of MB, read for the EOS id alone)
        h.update(str(tokenizer.stat().st_size if tokenizer.exists() else -1).encode())
    h.update(importlib.metadata.version("transformers").encode())
    for module_file in (__file__, config_module.__file__):
        h.update(Path(module_file).read_bytes())
    return h.hexdigest()[:20]


def _model_type(architecture: str) -> str:
    return {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}[architecture]  # fmt: skip


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    """generation_config.json's EOS ids (Llama 3 lists several there), else config.json's, and the tokenizer's EOS
    token, as vLLM stops on it too: a fine-tune may change that one (to an end-of-turn token) and not the configs."""
    eos = None
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    ids = _as_tuple(eos if eos is not None else getattr(hf_config, "eos_token_id", None))
    tokenizer_eos = _tokenizer_eos_id(path)
    return ids if tokenizer_eos is None or tokenizer_eos in ids else (*ids, tokenizer_eos)


# The sampling fields of generation_config.json that become request defaults (vLLM's --generation-config auto),
# each with transformers' own default: a file that only restates it sets nothing, as vLLM reads its diff.
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """The sampling defaults a model's generation_config.json sets ({} for a preset or without the file): what a
    request or `LLM.generate` without sampling params samples with, unless it says otherwise."""
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is None or not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    defaults = {name: config[name] for name, default in _GENERATION_DEFAULTS.items()
                if isinstance(config.get(name), int | float) and not isinstance(config[name], bool)
                and config[name] != default}  # fmt: skip
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults


def _tokenizer_eos_id(path: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token`: from its added tokens, else tokenizer.json's; None if none."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(token, dict) and token.get("content") == eos:
            return int(token_id)
    try:
        tokenizer = json.loads((path / "tokenizer.json").read_text())
        for token in tokenizer.get("added_tokens") or []:
            if isinstance(token, dict) and token.get("content") == eos:
                return int(token["id"])
        vocab = (tokenizer.get("model") or {}).get("vocab")
        return int(vocab[eos]) if isinstance(vocab, dict) and eos in vocab else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):  # none, or of another shape: no id from it
        return None
