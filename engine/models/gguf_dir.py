"""A GGUF file as a model directory: its config, tokenizer and chat template written out once as Hugging Face files
(`config.json`, `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) in Kiln's cache, beside a note of
which file holds the weights. Everything that reads a model directory (the API server, the engine core, the config
memo) then reads a GGUF model as it reads any other; only the weights come from the file itself
(`kiln.engine.models.gguf_weights`).

The files are made by transformers' own GGUF reader (its metadata mapping and tokenizer conversion), in a child
process: that reader imports torch, and the API server, which reads the tokenizer, never does.

    python -m kiln.engine.models.gguf_dir FILE.gguf OUT_DIR    (what `gguf_model_dir` runs)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kiln.backends import environment

SOURCE_NOTE = "kiln_gguf.json"  # in a prepared directory: {"gguf_file": ..., "size": ..., "mtime_ns": ...}

# GGUF's architecture names that Kiln serves, with the Hugging Face class of each. (llama.cpp writes Mistral's
# models as "llama"; transformers tells them apart by the file's name, and Kiln serves both with one class.)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_MISTRAL = "MistralForCausalLM"
# Sizes the metadata gives that transformers' reader leaves at its config class's default for some architectures
_SIZES = {
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def gguf_architecture(path: Path) -> str:
    """The file's `general.architecture`, checked: one Kiln serves, else a one-line error naming it."""
    import gguf  # noqa: PLC0415 (numpy only; read where a GGUF model is asked for)

    try:
        reader = gguf.GGUFReader(str(path))
        arch = str(reader.fields["general.architecture"].contents())
    except (KeyError, ValueError, OSError) as e:
        raise ValueError(f"{path}: not a GGUF file Kiln can read ({type(e).__name__}: {e})") from None
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not one Kiln serves (it serves {', '.join(ARCHITECTURES)})"
        )
    return arch


def gguf_model_dir(path: Path) -> Path:
    """The prepared directory of GGUF file `path`, made on first use; keyed by the file's path, size and modification
    time and the versions of what writes it, so an edited file or a new transformers makes it again."""
    path = path.expanduser().resolve()
    stat = path.stat()
    versions = [importlib.metadata.version(name) for name in ("transformers", "gguf")]
    key = hashlib.sha256("\0".join([str(path), str(stat.st_size), str(stat.st_mtime_ns), *versions]).encode())
    out = environment.ENV.cache_dir / "gguf" / f"{path.stem}-{key.hexdigest()[:16]}"
    if (out / SOURCE_NOTE).is_file():
        return out
    gguf_architecture(path)  # (an architecture Kiln does not serve is said before transformers is started)
    done = subprocess.run(
        [sys.executable, "-m", "kiln.engine.models.gguf_dir", str(path), str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not (out / SOURCE_NOTE).is_file():
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"{path}: its config and tokenizer cannot be read: {last}")
    return out


def gguf_file_of(model_dir: Path) -> Path | None:
    """The GGUF file whose weights a prepared directory stands for; None for an ordinary model directory."""
    note = model_dir / SOURCE_NOTE
    if not note.is_file():
        return None
    return Path(json.loads(note.read_text())["gguf_file"])


def _prepare(path: Path, out: Path) -> None:
    """Write the directory (in the child process): transformers' config and tokenizer of the file, the config's
    class, and the sizes of `_SIZES` where the metadata gives them."""
    import gguf  # noqa: PLC0415
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415

    arch = gguf_architecture(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.architectures = [_MISTRAL if config.model_type == "mistral" else ARCHITECTURES[arch]]
    fields = gguf.GGUFReader(str(path)).fields
    for key, attribute in _SIZES.items():
        if (field := fields.get(f"{arch}.{key}")) is not None:
            setattr(config, attribute, int(field.contents()))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    staging = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    stat = path.stat()
    note = {"gguf_file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "architecture": arch}
    (staging / SOURCE_NOTE).write_text(json.dumps(note, indent=1))
    try:
        os.replace(staging, out)  # (atomic: a concurrent start finds the whole directory or none)
    except OSError:  # another start made it first
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    _prepare(Path(sys.argv[1]), Path(sys.argv[2]))
