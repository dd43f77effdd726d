"""The one real model of the CPU tests, SmolLM2-135M-Instruct as a GGUF file (Kiln's default model), and transformers'
own load of the same file as its reference.

The file is fetched once into the user's Kiln cache (~/.cache/kiln/models, where `kiln generate` puts it: CI's first
command fetches it, the tests reuse it), not into the tests' throwaway cache.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache
from pathlib import Path

import torch

from kiln.backends import environment
from kiln.engine.models.default_model import DEFAULT_MODEL, builtin_model_file


@lru_cache(maxsize=1)
def smollm2_gguf() -> Path:
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    saved = environment.ENV
    environment.ENV = dataclasses.replace(saved, cache_dir=user_cache)
    try:
        return builtin_model_file(DEFAULT_MODEL)
    finally:
        environment.ENV = saved


@lru_cache(maxsize=1)
def smollm2_hf():
    """(model, tokenizer) as transformers loads the GGUF file: dequantized to float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer
