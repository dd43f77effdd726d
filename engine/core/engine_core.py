"""The engine core: model, KV cache, scheduler and runner, advanced one `step()` at a time.

Offline `LLM` drives it in-process; the server (later) drives the same class in its own process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from kiln.backends.attention import default_backend_name, get_attention_backend
from kiln.backends.kernels import pdl
from kiln.cache import KVCacheManager, KVCacheSpec, allocate_kv_caches
from kiln.compile import (
    CompileCache,
    CompileCounters,
    CompiledModel,
    cache_key_inputs,
    cache_root,
    default_capture_sizes,
    pin_triton_setup,
)
from kiln.engine.config import EngineConfig, kiln_version
from kiln.engine.core.kv_sizing import num_kv_blocks
from kiln.engine.core.request import Request
from kiln.engine.core.scheduler import Scheduler, SchedulerOutput
from kiln.engine.core.tensor_parallel import (
    RanksOutOfStepError,
    TensorParallelWorkers,
    WorkerDiedError,
    min_across_ranks,
)
from kiln.engine.models.layers import use_fused_kernels
from kiln.engine.models.loader import build_model, init_dummy_weights, load_checkpoint
from kiln.engine.models.parallel import TensorParallelShard, kv_heads_per_rank
from kiln.engine.models.source import ModelSource, resolve_model
from kiln.engine.outputs import Logprob
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.structured_output.admission import GrammarAdmission
from kiln.engine.text.tokenizer import builtin_tokenizer, load_tokenizer
from kiln.engine.worker.inputs import StepHandle
from kiln.engine.worker.model_runner import INPUT_SOURCES, ModelRunner

logger = logging.getLogger("kiln")


@dataclass(slots=True)  # one per running request per step: slots make each lighter to build
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class StepTiming:
    """Where the engine's time goes, summed over steps (the latency breakdown reads it).

    host: scheduling, input preparation, launches and output processing; wait: blocked on the GPU
    for a step's tokens; gpu: device time from a step's first op to its last (only with
    `runner.time_gpu`)."""

    steps: int = 0
    host_seconds: float = 0.0
    wait_seconds: float = 0.0
    gpu_seconds: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, tp_rank: int = 0) -> None:
        """`tp_rank` > 0: a tensor-parallel worker's engine (engine/distributed.py), the model side only."""
        self.tp_workers: TensorParallelWorkers | None = None
        try:
            self._start_up(config, tp_rank)
        except BaseException as error:
            if self.tp_workers is not None:
                # NOTE: the traceback keeps this half-built engine alive, and with it workers waiting in a
                # collective (and the process group, which a next engine needs): stop them now.
                try:
                    self.tp_workers.raise_if_dead(error)  # a worker that failed first is the cause to report
                finally:
                    self.tp_workers.close()
            raise

    def _start_up(self, config: EngineConfig, tp_rank: int) -> None:
        self.config = config
        start = time.perf_counter()
        pin_triton_setup()  # before anything compiles
        cache_folder = cache_root(config.compile_cache_dir)  # (None: disabled) also keeps the resolved model config
        memo_dir = None if cache_folder is None else cache_folder / "models"
        self.source: ModelSource = resolve_model(config.model, memo_dir)
        model_config = self.source.model_config
        self.device = config.resolve_device()
        if tp_rank > 0 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # the worker chose its GPU
        self.dtype = config.resolve_dtype(self.device, self.source.checkpoint_dtype)
        self.load_format = config.load_format
        if self.load_format == "auto":
            self.load_format = "dummy" if self.source.is_preset else "safetensors"
        if self.source.is_preset and self.load_format != "dummy":
            raise ValueError(f"preset {config.model!r} has no checkpoint: use load_format='dummy'")
        max_model_len = config.max_model_len or model_config.max_context
        if max_model_len > model_config.max_context:
            window = model_config.sliding_window
            if window is not None and max_model_len > window:
                raise ValueError(f"max_model_len {max_model_len} exceeds this model's sliding window of {window} "
                                 "tokens: Kiln does not implement sliding-window attention, and past the window its "
                                 "outputs would differ from the model's")  # fmt: skip
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_config.max_context} positions")
        torch.manual_seed(config.seed)
        # Tensor parallel: this process holds rank `tp_rank`'s shard. Rank 0 starts the other ranks once the
        # shapes are known to split, so they load their weights alongside it.
        self.shard = TensorParallelShard(tp_rank, config.tensor_parallel_size)
        self.model = build_model(model_config, self.dtype, self.device, max_model_len, self.shard)
        self.tp_workers = TensorParallelWorkers(config, self.device) if self.shard.size > 1 and tp_rank == 0 else None
        if self.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_checkpoint(self.model, self.source.model_dir)
        self.load_seconds = time.perf_counter() - start
        # Hand-written Triton kernels in eager mode on the GPU; under compilation Inductor fuses the
        # plain-torch forms itself.
        use_fused_kernels(self.model, self.device.type == "cuda" and config.enforce_eager)
        self.model_config = model_config
        self.backend = get_attention_backend(config.attention_backend or default_backend_name(self.device))
        self.cudagraph_mode = self._cudagraph_mode()
        self.counters = CompileCounters()
        self.compiled = None if config.enforce_eager else self._make_compiled(max_model_len)
        if self.tp_workers is not None and self.compiled is not None:
            self.tp_workers.before_leaving.append(self.compiled.release_graphs)
        self.kv_spec = KVCacheSpec(
            model_config.num_layers, kv_heads_per_rank(model_config.num_kv_heads, self.shard.size),
            model_config.head_dim, config.block_size, self.dtype,
        )  # fmt: skip
        sizing_start = time.perf_counter()
        num_blocks = num_kv_blocks(self, max_model_len)
        if self.shard.size > 1:
            num_blocks = min_across_ranks(num_blocks)  # every rank's cache shard holds the same blocks
        usable_tokens = (num_blocks - 1) * config.block_size
        if usable_tokens < max_model_len:
            if config.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {usable_tokens} tokens, fewer than max_model_len={max_model_len}; "
                    "lower max_model_len or give the KV cache more memory"
                )
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache", max_model_len, usable_tokens)
            max_model_len = usable_tokens
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = self._make_runner(self.kv_caches, max_model_len, self.compiled)
        self.runner.tp_workers = self.tp_workers
        self.counters.kv_sizing_seconds = time.perf_counter() - sizing_start
        if self.compiled is not None or self.device.type == "cuda":
            with self.counters.timed("warm_up_seconds"):
                self.runner.warm_up()  # the one Dynamo trace, and the Triton kernels' compiles
        if self.compiled is not None and self.runner.cudagraph_mode != "none":
            self.runner.capture_cudagraphs(self.counters)
        if tp_rank > 0:
            return  # a tensor-parallel worker: no scheduler; rank 0 schedules, samples and drives its steps
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_model_len)  # fmt: skip
        self.failed_requests: list[tuple[str, str]] = []  # (request id, message), drained by the caller
        # Structured output: a constrained request waits there while its grammar compiles
        self.grammar_admission = GrammarAdmission(self._load_tokenizer, model_config.vocab_size,
                                                  model_config.eos_token_ids)  # fmt: skip
        self.async_scheduling = config.async_scheduling
        self.in_flight: StepHandle | None = None  # the launched step whose tokens are not back yet
        self.step_timing = StepTiming()
        self.startup_seconds = time.perf_counter() - start
        self.startup_stats = {
            "total_seconds": self.startup_seconds, "load_seconds": self.load_seconds, "num_kv_blocks": num_blocks,
            "mode": "eager" if config.enforce_eager else f"compiled, cudagraphs {self.runner.cudagraph_mode}",
            "compile_cache_dir": self._cache_dir(),
            **self.counters.as_dict(),
        }  # fmt: skip
        logger.info("startup: %s", self.startup_stats)
        logger.info(
            "engine ready in %.1fs: %s (%s, %s, %s weights), %d KV blocks of %d tokens, max_model_len %d",
            self.startup_seconds, config.model, self.device, str(self.dtype).removeprefix("torch."),
            self.load_format, num_blocks, config.block_size, max_model_len,
        )  # fmt: skip

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate against the model and queue; raises ValueError for a request that can never run."""
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        params.verify_vocab(vocab)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        request = Request(
            request_id, list(prompt_token_ids), params, self.model_config.eos_token_ids, max_tokens, generator
        )
        if params.structured_output is None:
            self.scheduler.add_request(request)
            return
        if request_id in self.scheduler.requests or request_id in self.grammar_admission.waiting:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.grammar_admission.add(request)

    def abort_requests(self, request_ids: list[str], uncache: bool = False) -> None:
        """`uncache`: also forget their blocks' hashes (a failed or interrupted pass may not have written them)."""
        for request_id in request_ids:
            self.grammar_admission.waiting.pop(request_id, None)
            if uncache:
                self.kv_cache_manager.uncache(request_id)
            self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        waiting = self.scheduler.has_unfinished_requests() or bool(self.grammar_admission.waiting)
        return self.in_flight is not None or waiting

    # ---- one step -------------------------------------------------------------------------------------

    def step(self, isolate_failures: bool = False) -> list[EngineCoreOutput]:
        """Schedule and launch a step; return the tokens of the step before it (async scheduling) or of
        this one (sync).

        With async scheduling the host schedules and prepares step N+1 while the GPU runs step N, and
        only then waits for step N's tokens: the GPU never waits for the host's bookkeeping. A batch
        that needs its requests' output history on the host (penalties, min_tokens, a grammar) first
        drains the step in flight.

        With `isolate_failures` (the server's mode) a step that raises is retried one request at a
        time: a request that fails alone is aborted and reported in `failed_requests`, the rest go on.
        Offline, the exception propagates to the caller.
        """
        if self.runner is None:
            raise RuntimeError("the engine is closed")
        outputs: list[EngineCoreOutput] = []
        if self.grammar_admission.waiting:
            idle = self.in_flight is None and not self.scheduler.has_unfinished_requests()
            self.grammar_admission.admit(self.scheduler, self.failed_requests, idle)
        if self.in_flight is not None and self.scheduler.needs_sync():
            outputs += self._collect(self.in_flight)
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.step_timing.host_seconds += time.perf_counter() - start
        launched = None
        if not batch.is_empty:
            try:
                launched = self._launch(batch)
            except WorkerDiedError:
                self.in_flight = None
                raise  # no request is at fault and no step can run: the engine is down
            except BaseException as exc:
                # NOTE: the failed pass (an error, or Ctrl-C offline) may have written some of these blocks' KV
                # and not others, and they were hashed when allocated: no prefix lookup may find them now.
                for request in batch.requests:
                    self.kv_cache_manager.uncache(request.request_id)
                if not isolate_failures or not isinstance(exc, Exception):
                    self.in_flight = None
                    raise
                logger.exception("a step of %d requests failed; retrying them one by one", len(batch.requests))
                if self.in_flight is not None:
                    outputs += self._collect(self.in_flight)
                return outputs + [out for i in range(len(batch.requests)) for out in self._run_alone(batch.single(i))]
        if self.in_flight is not None:
            outputs += self._collect(self.in_flight)
        if launched is not None:
            if self.async_scheduling:
                self.in_flight = launched
            else:
                outputs += self._collect(launched)
        return outputs

    def _load_tokenizer(self):
        """The tokenizer grammars are compiled for: the one that reads this engine's outputs."""
        path = self.config.tokenizer or (None if self.source.is_preset else self.source.model_dir)
        return builtin_tokenizer() if path is None else load_tokenizer(path)

    def _launch(self, batch: SchedulerOutput) -> StepHandle:
        start = time.perf_counter()
        try:
            handle = self.runner.launch(batch)
        except Exception as e:
            if self.tp_workers is not None:
                self.tp_workers.raise_if_dead(e)  # a collective broken by a dead worker: say so
                if not isinstance(e, WorkerDiedError):
                    message = f"a tensor-parallel step failed on rank 0: {type(e).__name__}: {e}"
                    raise RanksOutOfStepError(message) from e
            raise
        self.step_timing.host_seconds += time.perf_counter() - start
        return handle

    def _collect(self, handle: StepHandle) -> list[EngineCoreOutput]:
        if handle is self.in_flight:
            self.in_flight = None
        timing = self.step_timing
        start = time.perf_counter()
        result = self.runner.collect(handle)
        waited = time.perf_counter() - start
        timing.wait_seconds += waited
        start = time.perf_counter()
        outputs = self._update(handle.batch, result)
        timing.host_seconds += time.perf_counter() - start
        timing.steps += 1
        if handle.gpu_seconds is not None:
            timing.gpu_seconds += handle.gpu_seconds
        return outputs

    def _run_alone(self, single: SchedulerOutput) -> list[EngineCoreOutput]:
        request = single.requests[0]
        try:
            return self._update(single, self.runner.execute(single))
        except Exception as e:
            logger.error("request %s failed: %s: %s", request.request_id, type(e).__name__, e)
            self.kv_cache_manager.uncache(request.request_id)
            self.scheduler.abort_request(request.request_id)
            self.failed_requests.append((request.request_id, "internal error while running the request"))
            return []

    def _update(self, batch: SchedulerOutput, result) -> list[EngineCoreOutput]:
        new_tokens, finished = self.scheduler.update_from_output(batch, result.sampled_token_ids)
        logprobs_of = {}
        if result.logprobs.count(None) != len(result.logprobs):
            logprobs_of = {r.request_id: lp for r, lp in zip(batch.requests, result.logprobs) if lp is not None}
        outputs = []
        for request, token in new_tokens:
            request_id = request.request_id
            lp = logprobs_of.get(request_id) if logprobs_of else None
            # Positional (finish_reason and stop_reason None until below): the cheapest way to build one.
            outputs.append(EngineCoreOutput(request_id, [token], None if lp is None else [lp], None, None,
                                            max(request.num_cached_tokens, 0)))  # fmt: skip
        if not finished:
            return outputs
        output_of = {out.request_id: out for out in outputs}
        for request in finished:
            out = output_of[request.request_id]
            if request.failure is not None:  # failed alone: its client gets the message instead of the token
                self.failed_requests.append((request.request_id, request.failure))
                outputs = [o for o in outputs if o is not out]
                continue
            out.finish_reason = request.status.finish_reason
            out.stop_reason = request.stop_reason
        return outputs

    def close(self) -> None:
        """Stop and reap the tensor-parallel workers, and give back the GPU memory this engine holds (CUDA
        graphs, KV cache, weights) even while the engine object itself stays referenced. Idempotent; the
        engine cannot step afterwards."""
        if self.tp_workers is not None:
            self.tp_workers.close()
        if self.compiled is not None:
            self.compiled.release_graphs()
        self.runner = self.compiled = self.kv_caches = self.model = None
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    # ---- start-up -------------------------------------------------------------------------------------

    def _make_runner(self, kv_caches: list[torch.Tensor], max_model_len: int, compiled=None) -> ModelRunner:
        config = self.config
        sizes = list(config.cudagraph_capture_sizes or default_capture_sizes(config.max_num_seqs))
        return ModelRunner(
            self.model, kv_caches, self.backend, config.block_size, config.max_num_batched_tokens,
            config.max_num_seqs, max_model_len, self.model_config.vocab_size,
            self.model_config.eos_token_ids, self.device, compiled, self.cudagraph_mode, sizes,
        )  # fmt: skip

    def _cache_dir(self) -> str | None:
        cache = self.compiled.backend.cache if self.compiled is not None else None
        return str(cache.directory) if cache is not None and cache.enabled else None

    def _cudagraph_mode(self) -> str:
        """The configured CUDA-graph mode, or "none" when nothing is compiled, off the GPU, or with an attention
        backend that cannot run inside a graph (the torch one reads host metadata; warned)."""
        config = self.config
        if config.enforce_eager or self.device.type != "cuda" or config.cudagraph_mode == "none":
            return "none"
        if not self.backend.cudagraph_safe:
            logger.warning("the %s attention backend cannot run in CUDA graphs: no graphs", self.backend.name)
            return "none"
        return config.cudagraph_mode

    def _make_compiled(self, max_model_len: int) -> CompiledModel:
        config = self.config
        settings = {
            "cudagraph_mode": config.cudagraph_mode, "capture_sizes": config.cudagraph_capture_sizes,
            "max_model_len": max_model_len, "attention_backend": self.backend.name,
            "tensor_parallel_size": config.tensor_parallel_size, "pdl": pdl.ENABLED,
        }  # fmt: skip
        key = cache_key_inputs(kiln_version(), self.model, dataclasses.asdict(self.model_config), self.dtype,
                               self.device, settings, INPUT_SOURCES)  # fmt: skip
        return CompiledModel(self.model, CompileCache(cache_root(config.compile_cache_dir), key), self.counters)
