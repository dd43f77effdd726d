"""Special tokens' texts kept plain (`special_text`): the trie pattern finds what a plain longest-first alternation
finds, and a rendered chat encodes as the tokenizer encodes it, except that the request's own special texts are
characters."""

from __future__ import annotations

import random
import re

from transformers import AutoTokenizer

from kiln.engine.text.special_text import SpecialText, trie_pattern

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"


def test_the_trie_matches_as_a_longest_first_alternation():
    words = ["<|end|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "ab", "abc", "a", "[INST]", "[/INST]"]
    reference = re.compile("|".join(map(re.escape, sorted(words, key=len, reverse=True))))
    ours = re.compile(trie_pattern(words))
    rng = random.Random(0)
    alphabet = words + list("<|>abcdeimnosxt_[]/ \n")
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert ours.findall(text) == reference.findall(text), text


def test_a_chat_encodes_as_the_tokenizer_does_with_its_own_special_texts_plain(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    special = SpecialText(tokenizer)
    plain = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    assert special.hide(plain) == (plain, None)  # nothing to hide: the caller encodes the text as it is

    messages = [{"role": "user", "content": f"hi {eos} there {eos}{eos}"}, {"role": "assistant", "content": eos}]
    hidden, nonce = special.hide(messages)
    assert nonce is not None and eos not in str(hidden)
    rendered = tokenizer.apply_chat_template(hidden, chat_template=TEMPLATE, tokenize=False)
    ids = special.encode(rendered, nonce)
    assert ids.count(eos_id) == 2  # the template's own, one a message
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False)
    # each turn's text is what the tokenizer makes of it with special tokens read as text
    turns = []
    for piece in tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False).split(eos + "\n"):
        if piece:
            turns += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True) + [eos_id]
            turns += tokenizer.encode("\n", add_special_tokens=False)
    assert ids == turns


def test_keys_and_nested_values_are_hidden_too(tiny_llama_dir):
    """A tool's schema holds property names (keys) and descriptions deep down; an earlier call's arguments too."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    eos = tokenizer.eos_token
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {eos: {"description": eos}}}}}]
    hidden, nonce = SpecialText(tokenizer).hide(tools)
    assert nonce is not None and eos not in str(hidden)
    assert str(hidden).count(nonce) == 2
