"""Incremental detokenization and stop strings.

Decoding the whole output after every token costs O(n^2); instead we decode a short window and emit
only the text it adds. A window ending in U+FFFD is an incomplete UTF-8 character (a multi-byte
character split across tokens): we wait for the next token rather than emit half of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded along, so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer directly when that is all `tokenizer.decode` would do (no clean-up pass): the
        # Python wrapper costs several times the decode itself, twice per token.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = len(self.token_ids)  # text up to here has been emitted
        self.text = ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (maybe empty)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if full_text == prefix_text:
            # The new tokens add nothing (skipped special tokens, ids the tokenizer does not know): dropped from
            # the window, which would otherwise grow with them and make every later decode longer.
            del self.token_ids[self.read_offset :]
            return ""
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is held back, incomplete characters included."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def find_stop_string(text: str, new_text_len: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """The first stop string that ends within the last `new_text_len` characters of `text`.

    Returns (stop string, index where it starts) or None. Only the tail is searched: a stop string
    can straddle the boundary between earlier text and the new piece, never lie wholly before it.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - new_text_len - len(s) + 1)
        index = text.find(s, start)
        if index >= 0 and (best is None or index < best[1]):
            best = (s, index)
    return best


class TextStream:
    """A completion's text as it streams: incremental detokenization plus stop strings.

    Text that could still turn out to be the start of a stop string is held back (the last
    `len(longest stop) - 1` characters), so a stop string is never sent, even split across tokens.
    As vLLM: a stop string must end in the text of a token past the first `min_tokens`, and the text of a
    stop token (EOS or one of stop_token_ids) that ends the completion is left out unless `include_stop`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        skip_special_tokens: bool,
        include_stop: bool,
        min_tokens: int = 0,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = list(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0  # characters of detokenizer.text already returned
        self.num_tokens = 0
        self.stop_from = 0  # a stop string must end past this character (the first min_tokens tokens' text)

    def update(self, token_ids: Sequence[int], finished: bool, stop_token: bool = False) -> tuple[str, str | None]:
        """Returns (text to send now, the stop string that ended the completion or None). `stop_token`: the
        completion ended on a stop token, the last of `token_ids`."""
        before, self.num_tokens = self.num_tokens, self.num_tokens + len(token_ids)
        if stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        within = max(0, min(len(token_ids), self.min_tokens - before))  # of the first min_tokens
        if within:
            self.detokenizer.add_tokens(token_ids[:within])
            self.stop_from = len(self.detokenizer.text)
        if len(token_ids) > within:
            self.detokenizer.add_tokens(token_ids[within:])
        if finished:
            self.detokenizer.flush()
        text = self.detokenizer.text
        hit = None
        if self.stop and self.num_tokens > self.min_tokens:
            searched = max(self.sent - self.holdback, self.stop_from, 0)
            hit = find_stop_string(text, len(text) - searched, self.stop)
        if hit is not None:
            stop, index = hit
            end = index + len(stop) if self.include_stop else index
            out, self.sent = text[self.sent : max(end, self.sent)], max(end, self.sent)
            return out, stop
        end = len(text) if finished else max(len(text) - self.holdback, self.sent)
        out, self.sent = text[self.sent : end], end
        return out, None

    @property
    def text(self) -> str:
        return self.detokenizer.text[: self.sent]
