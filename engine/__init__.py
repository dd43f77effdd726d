"""Kiln's engine: requests, scheduler, model runner, sampler, offline `LLM`, and the CLI."""

from kiln.engine.config import EngineConfig, kiln_version
from kiln.engine.llm import LLM
from kiln.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kiln.engine.sampling_params import SamplingParams, StructuredOutputParams

__version__ = kiln_version()

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputParams", "__version__"]
