"""A chat prompt in which only the chat template's own special tokens are tokens: the special tokens' texts that a
request wrote anywhere (a message's content or reasoning, a tool's description or schema, an earlier call's
arguments) stay plain characters, so a user cannot open or close turns.

    hide(messages, tools)     every string (and dict key) with each special token's text swapped for a placeholder
          │                   of ASCII digits no one can type (a per-request nonce and the token's index)
    chat template renders     the template's own special tokens are the only ones in the text
          │
    encode(text)              split at the template's special tokens (their ids); each piece between has its
                              placeholders put back and is encoded with special tokens read as plain text

NOTE: every step is linear in the input, whatever it holds: one pattern over the tokenizer's special tokens (built
as a trie, so a tokenizer of thousands of them costs a few branches a character), digits for placeholders (one small
pattern puts them back), and the pieces encoded in one batch by the Rust tokenizer (which releases the GIL). A
request of 300,000 special tokens' texts once built a regular expression over 300,000 placeholders on a thread that
held the GIL for minutes, and so froze the API server's event loop.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from tokenizers import Tokenizer


def trie_pattern(words: list[str]) -> str:
    """A regular expression matching any of `words`, the longest where several start at one place, written as a
    trie (`<\\|(?:end\\|>|im_(?:start|end)\\|>)`): a match tries one branch a character, not every word."""
    root: dict = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def walk(node: dict) -> str:
        ends = "" in node
        branches = [re.escape(char) + walk(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:  # a shorter word ends here: the longer ones are tried first (a greedy optional)
            body = ("(?:" + body + ")" if len(branches) == 1 else body) + "?"
        return body

    return walk(root)


class PromptTooLong(Exception):
    """The text's head alone holds more tokens than the limit: `num_tokens` (at least) of them."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(num_tokens)
        self.num_tokens = num_tokens


class SpecialText:
    """One tokenizer's special tokens, kept from a request's strings (`hide`) and encoded as the template wrote them
    (`encode`). Thread-safe: it holds no per-request state, and never toggles the shared tokenizer's settings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self.specials = sorted({t.content for t in decoder.values() if t.special and t.content})
        self.ids = {text: tokenizer.convert_tokens_to_ids(text) for text in self.specials}
        self.index = {text: i for i, text in enumerate(self.specials)}
        self.pattern = re.compile(trie_pattern(self.specials)) if self.specials else None
        self.split_pattern = re.compile(f"({self.pattern.pattern})") if self.specials else None
        self.width = len(str(len(self.specials)))
        # NOTE: a copy of the Rust tokenizer that reads special tokens as text. `split_special_tokens=True` on the
        # shared tokenizer would switch a flag that the pool's other threads read in the middle of their encodes.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.plain: Tokenizer | None = None
        if backend is not None:
            self.plain = Tokenizer.from_str(backend.to_str())
            self.plain.no_truncation()
            self.plain.no_padding()
            self.plain.encode_special_tokens = True
        self.newline_ids = self._encode_plain(["\n"])[0]

    def hide(self, value: Any) -> tuple[Any, str | None]:
        """`value` (messages, tools: lists, dicts and strings) with each special token's text in any string or key
        swapped for a placeholder, and the nonce its placeholders carry (None, and `value` itself, when it held
        none). Raises RecursionError on a value nested past Python's limit."""
        if self.pattern is None:
            return value, None
        nonce = str(secrets.randbelow(10**30)).zfill(30)
        found = False

        def placeholder(match: re.Match) -> str:
            nonlocal found
            found = True
            return f"{nonce}{self.index[match.group(0)]:0{self.width}d}"

        def walk(item: Any) -> Any:
            if isinstance(item, str):
                return self.pattern.sub(placeholder, item)
            if isinstance(item, dict):
                return {walk(k): walk(v) for k, v in item.items()}
            if isinstance(item, list | tuple):
                return [walk(v) for v in item]
            return item

        hidden = walk(value)
        return (hidden, nonce) if found else (value, None)

    def encode(self, text: str, nonce: str, max_chars: int | None = None, max_tokens: int = 0) -> list[int]:
        """The token ids of a template's `text` rendered from `hide`'s output: its own special tokens as tokens, the
        placeholders as their texts' characters. With `max_chars`, a text longer than that has its head of
        `max_chars` characters encoded first, and raises PromptTooLong when the head alone holds over `max_tokens`."""
        if max_chars is not None and len(text) > max_chars:
            head = self._encode(text[:max_chars], nonce)
            if len(head) > max_tokens:
                raise PromptTooLong(len(head))
        return self._encode(text, nonce)

    def _encode(self, text: str, nonce: str) -> list[int]:
        pieces = self.split_pattern.split(text)  # [text, special, text, special, ..., text]
        restore = re.compile(nonce + rf"(\d{{{self.width}}})")
        texts = [restore.sub(lambda m: self.specials[int(m.group(1))], p) for p in pieces[0::2]]
        # Past the first, a piece is encoded after a newline that is then dropped, as transformers' own chat
        # sanitising does: a SentencePiece tokenizer adds a prefix space at a text's start, never after a token.
        encoded = self._encode_plain([texts[0]] + ["\n" + t for t in texts[1:]])
        skip = len(self.newline_ids)
        alone = [i for i in range(1, len(texts)) if encoded[i][:skip] != self.newline_ids]
        for i in range(1, len(texts)):
            encoded[i] = encoded[i][skip:]
        for i, ids in zip(alone, self._encode_plain([texts[i] for i in alone])):  # (the newline joined the text)
            encoded[i] = ids
        ids = list(encoded[0])
        for special, following in zip(pieces[1::2], encoded[1:]):
            ids.append(self.ids[special])
            ids += following
        return ids

    def _encode_plain(self, texts: list[str]) -> list[list[int]]:
        if self.plain is not None:
            return [e.ids for e in self.plain.encode_batch(texts, add_special_tokens=False)]
        # (a tokenizer without a Rust backend keeps no such flag: the argument is its own)
        return [self.tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts]
