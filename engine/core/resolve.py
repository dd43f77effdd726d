"""What an `EngineConfig`'s "auto" and checked settings come to on this machine: the device, the CPU threads, the
dtype, the context length and the CUDA-graph mode (start-up's first decisions, each a function of the config)."""

from __future__ import annotations

import logging
import os

import torch

from kiln.backends.attention import AttentionBackend
from kiln.engine.config import DTYPES, EngineConfig
from kiln.engine.models.config import ModelConfig

logger = logging.getLogger("kiln")


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """The configured device (auto: CUDA when there is one). A tensor-parallel worker (rank > 0) runs on the GPU it
    chose before start-up."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
    if rank > 0 and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def cpu_threads(config: EngineConfig) -> int:
    """The threads a rank computes with on the CPU: `cpu_threads`, else OMP_NUM_THREADS where set, else the cores this
    process may use less one (for the API server, tokenizers and the other processes a machine runs: threads that
    outnumber free cores spin against each other and a step can take twenty times as long), shared among the ranks."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (len(os.sched_getaffinity(0)) - 1) // config.tensor_parallel_size)


def resolve_dtype(config: EngineConfig, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """The configured dtype; auto: float32 on the CPU (its bf16 matmuls are slow, and the reference tests run in
    fp32), else the checkpoint's half-precision dtype, else bfloat16."""
    if config.dtype != "auto":
        return getattr(torch, DTYPES[config.dtype])
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return getattr(torch, checkpoint_dtype)
    return torch.bfloat16


def context_length(config: EngineConfig, model_config: ModelConfig, backend: AttentionBackend) -> int:
    """max_model_len, checked against what the model computes right: its positions; and for an attention backend
    without sliding windows, a windowed model's window (the whole context is the window's attention only up to
    its length)."""
    limit = model_config.max_context
    window = model_config.sliding_window
    if window is not None and not backend.sliding_window:
        limit = min(limit, window)
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        if window is not None and max_model_len > window and limit == window:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds this model's sliding window of {window} tokens: the "
                f"{backend.name} attention backend has no sliding windows, and past the window its outputs would "
                "differ from the model's"
            )
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_config.max_context} positions")
    return max_model_len


def resolve_cudagraph_mode(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> str:
    """The configured CUDA-graph mode, or "none" when nothing is compiled, off the GPU, or with an attention
    backend that cannot run inside a graph (the torch one reads host metadata; warned)."""
    if config.enforce_eager or device.type != "cuda" or config.cudagraph_mode == "none":
        return "none"
    if not backend.cudagraph_safe:
        logger.warning("the %s attention backend cannot run in CUDA graphs: no graphs", backend.name)
        return "none"
    return config.cudagraph_mode
