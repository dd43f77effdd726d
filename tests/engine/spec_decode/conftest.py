"""The speculative-decoding tests' shared fixture: what a run with drafts must equal."""

from __future__ import annotations

import pytest

from kiln.engine import LLM

from helpers.speculative import GREEDY, PROMPTS


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    """The tokens and logprobs of a run without drafts, by prompt."""
    outputs = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=256).generate(PROMPTS, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0] for p, o in zip(PROMPTS, outputs)}
