"""Prompt-lookup drafting: where the text's last n tokens occurred before, propose what followed them then.

Output that copies its input (code edits, quotes, rewrites, tool arguments) makes such matches common, and a match is
free to find: no model runs. The longest suffix (prompt_lookup_max tokens) is tried first, down to prompt_lookup_min;
the latest earlier occurrence wins (the nearest context is the likeliest to repeat).

A lookup runs on the host every step, for every drafting request, between two forwards: it scans once for the
earlier places of the last token and checks the tokens before them only there, over a copy of the request's recent
tokens kept as an array and extended by each step's new ones (not rebuilt from the list: that alone cost more than
the search at 8k tokens).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# how far back a match is looked for: a lookup is linear in it
MAX_LOOKBACK = 8192
# requests whose token arrays are kept (the least recently drafted for are let go of first): 64 KiB each
MAX_CACHED = 256


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        # by id() of a request's token list (not the list: a finished request's is let go of; a new list that got its
        # id is told apart by its tokens, and a wrong tail would cost only drafts, which verification keeps exact)
        self._tails: OrderedDict[int, _Tail] = OrderedDict()

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow `token_ids`, or [] where no suffix occurred before."""
        limit = min(self.k, limit)
        if limit < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = self._tail(token_ids)
        size = len(tokens)
        # ends of earlier occurrences of the last token (the suffix's own end excluded), then of longer suffixes
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        matches: list[np.ndarray] = [ends]
        for j in range(1, min(self.max_n, size - 1)):
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[size - 1 - j]]
            matches.append(ends)
        for n in range(len(matches), self.min_n - 1, -1):
            if matches[n - 1].size:
                follow = int(matches[n - 1][-1]) + 1
                return tokens[follow : follow + limit].tolist()
        return []

    def _tail(self, token_ids: list[int]) -> np.ndarray:
        """The list's last MAX_LOOKBACK tokens as an array, extended from the one kept for this list."""
        tails = self._tails
        tail = tails.get(id(token_ids))
        if tail is None or not tail.continued_by(token_ids):
            tail = _Tail(token_ids)
            tails[id(token_ids)] = tail
            if len(tails) > MAX_CACHED:
                tails.popitem(last=False)
        else:
            tails.move_to_end(id(token_ids))
            tail.extend(token_ids)
        return tail.view()


class _Tail:
    """A list's recent tokens in a buffer twice the lookback, shifted down when full (an amortised copy a token)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.buffer = np.empty(2 * MAX_LOOKBACK, dtype=np.int32)
        recent = token_ids[-MAX_LOOKBACK:]
        self.buffer[: len(recent)] = recent
        self.start, self.end, self.length = 0, len(recent), len(token_ids)

    def continued_by(self, token_ids: list[int]) -> bool:
        """Whether `token_ids` starts with the tokens this tail last saw (its length, and its last token, agree)."""
        return self.length <= len(token_ids) and token_ids[self.length - 1] == self.buffer[self.end - 1]

    def extend(self, token_ids: list[int]) -> None:
        new = token_ids[self.length :][-MAX_LOOKBACK:]
        if self.end + len(new) > len(self.buffer):
            keep = MAX_LOOKBACK - len(new)
            self.buffer[:keep] = self.buffer[self.end - keep : self.end]
            self.start, self.end = 0, keep
        self.buffer[self.end : self.end + len(new)] = new
        self.end += len(new)
        self.start = max(self.start, self.end - MAX_LOOKBACK)
        self.length = len(token_ids)

    def view(self) -> np.ndarray:
        return self.buffer[self.start : self.end]
