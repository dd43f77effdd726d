"""Measure the GPU memory a step can take, so the KV cache gets what is left (and no more)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.cache import allocate_kv_caches
from kiln.engine.request import Request
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from kiln.engine.engine_core import EngineCore


def profile_forward(core: EngineCore, max_model_len: int) -> int:
    """Peak bytes in use during the largest prefill step and the largest sampling step.

    Weights are counted (they are allocated already), the throwaway KV cache of the run is not, and
    memory outside PyTorch's allocator (CUDA context, library workspaces) is added.
    """
    config = core.config
    block_size = config.block_size
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)  # the sampler's widest path
    budget = config.max_num_batched_tokens
    seq_len = min(budget, max_model_len - 1)
    prefill_lens = [seq_len] * (budget // seq_len) + ([budget % seq_len] if budget % seq_len else [])
    prefill_lens = prefill_lens[: config.max_num_seqs]
    decode_lens = [1] * min(config.max_num_seqs, budget)
    num_blocks = 1 + max(sum(-(-n // block_size) for n in prefill_lens), len(decode_lens))
    kv_caches = allocate_kv_caches(core.kv_spec, num_blocks, core.device)
    kv_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
    runner = core._make_runner(kv_caches, max_model_len)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for lens in (prefill_lens, decode_lens):
        requests, block_ids, next_block = [], [], 1
        for i, n in enumerate(lens):
            requests.append(Request(f"profile-{i}", [0] * n, params, (), max_tokens=1))
            count = -(-n // block_size)
            block_ids.append(list(range(next_block, next_block + count)))
            next_block += count
        runner.execute(SchedulerOutput(requests, list(lens), block_ids, [], [0] * len(lens), [True] * len(lens)))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - kv_bytes
    free, total = torch.cuda.mem_get_info()
    outside_torch = (total - free) - torch.cuda.memory_reserved()
    del runner, kv_caches
    torch.cuda.empty_cache()
    return peak + max(outside_torch, 0)
