"""How many KV-cache blocks an engine gets: on the GPU, what is left after measuring the memory a step can take
(and no more); the context they hold (`fit_context`, `kv_cache_tokens`); a hybrid's recurrent states, allocated
before the sizing counts them."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.backends.linear_attention.op import DraftRecord
from kiln.cache import KVCacheSpec, allocate_kv_caches, gpu_kv_budget_bytes, num_blocks_for_budget
from kiln.engine.config import EngineConfig
from kiln.engine.core.request import Request
from kiln.engine.core.scheduler import SchedulerOutput
from kiln.engine.core.tensor_parallel import min_across_ranks
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.parallel import TensorParallelShard
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.spec_decode.draft_model import draft_block_bytes

if TYPE_CHECKING:
    from kiln.compile import CompileCache
    from kiln.engine.worker.model_runner import ModelRunner

logger = logging.getLogger("kiln")

CPU_DEFAULT_KV_BYTES = 1 << 30
CUDAGRAPH_RESERVE_BYTES = 1 << 30
KV_SIZING = "kv_sizing.json"  # the measured peak, in the compile cache's folder

# A runner over the given KV caches, eager (the profile runs before anything is compiled or captured)
RunnerFactory = Callable[[list[torch.Tensor]], "ModelRunner"]


def num_kv_blocks(
    config: EngineConfig,
    kv_spec: KVCacheSpec,
    device: torch.device,
    max_model_len: int,
    uses_graphs: bool,
    cache: CompileCache | None,
    make_runner: RunnerFactory,
    draft: nn.Module | None = None,
) -> int:
    """The configured count, or the configured bytes' worth, or (on the GPU) what `gpu_memory_utilization`
    leaves after the profiled peak of a step and the CUDA graphs' reserve (`uses_graphs`). A block's bytes
    count the speculative `draft` model's own KV cache; its weights, loaded already, are in the peak."""
    extra = draft_block_bytes(draft, config.block_size)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        return num_blocks_for_budget(kv_spec, config.kv_cache_memory_bytes, extra)
    if device.type != "cuda":
        return num_blocks_for_budget(kv_spec, CPU_DEFAULT_KV_BYTES, extra)
    peak = measured_peak(config, kv_spec, device, max_model_len, cache, make_runner, draft)
    if uses_graphs:
        # NOTE: graphs are captured after the KV cache exists (full graphs read its addresses); their
        # pool is reserved here up front, and its real size is logged after capture.
        peak += CUDAGRAPH_RESERVE_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    budget = gpu_kv_budget_bytes(total, config.gpu_memory_utilization, peak)
    return num_blocks_for_budget(kv_spec, budget, extra)


def measured_peak(
    config: EngineConfig,
    kv_spec: KVCacheSpec,
    device: torch.device,
    max_model_len: int,
    cache: CompileCache | None,
    make_runner: RunnerFactory,
    draft: nn.Module | None = None,
) -> int:
    """`profile_forward`'s peak, measured once per compile-cache entry and these sizing inputs: a warm start reads it
    there (the profile is an eager forward of the whole token budget). The cache's key covers the model, dtype,
    torch, Triton, device, Kiln's source and max_model_len; the entry records the rest of what the profile's batches
    depend on, and a different one is measured again."""
    inputs = {
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "max_model_len": max_model_len,
        "block_size": config.block_size,
        "kv_spec": repr(kv_spec),
        "tensor_parallel_size": config.tensor_parallel_size,
        # (the draft's weights are in the peak, and a hybrid's draft records hold k tokens a slot)
        "speculative": _speculative_inputs(config, draft),
    }
    saved = cache.read_json(KV_SIZING) if cache is not None else None
    found = isinstance(saved, dict) and saved.get("inputs") == inputs and isinstance(saved.get("peak_bytes"), int)
    if config.tensor_parallel_size > 1:
        # NOTE: every rank profiles or none does: the profile's forward holds collectives
        found = min_across_ranks(int(found)) == 1
    if found:
        return saved["peak_bytes"]
    peak = profile_forward(config, kv_spec, device, max_model_len, make_runner)
    if cache is not None:
        cache.write_text(KV_SIZING, json.dumps({"inputs": inputs, "peak_bytes": peak}))
    return peak


def _speculative_inputs(config: EngineConfig, draft: nn.Module | None) -> list | None:
    spec = config.speculative_config
    if spec is None:
        return None
    return [spec.method, spec.num_speculative_tokens, sum(p.nbytes for p in draft.parameters()) if draft else 0]


def profile_forward(
    config: EngineConfig, kv_spec: KVCacheSpec, device: torch.device, max_model_len: int, make_runner: RunnerFactory
) -> int:
    """Peak bytes in use during the largest prefill step and the largest sampling step (minus the small KV
    cache made for the run: the real one is sized from what is left).

    Weights are counted (they are allocated already), the throwaway KV cache of the run is not, and
    memory outside PyTorch's allocator (CUDA context, library workspaces) is added.
    """
    block_size = config.block_size
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)  # the sampler's widest path
    budget = config.max_num_batched_tokens
    seq_len = min(budget, max_model_len - 1)
    prefill_lens = [seq_len] * (budget // seq_len) + ([budget % seq_len] if budget % seq_len else [])
    prefill_lens = prefill_lens[: config.max_num_seqs]
    decode_lens = [1] * min(config.max_num_seqs, budget)
    num_blocks = 1 + max(sum(-(-n // block_size) for n in prefill_lens), len(decode_lens))
    kv_caches = allocate_kv_caches(kv_spec, num_blocks, device)
    kv_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kv_caches}.values())
    runner = make_runner(kv_caches)

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


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU; None on the CPU, whose memory Kiln does not size."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return torch.cuda.mem_get_info()


def check_weights_fit(model: torch.nn.Module, device: torch.device, config: EngineConfig) -> None:
    """Raise a one-line ValueError, with the sizes, when this rank's weights (of `model`, built on the meta
    device) cannot fit in `gpu_memory_utilization` of its GPU."""
    memory = device_memory(device)
    if memory is None:
        return
    free, total = memory
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    usable = min(free, int(total * config.gpu_memory_utilization))
    if weights > usable:
        gib = 1 << 30
        ranks = config.tensor_parallel_size
        raise ValueError(
            f"the model's weights need {weights / gib:.1f} GiB on each GPU (tensor_parallel_size {ranks}), but "
            f"{device} has {usable / gib:.1f} GiB usable ({free / gib:.1f} GiB free of {total / gib:.1f} GiB, "
            f"gpu_memory_utilization {config.gpu_memory_utilization}); use a larger tensor_parallel_size, a "
            "smaller model, or a quantized checkpoint"
        )


def _window_blocks(config: EngineConfig, windows: tuple[int, ...]) -> list[int]:
    """The blocks a request holds at most in each sliding group: its window's and a step's tokens' blocks, two more
    of slack."""
    return [-(-(w - 1 + config.max_num_batched_tokens) // config.block_size) + 2 for w in windows if w]


def fit_context(config: EngineConfig, max_model_len: int, num_blocks: int, windows: tuple[int, ...] = (0,)) -> int:
    """max_model_len, lowered (with a warning) to what `num_blocks` hold unless the user set it. A request holds
    its whole context in each full group, and in each sliding group at most the blocks of its window and a step's
    tokens (the rest go back as it moves): one request at max_model_len must fit in them all."""
    block_size = config.block_size
    usable = num_blocks - 1  # block 0 is the padding's scratch block
    held = _window_blocks(config, windows)
    num_full = sum(1 for w in windows if not w)

    def blocks_for(length: int) -> int:
        return num_full * -(-length // block_size) + sum(min(h, -(-length // block_size)) for h in held)

    if blocks_for(max_model_len) <= usable:
        return max_model_len
    fits = max_model_len
    while fits > 0 and blocks_for(fits) > usable:  # (each group's blocks grow with the length: step down)
        fits -= block_size if fits % block_size == 0 else fits % block_size
    if config.max_model_len is not None:
        raise ValueError(
            f"the KV cache holds {usable * block_size} tokens a layer, too few for one request of max_model_len="
            f"{max_model_len} (it fits {fits}); lower max_model_len or give the KV cache more memory"
        )
    logger.warning("max_model_len lowered from %d to %d to fit the KV cache", max_model_len, fits)
    return fits


def kv_cache_tokens(config: EngineConfig, num_blocks: int, windows: tuple[int, ...]) -> int:
    """The tokens of context the KV cache holds: its blocks' tokens, or with full and sliding groups, what the full
    groups hold once one request's windows are held in each sliding group."""
    usable = num_blocks - 1
    num_full = sum(1 for w in windows if not w)
    if num_full in (0, len(windows)):
        return usable * config.block_size
    held = sum(_window_blocks(config, windows))
    return max(usable - held, 0) // num_full * config.block_size


def allocate_recurrent_states(
    config: EngineConfig,
    model_config: ModelConfig,
    shard: TensorParallelShard,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], tuple[int, int] | None, tuple[DraftRecord, ...]]:
    """Each recurrent layer's state tensors (this rank's heads), zeroed, and their rows' (slots, snapshots): a slot
    for each of max_num_seqs running requests, as many snapshots (none without prefix caching), and the scratch row.
    The conv window is kept in the model's dtype, the delta rule's matrix in float32 (backends/linear_attention).
    With speculative decoding, each layer's record of its slots' last step too (DraftRecord: 1 + k tokens a slot)."""
    if not model_config.linear_layers:
        return (), None, ()
    slots = config.max_num_seqs
    snapshots = config.max_num_seqs if config.enable_prefix_caching else 0
    rows = 1 + slots + snapshots
    key_dim = model_config.linear_num_key_heads * model_config.linear_key_head_dim // shard.size
    value_heads = model_config.linear_num_value_heads // shard.size
    conv_dim = 2 * key_dim + value_heads * model_config.linear_value_head_dim
    width = model_config.linear_conv_kernel_dim - 1
    conv_shape = (rows, width, conv_dim)
    ssm_shape = (rows, value_heads, model_config.linear_key_head_dim, model_config.linear_value_head_dim)
    conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in model_config.linear_layers]
    ssm = [torch.zeros(ssm_shape, dtype=torch.float32, device=device) for _ in model_config.linear_layers]
    states = tuple(zip(conv, ssm))
    records = ()
    if config.speculative_config is not None:
        places = 1 + config.speculative_config.num_speculative_tokens
        records = tuple(
            DraftRecord(
                torch.zeros(1 + slots, width + places, conv_dim, dtype=dtype, device=device),
                torch.zeros(1 + slots, places, conv_dim, dtype=dtype, device=device),
                torch.zeros(1 + slots, places, value_heads, dtype=torch.float32, device=device),
                torch.zeros(1 + slots, places, value_heads, dtype=torch.float32, device=device),
            )
            for _ in model_config.linear_layers
        )
    nbytes = sum(t.numel() * t.element_size() for group in (*states, *records) for t in group)
    logger.info(
        "recurrent state of %d layers: %d request slots and %d prefix snapshots, %.2f GiB",
        len(states),
        slots,
        snapshots,
        nbytes / (1 << 30),
    )
    return states, (slots, snapshots), records
