"""Prompt-lookup drafting: where the text's last n tokens occurred before, propose what followed them then.

Output that copies its input (code edits, quotes, rewrites, tool arguments) makes such matches common, and a match is
free to find: no model runs. The longest suffix (prompt_lookup_max tokens) is tried first, down to prompt_lookup_min;
the latest earlier occurrence wins (the nearest context is the likeliest to repeat).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# how far back a match is looked for: a lookup is linear in it, and runs on the host every step
MAX_LOOKBACK = 8192


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow `token_ids`, or [] where no suffix occurred before."""
        limit = min(self.k, limit)
        if limit < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-MAX_LOOKBACK:], dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram (not the suffix itself)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return tokens[follow : follow + limit].tolist()
        return []
