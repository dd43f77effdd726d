"""Start-up: from an `EngineConfig` to a model executor, one rank's model on its device, ready to step.

    resolve the model ─► build it (this rank's shard) ─► [rank 0 of several: start the other ranks]
      ─► load the weights ─► size the KV cache (profile a step) ─► allocate it ─► the model runner
      ─► warm up (the one Dynamo trace, every kernel variant) ─► capture the CUDA graphs

Rank 0 (the engine core) and each tensor-parallel worker run the same `build_executor`, so every rank builds the
same shapes, traces the same graph and captures the same graphs; only rank 0 starts the workers and keeps them.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.backends.attention import AttentionBackend, default_backend_name, get_attention_backend
from kiln.cache import KVCacheSpec, allocate_kv_caches, kv_groups
from kiln.compile import (
    CompileCache,
    CompileCounters,
    CompiledModel,
    JsonFolder,
    cache_key_inputs,
    cache_root,
    default_capture_sizes,
    pin_triton_setup,
)
from kiln.engine.config import EngineConfig, kiln_version
from kiln.engine.core.kv_sizing import (
    allocate_recurrent_states,
    check_weights_fit,
    fit_context,
    kv_cache_tokens,
    num_kv_blocks,
)
from kiln.engine.core.resolve import context_length, cpu_threads, resolve_cudagraph_mode, resolve_device, resolve_dtype
from kiln.engine.core.tensor_parallel import TensorParallelWorkers, min_across_ranks
from kiln.engine.models import quant_config
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.layers import use_fused_kernels
from kiln.engine.models.loader import (
    build_model,
    checkpoint_format,
    init_dummy_weights,
    load_checkpoint,
    release_weights,
)
from kiln.engine.models.parallel import TensorParallelShard, kv_heads_per_rank
from kiln.engine.models.source import ModelSource, resolve_model
from kiln.engine.spec_decode.draft_model import check_draft, load_draft
from kiln.engine.spec_decode.eagle3 import set_target_layers
from kiln.engine.worker.model_runner import INPUT_SOURCES, ModelRunner

logger = logging.getLogger("kiln")


@dataclass
class ModelExecutor:
    """One rank's model, KV cache and runner, built and warmed up. Rank 0's also holds the tensor-parallel workers
    it started (`tp_workers`); `close` stops them and gives the GPU memory back."""

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    load_format: str  # "dummy", or the checkpoint's: "safetensors", "pt" or "gguf"
    shard: TensorParallelShard
    model: nn.Module
    compiled: CompiledModel | None  # None with enforce_eager
    kv_spec: KVCacheSpec
    kv_caches: list[torch.Tensor]
    num_kv_blocks: int
    max_model_len: int  # the configured one, or the model's, lowered to what the KV cache holds
    runner: ModelRunner
    counters: CompileCounters
    tp_workers: TensorParallelWorkers | None
    startup_stats: dict[str, Any]
    # a model with recurrent layers: (request slots, snapshots) of their state tensors' rows (the scratch row besides)
    state_rows: tuple[int, int] | None = None
    draft: nn.Module | None = None  # speculative decoding's EAGLE-3 or MTP draft model (rank 0)

    @property
    def model_config(self) -> ModelConfig:
        return self.source.model_config

    def close(self) -> None:
        """Stop and reap the tensor-parallel workers, and give back the GPU memory this executor holds (CUDA
        graphs, KV cache, weights) even while the object itself stays referenced. Idempotent."""
        if self.tp_workers is not None:
            self.tp_workers.close()
        if self.compiled is not None:
            self.compiled.close()
        for model in (self.model, self.draft):
            if model is not None:
                release_weights(model)
        self.runner = self.compiled = self.kv_caches = self.model = self.draft = None
        gc.unfreeze()  # (start-up's objects, this model's cycles among them, collectable again)
        if torch.cuda.is_initialized():
            gc.collect()  # (the model's modules and graphs hold cycles: freed now, before the cache is emptied)
            torch.cuda.empty_cache()


def freeze_startup_objects() -> None:
    """Start-up's garbage collected, then what survives (modules, compiled pieces, the libraries' caches: millions of
    objects a process keeps) moved out of the collector's reach: else the first full collection while serving walks
    them all, and the step it falls in stalls many times over (BENCHMARKS.md, "Offline throughput").

    Frozen cycles are never collected, so the engine is closed explicitly (the engine-core process, a worker, an
    `LLM`'s finalizer), and close() unfreezes. Process-wide: closing one of two engines in a process unfreezes the
    other's objects too, which then cost a full collection again (time, not memory)."""
    gc.collect()
    gc.freeze()


def model_memo(config: EngineConfig) -> JsonFolder | None:
    """Where what transformers made of the model's config and tokenizer is kept: beside the compile cache (None where
    that is disabled)."""
    root = cache_root(config.compile_cache_dir)
    return None if root is None else JsonFolder(root / "models")


def _build_on_device(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    shard: TensorParallelShard,
    config: EngineConfig,
) -> nn.Module:
    """`build_model`; out of memory, a one-line error with the weights' size and the GPU's (measured on a model
    built on the meta device, which costs start-up time only then)."""
    try:
        return build_model(model_config, dtype, device, max_model_len, shard)
    except torch.OutOfMemoryError:
        pass  # (outside the handler: its traceback holds the tensors allocated so far)
    gc.collect()  # (and the half-built modules' cycles)
    torch.cuda.empty_cache()
    check_weights_fit(build_model(model_config, dtype, torch.device("meta"), max_model_len, shard), device, config)
    raise ValueError(f"out of GPU memory while allocating the model's weights on {device}")


def _with_quantization(config: EngineConfig, model_config: ModelConfig) -> ModelConfig:
    """The model's config with the quantization it runs in: `--quantization`'s, else the checkpoint's (its KV cache
    scales dropped under a 16-bit KV cache)."""
    quantization = quant_config.resolve(config.quantization, model_config.quantization)
    if quantization is not None and quantization.kv_scales and not config.kv_cache_dtype.startswith("fp8"):
        logger.info("the checkpoint's KV cache scales are unused with a 16-bit KV cache (--kv-cache-dtype fp8)")
        quantization = dataclasses.replace(quantization, kv_scales=False)
    if quantization == model_config.quantization:
        return model_config
    return dataclasses.replace(model_config, quantization=quantization)  # (--quantization fp8 of a 16-bit checkpoint)


def _kv_cache_spec(
    config: EngineConfig,
    model_config: ModelConfig,
    backend: AttentionBackend,
    shard: TensorParallelShard,
    dtype: torch.dtype,
) -> KVCacheSpec:
    """This rank's KV cache layout: one entry a layer with attention (a hybrid's recurrent layers keep states, not
    KV), grouped by sliding window; a backend without windows runs every layer full, over a context capped at the
    window."""
    kv_layers = model_config.attention_layers
    windows = [model_config.window_of(layer) if backend.sliding_window else 0 for layer in kv_layers]
    # (Gemma 4's full layers: heads of another width and number, in groups of their own)
    shapes = [
        (kv_heads_per_rank(model_config.kv_heads_of(i), shard.size), model_config.head_dim_of(i)) for i in kv_layers
    ]
    return KVCacheSpec(
        len(kv_layers),
        *shapes[0],
        config.block_size,
        torch.float8_e4m3fn if config.kv_cache_dtype.startswith("fp8") else dtype,
        kv_groups(windows, [heads * dim for heads, dim in shapes]),
        tuple(shapes) if len(set(shapes)) > 1 else (),
    )


def build_executor(config: EngineConfig, rank: int = 0, with_draft: bool = True) -> ModelExecutor:
    """This rank's executor (rank 0: the engine core's, which starts the other ranks when there are several).
    `with_draft=False` leaves an EAGLE-3 or MTP draft model unloaded (`kiln precompile`: the target's trace only)."""
    start = time.perf_counter()
    pin_triton_setup()  # before anything compiles
    source = resolve_model(config.model, model_memo(config), config.revision, config.download_dir, config.gguf_file)
    model_config = _with_quantization(config, source.model_config)
    quantization = model_config.quantization
    device = resolve_device(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(config))
    dtype = resolve_dtype(config, device, source.checkpoint_dtype_name)
    load_format = config.load_format
    if load_format == "auto":
        load_format = "dummy" if source.is_preset else checkpoint_format(source.model_dir)
    if source.is_preset and load_format != "dummy":
        raise ValueError(f"preset {config.model!r} has no checkpoint: use load_format='dummy'")
    backend = get_attention_backend(config.attention_backend or default_backend_name(device))
    max_model_len = context_length(config, model_config, backend)
    torch.manual_seed(config.seed)
    shard = TensorParallelShard(rank, config.tensor_parallel_size)
    model = _build_on_device(model_config, dtype, device, max_model_len, shard, config)
    draft_dir = set_target_layers(config, model)  # (before the trace: the target then saves those layers' states)
    with_draft = with_draft and rank == 0  # (the draft runs on rank 0)
    if with_draft:  # (before the other ranks start: they would wait out a refusal in a collective)
        check_draft(config, model_config, load_format, shard)
    cudagraph_mode = resolve_cudagraph_mode(config, device, backend)
    counters = CompileCounters()
    compiled = None
    if not config.enforce_eager:
        compiled = _compiled_model(
            config, model, model_config, dtype, device, backend, max_model_len, shard, counters, source.origin
        )
    tp_workers = None
    if shard.size > 1 and rank == 0:
        # Rank 0 starts the other ranks once the shapes are known to split, so they load their weights alongside it.
        release = compiled.release_graphs if compiled is not None else None
        tp_workers = TensorParallelWorkers(config, device, release)
    try:
        if load_format == "dummy":
            init_dummy_weights(model, config.seed)
        else:
            load_checkpoint(model, source.model_dir, load_format)
        # an EAGLE-3 or MTP draft: before the KV cache is sized, which its weights and its own KV share
        draft = None
        if with_draft:
            where = (source.model_dir, load_format, draft_dir)
            draft = load_draft(config, model, *where, max_model_len, shard, dtype, device)
        load_seconds = time.perf_counter() - start
        # Hand-written Triton kernels in eager mode on the GPU; under compilation Inductor fuses the plain-torch
        # forms itself.
        use_fused_kernels(model, device.type == "cuda" and config.enforce_eager)
        if compiled is not None:  # a warm start's split graph and artifacts, on every rank or on none
            compiled.load_saved((lambda found: min_across_ranks(int(found)) == 1) if shard.size > 1 else None)
        # NOTE: allocated before the KV cache is sized, so its profile counts them as it counts the weights
        recurrent_states, state_rows, draft_records = allocate_recurrent_states(
            config, model_config, shard, dtype, device
        )
        kv_spec = _kv_cache_spec(config, model_config, backend, shard, dtype)
        capture_sizes = list(config.cudagraph_capture_sizes or default_capture_sizes(config.max_num_seqs))
        aux_hidden = None
        if draft_dir is not None:  # where the target's layers leave their states for the draft (as the runner pads)
            rows = max(config.max_num_batched_tokens, *capture_sizes, 1)
            aux_hidden = torch.zeros(
                rows, len(model.model.aux_layers) * model_config.hidden_size, dtype=dtype, device=device
            )
        sizing_start = time.perf_counter()

        def make_runner(kv_caches, max_model_len, compiled=None, cudagraph_mode="none", tp_workers=None):
            return ModelRunner(
                model,
                kv_caches,
                backend,
                config.block_size,
                config.max_num_batched_tokens,
                config.max_num_seqs,
                max_model_len,
                model_config.vocab_size,
                model_config.eos_token_ids,
                device,
                compiled,
                cudagraph_mode,
                capture_sizes,
                tp_workers,
                kv_spec.groups,
                recurrent_states,
                config.speculative_config.num_speculative_tokens if config.speculative_config is not None else 0,
                draft_records,
            )

        cache = compiled.backend.cache if compiled is not None else None
        num_blocks = num_kv_blocks(
            config,
            kv_spec,
            device,
            max_model_len,
            cudagraph_mode != "none",
            cache,
            lambda kv_caches: make_runner(kv_caches, max_model_len),
            draft,
        )
        if shard.size > 1:
            num_blocks = min_across_ranks(num_blocks)  # every rank's cache shard holds the same blocks
        max_model_len = fit_context(config, max_model_len, num_blocks, kv_spec.groups.windows)
        kv_caches = allocate_kv_caches(kv_spec, num_blocks, device)
        runner = make_runner(kv_caches, max_model_len, compiled, cudagraph_mode, tp_workers)
        runner.aux_hidden = aux_hidden
        counters.kv_sizing_seconds = time.perf_counter() - sizing_start
        if compiled is not None or device.type == "cuda":
            with counters.timed("warm_up_seconds"):
                runner.warm_up()  # the one Dynamo trace, and the Triton kernels' compiles
        if compiled is not None and runner.cudagraph_mode != "none":
            runner.capture_cudagraphs(counters)
    except BaseException as error:
        if tp_workers is not None:
            # NOTE: the traceback keeps this half-built start-up alive, and with it workers waiting in a collective
            # (and the process group, which a next engine needs): stop them now.
            try:
                tp_workers.raise_if_dead(error)  # a worker that failed first is the cause to report
            finally:
                tp_workers.close()
        raise
    cache_dir = str(cache.directory) if cache is not None and cache.enabled else None
    stats = {
        "total_seconds": time.perf_counter() - start,
        "load_seconds": load_seconds,
        "model_source": source.origin,
        "num_kv_blocks": num_blocks,
        "kv_cache_tokens": kv_cache_tokens(config, num_blocks, kv_spec.groups.windows),
        "mode": "eager" if config.enforce_eager else f"compiled, cudagraphs {runner.cudagraph_mode}",
        "quantization": quantization.describe() if quantization is not None else None,
        "kv_cache_dtype": str(kv_spec.dtype).removeprefix("torch."),
        "speculative": config.speculative_config.describe() if config.speculative_config is not None else None,
        "compile_cache_dir": cache_dir,
        **counters.as_dict(),
    }
    return ModelExecutor(
        source,
        device,
        dtype,
        load_format,
        shard,
        model,
        compiled,
        kv_spec,
        kv_caches,
        num_blocks,
        max_model_len,
        runner,
        counters,
        tp_workers,
        stats,
        state_rows,
        draft,
    )


def _compiled_model(
    config: EngineConfig,
    model: nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_model_len: int,
    shard: TensorParallelShard,
    counters: CompileCounters,
    model_source: str,
) -> CompiledModel:
    """The model wrapped for its one trace, with its compile cache (keyed by everything that shapes the code)."""
    settings = {
        "cudagraph_mode": config.cudagraph_mode,
        "capture_sizes": config.cudagraph_capture_sizes,
        "max_model_len": max_model_len,
        "attention_backend": backend.name,
        # NOTE: the rank, not the size alone: a rank's pieces hold its own shard's constants (the vocabulary range its
        # embedding looks up), and on the CPU nothing else in the key tells the ranks apart.
        "tensor_parallel": dataclasses.asdict(shard),
        "model_source": model_source,  # (the key names where the weights came from, as start-up stats do)
        "aux_layers": list(getattr(model.model, "aux_layers", ())),  # (EAGLE-3: the states the graph saves)
    }
    key = cache_key_inputs(
        kiln_version(), model, dataclasses.asdict(model_config), dtype, device, settings, INPUT_SOURCES
    )
    return CompiledModel(model, CompileCache(cache_root(config.compile_cache_dir), key), counters)
