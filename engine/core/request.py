"""A request's state inside the engine core, as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kiln.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.engine.messages import TokenLogprobs
    from kiln.engine.structured_output.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    """Tokens are computed in a catch-up race: `num_computed_tokens` chases `num_tokens`.

    A prefill is just a request far behind; a decode is one token behind. Preemption sets
    `num_computed_tokens` back to 0, and the request catches up again (prompt and outputs alike).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # resolved: the params' max_tokens capped by what fits in max_model_len
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # structured output: the matcher that masks its logits
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    # Tokens sampled on the device whose ids the host has not seen yet (async scheduling): they are
    # computed, and fed to the next step, before they are appended to `output_token_ids`.
    num_output_placeholders: int = 0
    # Drafts a step in flight verifies: a step scheduled meanwhile counts them as kept (`Scheduler.optimistic`)
    num_draft_placeholders: int = 0
    stop_reason: int | str | None = None
    failure: str | None = None  # why the request failed alone (its client gets this message), if it did
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    # prompt_logprobs: one entry a prompt token (the first has none), filled as its prefill chunks run; sent once
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_logprobs: int = 0  # entries filled
    prompt_logprobs_sent: bool = False
    # speculative decoding: the draft tokens its last step verified (after its input token), and of them accepted
    spec_token_ids: list[int] = field(default_factory=list)
    # ... and with recurrent layers: whether its last step verified drafts (its next folds the kept ones into its state)
    folds_drafts: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prefill must compute every prompt position (a prefix-cache hit would skip some)."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    def record_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> None:
        """The entries of the prompt tokens start + 1 onward (a recomputed prefill writes the same ones again)."""
        for offset, entry in enumerate(entries, start + 1):
            if self.prompt_logprobs[offset] is None:
                self.num_prompt_logprobs += 1
            self.prompt_logprobs[offset] = entry

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_sync(self) -> bool:
        """Whether sampling this request reads its output history on the host (penalties, min_tokens, a
        grammar's matcher), so a step cannot be scheduled before the previous one's tokens are back."""
        params = self.sampling_params
        return params.uses_penalties or params.min_tokens > 0 or params.structured_output is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
