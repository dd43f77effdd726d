"""A tokenizer read by the class the engine core resolves (what the API server does, without torch) is the tokenizer
transformers' AutoTokenizer gives: the same class, the same ids, the same text, the same chat prompt."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from kiln.compile.cache import JsonFolder
from kiln.engine.models.source import resolve_tokenizer_class
from kiln.engine.text.tokenizer import load_tokenizer, tokenizer_dir

TEXTS = ["Hello, my name is", "  two spaces, tabs\tand\nnew lines", "émoji 🙂 and 中文", "<|endoftext|> special"]


def declaring(src, dst, tokenizer_class: str, model_type: str | None = None):
    """A copy of a model directory whose tokenizer_config.json declares `tokenizer_class` (and config.json, with
    `model_type`, another model's type)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    if model_type is not None:
        model = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**model, "model_type": model_type}))
    return dst


# The classes real checkpoints declare; "LlamaTokenizerFast" over a byte-level tokenizer.json (as DeepSeek's) is one
# AutoTokenizer overrules, reading it as TokenizersBackend.
DECLARED = [
    ("TokenizersBackend", None),
    ("PreTrainedTokenizerFast", "llama"),
    ("Qwen2Tokenizer", "qwen2"),
    ("Qwen2TokenizerFast", "qwen3"),
    ("LlamaTokenizerFast", "llama"),
]


@pytest.mark.parametrize("tokenizer_class,model_type", DECLARED)
def test_the_resolved_class_reads_the_tokenizer_as_autotokenizer_does(
    tiny_llama_dir, tmp_path, tokenizer_class, model_type
):
    d = declaring(tiny_llama_dir, tmp_path / "model", tokenizer_class, model_type)
    reference = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    memo = JsonFolder(tmp_path / "memo")
    name = resolve_tokenizer_class(d, memo)
    assert name == type(reference).__name__
    assert resolve_tokenizer_class(d, memo) == name and len(list((tmp_path / "memo").iterdir())) == 1  # kept
    ours = load_tokenizer(d, name)
    assert type(ours) is type(reference)
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    assert ours.apply_chat_template(chat, chat_template=template, tokenize=False) == reference.apply_chat_template(
        chat, chat_template=template, tokenize=False
    )
    assert ours.eos_token_id == reference.eos_token_id


def test_a_name_that_is_no_tokenizer_class_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is not a tokenizer class"):
        load_tokenizer(tiny_llama_dir, "LlamaForCausalLM")


def test_where_the_tokenizer_is_read_from(tiny_llama_dir, tmp_path):
    assert tokenizer_dir("qwen3-0.6b") is None  # a preset: the built-in one
    assert tokenizer_dir(str(tiny_llama_dir)) == tiny_llama_dir
    assert tokenizer_dir("qwen3-0.6b", str(tiny_llama_dir)) == tiny_llama_dir
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer_config.json"):
        tokenizer_dir(str(tmp_path))


def test_a_tokenizer_that_cannot_be_read_is_said_in_a_line(tiny_llama_dir, tmp_path):
    """A tokenizer.json of another shape fails however transformers fails (a KeyError, say): the engine core turns
    that into a ValueError naming the folder, which `kiln serve` prints as its one error line."""
    d = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, d)
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    with pytest.raises(ValueError, match=f"{d}: the tokenizer cannot be read"):
        resolve_tokenizer_class(d)
