"""A `model` argument's directory, and the sampling defaults its generation_config.json sets: what the API server
and `LLM` read of a model before the engine starts (no torch, no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.engine.models.presets import PRESETS
from kiln.engine.sampling_params import SamplingParams

# The sampling fields of generation_config.json that become request defaults (vLLM's --generation-config auto),
# each with transformers' own default: a file that only restates it sets nothing, as vLLM reads its diff.
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def model_dir(model: str) -> Path | None:
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
