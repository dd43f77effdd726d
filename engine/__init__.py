"""Kiln's engine: offline `LLM`, `SamplingParams`, the config dataclasses and the CLI; below them the API-server
process (`serving/`), the engine-core process (`core/`), the model runner and sampler (`worker/`), the models,
text and structured output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.engine.config import EngineConfig, ServerConfig, kiln_version
from kiln.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kiln.engine.sampling_params import SamplingParams, StructuredOutputParams

if TYPE_CHECKING:
    from kiln.engine.llm import LLM

__version__ = kiln_version()

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "ServerConfig",
    "StructuredOutputParams",
    "__version__",
]


def __getattr__(name: str):
    # NOTE: `LLM` brings torch and the whole engine: loaded on first use, so that `kiln --help` and the API-server
    # process (which imports kiln.engine.serving, and so this package) never load them.
    if name == "LLM":
        from kiln.engine.llm import LLM  # noqa: PLC0415

        return LLM
    raise AttributeError(f"module 'kiln.engine' has no attribute {name!r}")
