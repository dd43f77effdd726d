"""Offline inference: `LLM(model).generate(prompts, params)`, driving the engine core in-process."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from kiln.engine.config import EngineConfig
from kiln.engine.core.engine_core import EngineCore
from kiln.engine.core.startup import freeze_startup_objects, model_memo
from kiln.engine.messages import EngineCoreOutput
from kiln.engine.models.model_dir import generation_defaults, model_dir_of
from kiln.engine.models.source import resolve_tokenizer_class
from kiln.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.text.detokenizer import TextStream
from kiln.engine.text.tokenizer import load_tokenizer, tokenizer_dir_of

Prompt = str | list[int]


@dataclass
class _Sequence:
    """One of the `n` completions of a prompt, as it accumulates."""

    output: CompletionOutput
    params: SamplingParams
    text: TextStream | None  # only when stop strings need the text as it grows
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(prompt: list | tuple) -> list[int] | None:
    """A prompt's token ids as ints (numpy's integers too), or None where it holds anything else."""
    if all(type(t) is int for t in prompt):  # (the usual case: a fraction of the ABC check's cost a token)
        return list(prompt)
    return [int(t) for t in prompt] if all(_is_token_id(t) for t in prompt) else None


def _sampling_params(params) -> SamplingParams:
    """A SamplingParams, or a dict of its fields (as some callers pass them)."""
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        return SamplingParams(**params)
    raise TypeError(f"sampling_params must be a SamplingParams or a dict of its fields, not {type(params).__name__}")


class LLM:
    """`LLM(model=PATH_OR_PRESET, dtype=..., device=..., enforce_eager=..., max_num_seqs=..., ...)`.

    Keyword arguments are `EngineConfig` fields (vLLM's names).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.config = EngineConfig(**kwargs) if model is None else EngineConfig(model=model, **kwargs)
        if self.config.data_parallel_size != 1:
            raise ValueError("data_parallel_size is `kiln serve`'s (engine cores behind one server); LLM runs one")
        # The tokenizer and generation_config.json before the model: a missing or bad one fails before the load and
        # compile
        path = tokenizer_dir_of(self.config)
        tokenizer_class = None if path is None else resolve_tokenizer_class(path, model_memo(self.config))
        self.tokenizer = load_tokenizer(path, tokenizer_class)
        auto = self.config.generation_config == "auto"
        self.sampling_defaults = generation_defaults(model_dir_of(self.config)) if auto else {}
        self.engine = EngineCore(self.config)
        # (the engine holds reference cycles, which frozen objects never leave: an LLM dropped unclosed closes it here)
        self._finalizer = weakref.finalize(self, self.engine.close)
        freeze_startup_objects()
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no sampling params: the model's generation_config.json
        fields (temperature, top_p, top_k, min_p, repetition_penalty) over SamplingParams' defaults, as vLLM."""
        return SamplingParams(**self.sampling_defaults)

    def close(self) -> None:
        """Close the engine: its tensor-parallel workers stopped, its GPU memory given back (also done when the LLM is
        dropped, and at exit; not for an LLM kept in a reference cycle, which start-up's freeze keeps from the
        collector: close that one). Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def uses_dummy_weights(self) -> bool:
        return self.engine.load_format == "dummy"

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and _is_token_id(prompts[0])):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, dict)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        sampling_params = [_sampling_params(p) for p in sampling_params]

        results: list[RequestOutput] = []
        sequences: dict[str, tuple[RequestOutput, _Sequence]] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                results.append(self._add(prompt, params, sequences))
            self._run(sequences, use_tqdm)
        except BaseException:
            # an interrupted or failed step may have left their blocks' KV half written
            self.engine.abort_requests(list(sequences), uncache=True)
            raise
        return results

    def _add(self, prompt: Prompt, params: SamplingParams, sequences: dict) -> RequestOutput:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and (token_ids := _token_ids(prompt)) is not None:
            text = None
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if params.structured_output is not None:
            # A schema that does not parse fails here, at once; the engine's compile is the backstop.
            from kiln.engine.structured_output.grammar import check_grammar  # noqa: PLC0415  (xgrammar on first use)

            check_grammar(params.structured_output)
        request_id = str(next(self._ids))
        result = RequestOutput(request_id, text, token_ids)
        for index in range(params.n):
            child_id = f"{request_id}-{index}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)  # as the server's
            self.engine.add_request(child_id, token_ids, child_params)
            text = None
            if params.stop:
                text = TextStream(
                    self.tokenizer,
                    token_ids,
                    params.stop,
                    params.skip_special_tokens,
                    params.include_stop_str_in_output,
                    params.min_tokens,
                )
            output = CompletionOutput(index, "", [])
            result.outputs.append(output)
            sequences[child_id] = (result, _Sequence(output, params, text, prompt_token_ids=token_ids))
        return result

    def _run(self, sequences: dict[str, tuple[RequestOutput, _Sequence]], use_tqdm: bool) -> None:
        unfinished = {result.request_id: len(result.outputs) for result, _ in sequences.values()}
        bar = tqdm(total=len(unfinished), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, num_generated = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            step = self.engine.step()
            if step.failed:  # a grammar that did not compile in time, or rejected a token
                raise ValueError("; ".join(f"request {f.request_id} failed: {f.message}" for f in step.failed))
            for out in step.outputs:
                result, seq = sequences[out.request_id]
                num_generated += len(out.new_token_ids)
                if out.num_cached_tokens > result.num_cached_tokens:
                    result.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = [None if e is None else _logprob_dict(e) for e in out.prompt_logprobs]
                if self._update(out, seq):
                    unfinished[result.request_id] -= 1
                    if unfinished[result.request_id] == 0:
                        result.finished = True
                        bar.update(1)
            bar.set_postfix_str(f"{num_generated / (time.perf_counter() - start):.1f} tok/s", refresh=False)
        bar.close()

    def _update(self, out: EngineCoreOutput, seq: _Sequence) -> bool:
        """Fold one step's tokens into the sequence; True when it has finished."""
        output = seq.output
        output.token_ids += out.new_token_ids
        if out.finish_reason is None and out.new_logprobs is None and seq.text is None:
            return False  # most steps of most sequences: one more token, nothing else to do
        if out.new_logprobs is not None:
            # each token's entry lists the sampled token first
            seq.logprobs += [_logprob_dict(entry) for entry in out.new_logprobs]
            output.logprobs = seq.logprobs
            output.cumulative_logprob = (output.cumulative_logprob or 0.0) + sum(e[0][1] for e in out.new_logprobs)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        # the engine stops a request with "stop" only on a stop token (EOS, stop_token_ids, a grammar's end)
        stop_token = finish_reason == "stop"
        if seq.text is not None:
            _, stop = seq.text.update(out.new_token_ids, finished=finish_reason is not None, stop_token=stop_token)
            output.text = seq.text.text
            if stop is not None:
                if finish_reason is None:
                    self.engine.abort_requests([out.request_id])
                finish_reason, stop_reason = "stop", stop
        elif finish_reason is not None:
            # decoded once, as the server's stream is: after the prompt's last tokens, the stop token left out
            params = seq.params
            text = TextStream(
                self.tokenizer, seq.prompt_token_ids, (), params.skip_special_tokens, params.include_stop_str_in_output
            )
            text.update(output.token_ids, finished=True, stop_token=stop_token)
            output.text = text.text
        if finish_reason is None:
            return False
        if seq.logprobs:
            for entry in seq.logprobs:
                for token_id, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([token_id])
        output.finish_reason, output.stop_reason = finish_reason, stop_reason
        return True


def _logprob_dict(entry) -> dict[int, Logprob]:
    """An engine entry ([token id, logprob, rank] ..., the token's own first) as vLLM's {token id: Logprob}."""
    return {int(t): Logprob(lp, int(rank)) for t, lp, rank in entry}
