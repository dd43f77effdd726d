"""`--speculative-config`: vLLM's JSON keys, checked at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "ngram_gpu", "eagle3", "mtp")  # drafters Kiln has; the others are refused with a reason (not yet)
NOT_YET = ("eagle", "medusa", "draft_model", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # (n-gram) the shortest suffix of the text that may match earlier
    prompt_lookup_max: int = 4  # (n-gram) the longest one tried first
    model: str | None = None  # a draft model's directory or Hub id (EAGLE-3)
    disable_by_batch_size: int | None = None  # no drafts while this many requests or more run (large batches are
    # bound by compute, where verifying drafts costs more than it saves)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the CLI's JSON text, `LLM(speculative_config=...)`'s dict, or itself; a wrong one is one ValueError."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        known.add("disable_by_batch_size")
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; Kiln reads {sorted(known)}")
        method = value.get("method")
        if method in NOT_YET:
            raise ValueError(f"speculative_config: method {method!r} is not supported yet; use one of {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; choose one of {list(METHODS)}")
        config = cls(**{"num_speculative_tokens": None, **value})
        config.check()
        return config

    def check(self) -> None:
        def positive(name: str) -> None:
            got = getattr(self, name)
            if isinstance(got, bool) or not isinstance(got, int) or got < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {got!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            positive(name)
        if self.disable_by_batch_size is not None:
            positive("disable_by_batch_size")
        if self.method == "eagle3" and not self.model:
            raise ValueError("speculative_config: method eagle3 needs the draft's 'model' (a directory or Hub id)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @property
    def uses_draft_model(self) -> bool:
        """Whether a draft model (EAGLE-3's head, or the checkpoint's MTP layer) makes the drafts, not a lookup."""
        return self.method in ("eagle3", "mtp")

    def describe(self) -> str:
        return f"{self.method}, k={self.num_speculative_tokens}"
