"""A `model` argument's directory, and the sampling defaults its generation_config.json sets: what the API server
and `LLM` read of a model before the engine starts (no torch, no transformers).

A `model` is a preset (dummy weights, no directory), the built-in default model, a local directory, a GGUF file, or
a Hugging Face Hub id; each but a preset ends as a local directory of Hugging Face files."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from kiln.engine.models import hub
from kiln.engine.models.default_model import BUILTIN_MODELS, builtin_model_file
from kiln.engine.models.gguf_dir import gguf_model_dir
from kiln.engine.models.presets import PRESETS
from kiln.engine.sampling_params import SamplingParams

# The sampling fields of generation_config.json that become request defaults (vLLM's --generation-config auto),
# each with transformers' own default: a file that only restates it sets nothing, as vLLM reads its diff.
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def model_dir(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
) -> Path | None:
    """None for a preset; else the directory the model is read from, checked: a local Hugging Face directory, a Hub
    repo's snapshot (downloaded into the Hub cache when not there), or for a GGUF file (a path, a directory holding
    one, a built-in model, or `gguf_file` of a directory or Hub repo) its prepared directory (`gguf_dir`)."""
    if model in PRESETS:
        return None
    return _located(model, revision, download_dir, gguf_file)


def model_dir_of(config: Any) -> Path | None:
    """`model_dir` of an `EngineConfig`'s model and its source settings."""
    return model_dir(config.model, config.revision, config.download_dir, config.gguf_file)


@lru_cache(maxsize=16)  # (a process asks several times; a Hub model is looked up once)
def _located(model: str, revision: str | None, download_dir: str | None, gguf_file: str | None) -> Path:
    if model in BUILTIN_MODELS:
        return gguf_model_dir(builtin_model_file(model))
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise NotADirectoryError(f"model path {model!r} is a file but not a .gguf file")
        return gguf_model_dir(path)
    if path.is_dir():
        if gguf_file is not None:
            return gguf_model_dir(_checked_file(path / gguf_file))
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_model_dir(ggufs[0])
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ValueError(f"{path} holds several GGUF files ({names}): choose one with --gguf-file")
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory) and no .gguf file")
    if hub.looks_like_repo_id(model):
        snapshot = hub.download(model, revision, download_dir, gguf_file)
        return gguf_model_dir(snapshot / gguf_file) if gguf_file is not None else snapshot
    raise FileNotFoundError(
        f"model {model!r} is neither a local directory or GGUF file, a Hub id (ORG/NAME), the built-in "
        f"{', '.join(BUILTIN_MODELS)} nor a preset ({', '.join(sorted(PRESETS))})"
    )


def _checked_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"--gguf-file {path.name!r}: no such file in {path.parent}")
    return path


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
    defaults = {
        name: config[name]
        for name, default in _GENERATION_DEFAULTS.items()
        if isinstance(config.get(name), int | float) and not isinstance(config[name], bool) and config[name] != default
    }
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults
