"""The engine core: the scheduler over rank 0's model executor, advanced one `step()` at a time.

Offline `LLM` drives it in-process; `kiln serve` drives the same class in the engine-core process
(`kiln.engine.core.process`). Start-up (model, KV cache, compiled graphs, tensor-parallel workers) is
`kiln.engine.core.startup`'s; this class keeps the requests and the steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kiln.cache import RecurrentStateCache, StateKVCacheManager, make_kv_cache_manager
from kiln.engine.config import EngineConfig
from kiln.engine.core.request import Request
from kiln.engine.core.scheduler import Scheduler, SchedulerOutput
from kiln.engine.core.startup import ModelExecutor, build_executor, model_memo
from kiln.engine.core.tensor_parallel import RanksOutOfStepError, WorkerDiedError
from kiln.engine.messages import EngineCoreOutput, EngineOutputs, RequestFailed
from kiln.engine.models.source import resolve_tokenizer_class
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.eagle_proposer import EagleProposer
from kiln.engine.spec_decode.ngram import NgramProposer
from kiln.engine.spec_decode.ngram_device import DeviceNgramProposer
from kiln.engine.structured_output.admission import GrammarAdmission
from kiln.engine.text.tokenizer import load_tokenizer, tokenizer_dir_of
from kiln.engine.worker.inputs import ModelRunnerOutput, StepHandle

Drafter = NgramProposer | DeviceNgramProposer | EagleProposer

logger = logging.getLogger("kiln")

INTERNAL_ERROR = "internal error while running the request"


@dataclass
class StepTiming:
    """Where the engine's time goes, summed over steps (the latency breakdown reads it).

    host: scheduling, input preparation, launches and output processing; wait: blocked on the GPU
    for a step's tokens."""

    steps: int = 0
    host_seconds: float = 0.0
    wait_seconds: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        # The tokenizer's class first (a missing or broken tokenizer fails before the model loads): the API server
        # reads the tokenizer with it, and grammars are compiled for that tokenizer.
        self.tokenizer_dir = tokenizer_dir_of(config)
        self.tokenizer_class = None
        if self.tokenizer_dir is not None:
            self.tokenizer_class = resolve_tokenizer_class(self.tokenizer_dir, model_memo(config))
        self.executor: ModelExecutor = build_executor(config)
        try:
            self._start(config, start)
        except BaseException:
            self.executor.close()  # the tensor-parallel workers and the GPU memory, at once
            raise

    def _start(self, config: EngineConfig, start: float) -> None:
        executor = self.executor
        self.model_config = executor.model_config
        self.device, self.dtype, self.load_format = executor.device, executor.dtype, executor.load_format
        self.max_model_len, self.num_kv_blocks = executor.max_model_len, executor.num_kv_blocks
        self.runner = executor.runner
        self.kv_cache_manager = make_kv_cache_manager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching, executor.kv_spec.groups
        )
        if executor.state_rows is not None:  # recurrent layers: their state slots beside the KV blocks
            states = RecurrentStateCache(*executor.state_rows)
            self.kv_cache_manager = StateKVCacheManager(self.kv_cache_manager, states)
        drafter = self._drafter(config.speculative_config, config.async_scheduling)
        on_device = getattr(drafter, "drafts_after_step", False)  # (drafts made on the device after each step)
        if on_device:
            self.runner.drafter = drafter
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            drafter,
            config.speculative_config.disable_by_batch_size if config.speculative_config is not None else None,
            optimistic=on_device and config.async_scheduling and self.runner.shifts_positions,
        )
        # Structured output: a constrained request waits there while its grammar compiles
        self.grammar_admission = GrammarAdmission(
            self._load_tokenizer,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            config.xgrammar_cache_mb << 20,
        )
        self.async_scheduling = config.async_scheduling
        self.in_flight: StepHandle | None = None  # the launched step whose tokens are not back yet
        # Failures of a step that raised (offline), reported with the next step's
        self._unreported: list[RequestFailed] = []
        self.step_timing = StepTiming()
        self.startup_stats = {**executor.startup_stats, "total_seconds": time.perf_counter() - start}
        logger.info("startup: %s", self.startup_stats)
        logger.info(
            "engine ready in %.1fs: %s (%s, %s, %s weights), %d KV blocks of %d tokens (%d tokens of context), "
            "max_model_len %d",
            self.startup_stats["total_seconds"],
            config.model,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.load_format,
            self.num_kv_blocks,
            config.block_size,
            self.startup_stats["kv_cache_tokens"],
            self.max_model_len,
        )

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
        if self._unreported:
            self._unreported = [f for f in self._unreported if f.request_id not in request_ids]
        for request_id in request_ids:
            self.grammar_admission.abort(request_id)
            if uncache:
                self.kv_cache_manager.uncache(request_id)
            self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        waiting = self.scheduler.has_unfinished_requests() or bool(self.grammar_admission.waiting)
        return self.in_flight is not None or waiting

    # ---- one step -------------------------------------------------------------------------------------

    def step(self, isolate_failures: bool = False) -> EngineOutputs:
        """Schedule and launch a step; return the tokens of the step before it (async scheduling) or of
        this one (sync), and the requests that failed.

        With async scheduling the host schedules and prepares step N+1 while the GPU runs step N, and
        only then waits for step N's tokens: the GPU never waits for the host's bookkeeping. A batch
        that needs its requests' output history on the host (penalties, min_tokens, a grammar) first
        drains the step in flight.

        A request fails alone when its grammar does not compile (in time) or rejects a token. With
        `isolate_failures` (the server's mode) a step that raises is retried one request at a time: a
        request that fails alone is aborted and reported, the rest go on; an error no single request
        causes fails the running requests, and the engine serves on. Offline, the exception propagates to
        the caller. A dead tensor-parallel worker (`WorkerDiedError`) always does: no step can run.
        """
        if self.runner is None:
            raise RuntimeError("the engine is closed")
        outputs: list[EngineCoreOutput] = []
        failed, self._unreported = self._unreported, []
        try:
            self._step(outputs, failed, isolate_failures)
        except WorkerDiedError:
            raise
        except Exception:
            if not isolate_failures:
                self._unreported = failed
                raise
            # NOTE: not one request's fault (isolation found none): fail what was running, keep serving (the tokens
            # already collected this step still go out: a request they finished is no longer running).
            logger.exception("a step failed; failing the requests it was running")
            victims = [r.request_id for r in self.scheduler.running]
            self.abort_requests(victims, uncache=True)
            failed += [RequestFailed(rid, INTERNAL_ERROR) for rid in victims]
        except BaseException:
            self._unreported = failed
            raise
        return EngineOutputs(outputs, failed)

    def _step(self, outputs: list[EngineCoreOutput], failed: list[RequestFailed], isolate_failures: bool) -> None:
        """One step, its tokens appended to `outputs` and its failures to `failed` as they come."""
        if self.grammar_admission.waiting:
            idle = self.in_flight is None and not self.scheduler.has_unfinished_requests()
            failed += self.grammar_admission.admit(self.scheduler, idle)
        if self.in_flight is not None and self.scheduler.needs_sync():
            outputs += self._collect(self.in_flight, failed)
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
                    outputs += self._collect(self.in_flight, failed)
                for i in range(len(batch.requests)):
                    outputs += self._run_alone(batch.single(i), failed)
                return
        if self.in_flight is not None:
            outputs += self._collect(self.in_flight, failed)
        if launched is not None:
            if self.async_scheduling:
                self.in_flight = launched
            else:
                outputs += self._collect(launched, failed)

    def _drafter(self, spec: SpeculativeConfig | None, async_scheduling: bool) -> Drafter | None:
        """Speculative decoding's drafter, or None; a model whose state cannot take back rejected drafts refuses.
        N-gram drafts are looked up on the device where that keeps async scheduling on (a CUDA device whose steps'
        positions it can move back; `ngram_gpu` anywhere), else on the host."""
        if spec is None:
            return None
        runner = self.runner
        if spec.method == "ngram_gpu" or (
            spec.method == "ngram" and async_scheduling and runner.device.type == "cuda" and runner.shifts_positions
        ):
            lookup = (spec.prompt_lookup_min, spec.prompt_lookup_max)
            return DeviceNgramProposer(spec.num_speculative_tokens, *lookup, runner)
        if self.executor.draft is not None:  # (an EAGLE-3 or MTP draft model, loaded with the target: startup.py)
            return EagleProposer(self.executor.draft, spec.num_speculative_tokens, self.runner, self.num_kv_blocks)
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _load_tokenizer(self):
        """The tokenizer grammars are compiled for: the one that reads this engine's outputs."""
        return load_tokenizer(self.tokenizer_dir, self.tokenizer_class)

    def _launch(self, batch: SchedulerOutput) -> StepHandle:
        start = time.perf_counter()
        tp_workers = self.executor.tp_workers
        try:
            handle = self.runner.launch(batch)
        except Exception as e:
            if tp_workers is not None:
                tp_workers.raise_if_dead(e)  # a collective broken by a dead worker: say so
                if not isinstance(e, WorkerDiedError):
                    message = f"a tensor-parallel step failed on rank 0: {type(e).__name__}: {e}"
                    raise RanksOutOfStepError(message) from e
            raise
        self.step_timing.host_seconds += time.perf_counter() - start
        return handle

    def _collect(self, handle: StepHandle, failed: list[RequestFailed]) -> list[EngineCoreOutput]:
        if handle is self.in_flight:
            self.in_flight = None
        timing = self.step_timing
        start = time.perf_counter()
        result = self.runner.collect(handle)
        timing.wait_seconds += time.perf_counter() - start
        start = time.perf_counter()
        outputs = self._update(handle.batch, result, failed)
        timing.host_seconds += time.perf_counter() - start
        timing.steps += 1
        return outputs

    def _run_alone(self, single: SchedulerOutput, failed: list[RequestFailed]) -> list[EngineCoreOutput]:
        request = single.requests[0]
        try:
            return self._update(single, self.runner.execute(single), failed)
        except Exception as e:
            logger.error("request %s failed: %s: %s", request.request_id, type(e).__name__, e)
            self.abort_requests([request.request_id], uncache=True)
            failed.append(RequestFailed(request.request_id, INTERNAL_ERROR))
            return []

    def _update(
        self, batch: SchedulerOutput, result: ModelRunnerOutput, failed: list[RequestFailed]
    ) -> list[EngineCoreOutput]:
        if result.prompt_logprobs:  # before the tokens: a request finishing now sends them with its last
            for row, (start, entries) in result.prompt_logprobs.items():
                batch.requests[row].record_prompt_logprobs(start, entries)
        new_tokens, finished = self.scheduler.update_from_output(
            batch, result.sampled_token_ids, result.accepted_token_ids
        )
        logprobs_of = {}
        if result.logprobs.count(None) != len(result.logprobs):
            logprobs_of = {r.request_id: [lp] for r, lp in zip(batch.requests, result.logprobs) if lp is not None}
            if result.accepted_logprobs is not None:  # (a request's kept drafts' logprobs, then its sampled token's)
                for r, kept in zip(batch.requests, result.accepted_logprobs):
                    if kept and r.request_id in logprobs_of:
                        logprobs_of[r.request_id] = [*kept, *logprobs_of[r.request_id]]
        outputs = []
        last, lps = None, None
        for request, token in new_tokens:
            request_id = request.request_id
            if last is not None and last.request_id == request_id:  # the tokens of a step with drafts: one output
                last.new_token_ids.append(token)
                if last.new_logprobs is not None:
                    last.new_logprobs = lps[: len(last.new_token_ids)]
                continue
            lps = logprobs_of.get(request_id) if logprobs_of else None
            lp = None if lps is None else lps[:1]
            # Positional (finish_reason and stop_reason None until below): the cheapest way to build one.
            last = EngineCoreOutput(request_id, [token], lp, None, None, max(request.num_cached_tokens, 0))
            outputs.append(last)
            if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                outputs[-1].prompt_logprobs = request.prompt_logprobs  # complete: its prefill is done
                request.prompt_logprobs_sent = True
        if not finished:
            return outputs
        output_of = {out.request_id: out for out in outputs}
        for request in finished:
            out = output_of[request.request_id]
            if request.failure is not None:  # failed alone: its client gets the message instead of the token
                failed.append(RequestFailed(request.request_id, request.failure))
                outputs = [o for o in outputs if o is not out]
                continue
            out.finish_reason = request.status.finish_reason
            out.stop_reason = request.stop_reason
        return outputs

    def close(self) -> None:
        """Stop the tensor-parallel workers and give back the GPU memory the engine holds (CUDA graphs, KV cache,
        weights) even while the engine object itself stays referenced. Idempotent; the engine cannot step after."""
        self.executor.close()
        if self.runner is not None:
            self.runner.drafter = None
        self.scheduler.drafter = None  # (a device drafter holds the runner, and so the weights and KV cache)
        self.runner = self.in_flight = None
