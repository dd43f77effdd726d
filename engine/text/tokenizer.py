"""Tokenizers: a model directory's own, or the built-in one that presets use.

The built-in tokenizer is a byte-level BPE trained in a few milliseconds on the text below, so a
preset needs no download. Its vocabulary is far smaller than a preset's: ids it does not know decode
to nothing, which is fine for dummy weights, whose output is noise anyway.
"""

from __future__ import annotations

import random
import string
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.engine.models import hub
from kiln.engine.models.gguf_dir import gguf_model_dir
from kiln.engine.models.model_dir import model_dir

if TYPE_CHECKING:  # (transformers is imported when a tokenizer is made: an engine that never makes one skips it)
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BUILTIN_EOS = "<|endoftext|>"

_CORPUS = """\
Kiln serves language models. A request arrives over HTTP, is tokenized, and waits for the scheduler.
Each step the scheduler fills a budget of tokens with the requests that are running, then with new
ones, and the model runner sends the batch through the network on the GPU. The attention layers read
keys and values from a paged cache: blocks of sixteen tokens, handed out from a pool and shared when
two prompts begin with the same words. The sampler picks the next token of every request at once,
greedy or at random, and the detokenizer turns tokens back into text, one piece at a time.
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026.
Questions, answers; lists, tables: and code, like def f(x): return x * 2 + 1.
"""


def train_bpe(texts: list[str], vocab_size: int, eos: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE of up to `vocab_size` tokens trained on `texts`, `eos` its one special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


@lru_cache(maxsize=4)
def builtin_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A small byte-level BPE; deterministic for a given vocab_size."""
    return train_bpe(_CORPUS.splitlines(), vocab_size, BUILTIN_EOS)


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose `vocab_size - 256` tokens (the rest stay unused, as in real models) all decode to
    text: every byte, numbers with and without a leading space, two-character punctuation runs, then words
    of 2-10 letters (half with a leading space, some capitalised) from a fixed seed. For benchmarks of a
    preset's full vocabulary (grammar masks, streaming detokenization); it has no merges, so it encodes text
    byte by byte."""
    num_tokens = vocab_size - 256
    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        if token not in vocab and len(vocab) < num_tokens:
            vocab[token] = len(vocab)

    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        add(char)
    for number in range(1000):
        add(str(number))
        add("Ġ" + str(number))
    punctuation = '{}[]():;,."!?-_=+*/<>#@&%$'
    for a in punctuation:
        for b in punctuation:
            add(a + b)
    rng = random.Random(0)
    while len(vocab) < num_tokens:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 10)))
        add(("Ġ" if rng.random() < 0.5 else "") + (word.capitalize() if rng.random() < 0.3 else word))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def tokenizer_dir(
    model: str,
    tokenizer: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
) -> Path | None:
    """Where a model's tokenizer is read from: `tokenizer` if given (a directory, a GGUF file, or a Hub id whose
    tokenizer files alone are fetched), else the model's directory (`model_dir`); None for a preset without one (the
    built-in tokenizer). Checked: a directory without tokenizer files is an error."""
    if tokenizer is None:
        path = model_dir(model, revision, download_dir, gguf_file)
    elif (local := Path(tokenizer).expanduser()).exists() or not hub.looks_like_repo_id(tokenizer):
        path = gguf_model_dir(local) if local.suffix == ".gguf" and local.is_file() else local
    else:
        path = hub.download(tokenizer, download_dir=download_dir, weights=False)
    if path is not None:
        _check_tokenizer_files(path)
    return path


def tokenizer_dir_of(config: Any) -> Path | None:
    """`tokenizer_dir` of an `EngineConfig`."""
    return tokenizer_dir(config.model, config.tokenizer, config.revision, config.download_dir, config.gguf_file)


def _check_tokenizer_files(path: Path) -> None:
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")


def load_tokenizer(path: str | Path | None, tokenizer_class: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local directory (never fetched from a hub), or for None the built-in one.

    `tokenizer_class` names the transformers class to read it with (`kiln.engine.models.source.
    resolve_tokenizer_class`: the class AutoTokenizer would choose), which imports no torch; without one,
    AutoTokenizer chooses, and imports torch and transformers' generation code (2.4 s with scikit-learn installed)."""
    if path is None:
        return builtin_tokenizer()
    path = Path(path)
    _check_tokenizer_files(path)
    import transformers  # noqa: PLC0415 (see above)

    if tokenizer_class is None:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    cls = getattr(transformers, tokenizer_class, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        raise ValueError(f"{tokenizer_class!r} is not a tokenizer class of transformers {transformers.__version__}")
    return cls.from_pretrained(str(path), local_files_only=True)
