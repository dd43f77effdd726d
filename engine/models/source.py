"""Resolve a `model` argument (a preset, a directory, a GGUF file or a Hub id: `model_dir`) to its config.

What transformers makes of a model's config can be kept (`resolve_model`'s `memo`; the engine keeps it beside
its compile cache), keyed by the config files' bytes and the code and versions that read them: a start that finds
it builds the model without importing transformers' model classes. (Those imports are slow: with scikit-learn
installed, a config class's docstring decorator imports transformers' generation code and, through it,
scikit-learn, a second of a warm start.)
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
from typing import TYPE_CHECKING, Any, Protocol

from kiln.engine.models import config as config_module
from kiln.engine.models import config_families, quant_config
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.gguf_dir import gguf_file_of
from kiln.engine.models.model_dir import model_dir as checked_model_dir
from kiln.engine.models.presets import PRESETS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger("kiln")


class Memo(Protocol):
    """Where resolved configs are kept between starts (the engine passes `kiln.compile.cache.JsonFolder`, beside its
    compile cache): `read` gives None for a name it does not hold."""

    def read(self, name: str) -> Any: ...

    def write(self, name: str, value: Any) -> None: ...


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
    def origin(self) -> str:
        """Where the weights come from, for start-up stats and the compile cache's key: "preset (dummy weights)",
        "gguf NAME.gguf", "hub ORG/NAME@COMMIT" or "directory"."""
        if self.model_dir is None:
            return "preset (dummy weights)"
        if (gguf_file := gguf_file_of(self.model_dir)) is not None:
            return f"gguf {gguf_file.name}"
        if self.model_dir.parent.name == "snapshots" and not Path(self.name).expanduser().exists():
            return f"hub {self.name}@{self.model_dir.name}"
        return "directory"

    @cached_property
    def hf_config(self) -> PretrainedConfig:
        """transformers' config object, read when first asked for (the engine needs only `model_config`; the
        benchmarks' Hugging Face peers ask)."""
        return _hf_config(self.name, self.model_dir)


def resolve_model(
    model: str,
    memo: Memo | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
) -> ModelSource:
    """The model's source and config (a Hub model is downloaded, a GGUF file's directory prepared, when not yet).
    With a `memo`, the resolved config is read from it when kept for these config files, else resolved through
    transformers and kept there (one that cannot be read is resolved again)."""
    model_dir = checked_model_dir(model, revision, download_dir, gguf_file)
    name = f"{_memo_key(model, model_dir)}.json" if memo is not None else None
    if memo is not None and (kept := _from_memo(memo.read(name))) is not None:
        return ModelSource(model, model_dir, *kept)
    hf_config = _hf_config(model, model_dir)
    if model_dir is None:
        eos = _as_tuple(PRESETS[model]["eos_token_id"])
    else:
        eos = _eos_token_ids(model_dir, hf_config)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
    source = ModelSource(model, model_dir, ModelConfig.from_hf(hf_config, eos), dtype_name)
    if memo is not None and f"{_memo_key(model, model_dir)}.json" == name:  # (not if the files changed meanwhile)
        memo.write(name, {"model_config": dataclasses.asdict(source.model_config), "checkpoint_dtype": dtype_name})
    return source


def _from_memo(kept: Any) -> tuple[ModelConfig, str | None] | None:
    if kept is None:
        return None
    try:
        config = kept["model_config"]
        fields = {**config, "eos_token_ids": tuple(config["eos_token_ids"]), "moe_layers": tuple(config["moe_layers"])}
        fields["sliding_layers"] = tuple(config["sliding_layers"])
        fields["linear_layers"] = tuple(config["linear_layers"])
        fields["quantization"] = quant_config.from_dict(config["quantization"])
        return ModelConfig(**fields), kept["checkpoint_dtype"]
    except (KeyError, TypeError) as e:  # of another shape: resolved again
        logger.warning("the model config memo does not fit (%s); resolving the config again", e)
        return None


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
    if model_dir is None:
        return _hash(json.dumps(PRESETS[model], sort_keys=True).encode())
    return _hash(*_files(model_dir, ("config.json", "generation_config.json", "tokenizer_config.json")))


def _files(directory: Path, names: tuple[str, ...]) -> list[bytes]:
    """The files' bytes (b"(none)" for a missing one), then tokenizer.json's size (it can be tens of MB, and what the
    memos keep hangs on its few special tokens, which change its size)."""
    parts = [(directory / name).read_bytes() if (directory / name).exists() else b"(none)" for name in names]
    tokenizer = directory / "tokenizer.json"
    return [*parts, str(tokenizer.stat().st_size if tokenizer.exists() else -1).encode()]


def _hash(*parts: bytes) -> str:
    """A memo's key: its parts, transformers' version and the source of the code that reads them."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    h.update(importlib.metadata.version("transformers").encode())
    for module_file in (__file__, config_module.__file__, config_families.__file__, quant_config.__file__):
        h.update(Path(module_file).read_bytes())
    return h.hexdigest()[:20]


def resolve_tokenizer_class(tokenizer_dir: Path, memo: Memo | None = None) -> str:
    """The name of the transformers class that reads the tokenizer in `tokenizer_dir`, as `AutoTokenizer` chooses it.

    NOTE: the choice weighs the class the files declare against the model type and the tokenizer file itself, and
    takes transformers' config classes, which import torch. The API server, which imports no torch, reads the
    tokenizer with the class named here (`kiln.engine.text.tokenizer.load_tokenizer`). Kept in the `memo` as the
    model's config is."""
    name = f"tokenizer-{_hash(*_files(tokenizer_dir, ('config.json', 'tokenizer_config.json')))}.json"
    kept = memo.read(name) if memo is not None else None
    if isinstance(kept, dict) and isinstance(kept.get("tokenizer_class"), str):
        return kept["tokenizer_class"]
    from transformers import AutoTokenizer  # noqa: PLC0415 (see the module's docstring)

    try:
        tokenizer_class = type(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)).__name__
    except Exception as e:  # (a file of the wrong shape raises anything from KeyError up): said in a line
        raise ValueError(f"{tokenizer_dir}: the tokenizer cannot be read: {type(e).__name__}: {e}") from None
    if memo is not None:
        memo.write(name, {"tokenizer_class": tokenizer_class})
    return tokenizer_class


def _model_type(architecture: str) -> str:
    return {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "MixtralForCausalLM": "mixtral",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3_text",
        "Qwen3_5ForCausalLM": "qwen3_5_text",
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
        "Qwen3NextForCausalLM": "qwen3_next",
        "Gemma4ForCausalLM": "gemma4_text",
        "GptOssForCausalLM": "gpt_oss",
    }[architecture]


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
