"""Engine configuration: one frozen dataclass, validated when made, with vLLM's names."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import torch

from kiln.compile import CUDAGRAPH_MODES
from kiln.engine.models.presets import DEFAULT_MODEL

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # default: the model directory (or the built-in one for presets)
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    load_format: str = "auto"  # auto: dummy for presets, safetensors for directories
    seed: int = 0
    max_model_len: int | None = None  # default: the model's ModelConfig.max_context (its positions, its window)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; on CPU the default is 1 GiB
    num_kv_blocks: int | None = None  # override the sizing (tests use it to force preemption)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no Dynamo, no Inductor, no CUDA graphs
    attention_backend: str | None = None  # default: per device
    compile_cache_dir: str | None = None  # default: ~/.cache/kiln/compile
    cudagraph_mode: str = "full_and_piecewise"  # or "piecewise", "none"
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # default: a vLLM-like list up to 2 * max_num_seqs
    async_scheduling: bool = True  # schedule step N+1 while the GPU runs step N
    tensor_parallel_size: int = 1  # ranks (GPUs) each layer is split across; ranks 1..N-1 are worker processes
    generation_config: str = "auto"  # auto: generation_config.json's sampling fields are the defaults; vllm: not

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes",
                     "tensor_parallel_size"):  # fmt: skip
            positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto or one of {sorted(_DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of {list(LOAD_FORMATS)}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"unknown cudagraph_mode {self.cudagraph_mode!r}; choose one of {list(CUDAGRAPH_MODES)}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(s, int) or s < 1 for s in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {self.cudagraph_capture_sizes!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"unknown generation_config {self.generation_config!r}; choose auto or vllm")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"unknown device {self.device!r}; choose auto, cpu or cuda[:N]")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32  # CPU matmuls in bf16 are slow and the reference tests run in fp32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16


def kiln_version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
