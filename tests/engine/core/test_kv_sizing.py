"""KV sizing: bytes per block, blocks for a budget, the GPU budget, cache allocation."""

from __future__ import annotations

import pytest
import torch

from kiln.cache import KVCacheSpec, allocate_kv_caches, gpu_kv_budget_bytes, num_blocks_for_budget

GIB = 1 << 30

# Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16, 16 tokens per block.
LLAMA_8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


def test_bytes_per_block_by_hand():
    # K and V (2) x 32 layers x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB.
    assert LLAMA_8B.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2 == 2 * 1024 * 1024
    fp32 = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=5, block_size=7, dtype=torch.float32)
    assert fp32.bytes_per_block == 2 * 2 * 7 * 3 * 5 * 4 == 1680


def test_shape_matches_bytes():
    assert LLAMA_8B.shape(100) == (2, 100, 16, 8, 128)
    elements = torch.Size(LLAMA_8B.shape(100)).numel()
    # One layer's tensor holds num_blocks blocks of that layer's share.
    assert elements * 2 * LLAMA_8B.num_layers == 100 * LLAMA_8B.bytes_per_block


def test_num_blocks_for_budget_rounds_down():
    assert num_blocks_for_budget(LLAMA_8B, 10 * GIB) == 5120  # 10 GiB / 2 MiB
    assert num_blocks_for_budget(LLAMA_8B, 10 * GIB + 2 * 1024 * 1024 - 1) == 5120
    assert num_blocks_for_budget(LLAMA_8B, 2 * LLAMA_8B.bytes_per_block) == 2


def test_num_blocks_for_budget_too_small():
    with pytest.raises(ValueError, match=r"2097152 bytes") as info:
        num_blocks_for_budget(LLAMA_8B, 2 * LLAMA_8B.bytes_per_block - 1)
    assert str(2 * LLAMA_8B.bytes_per_block - 1) in str(info.value)
    with pytest.raises(ValueError):
        num_blocks_for_budget(LLAMA_8B, -5)


def test_gpu_kv_budget_bytes():
    # 80 GiB card at 0.9 => 72 GiB allowed; 20 GiB used at peak leaves 52 GiB.
    assert gpu_kv_budget_bytes(80 * GIB, 0.9, 20 * GIB) == int(80 * GIB * 0.9) - 20 * GIB
    assert gpu_kv_budget_bytes(80 * GIB, 1.0, 0) == 80 * GIB


def test_gpu_kv_budget_bytes_errors():
    with pytest.raises(ValueError, match=r"72\.00 GiB.*80\.00 GiB"):
        gpu_kv_budget_bytes(80 * GIB, 0.9, 80 * GIB)
    with pytest.raises(ValueError, match="no memory left"):
        gpu_kv_budget_bytes(80 * GIB, 0.5, 40 * GIB)  # exactly zero left
    for utilization in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            gpu_kv_budget_bytes(80 * GIB, utilization, 0)


def test_spec_rejects_nonpositive_fields():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=0, dtype=torch.float16)


def test_allocate_kv_caches():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float16)
    caches = allocate_kv_caches(spec, num_blocks=5, device="cpu")
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == (2, 5, 8, 2, 4) and cache.dtype == torch.float16
        assert cache.device.type == "cpu" and not cache.any()
    assert caches[0].data_ptr() != caches[1].data_ptr()  # separate storage per layer
    assert sum(c.numel() * c.element_size() for c in caches) == 5 * spec.bytes_per_block


def test_measured_peak_is_kept_in_the_compile_cache(tmp_path, monkeypatch):
    """The profiled peak is measured once per compile-cache entry and sizing inputs: a second start reads it; other
    sizing inputs, a damaged file or a disabled cache measure again."""
    from kiln.compile import CompileCache
    from kiln.engine.config import EngineConfig
    from kiln.engine.core import kv_sizing

    peaks = iter([7 << 30, 9 << 30, 11 << 30, 13 << 30])
    measured = []
    monkeypatch.setattr(kv_sizing, "profile_forward", lambda *args: measured.append(1) or next(peaks))
    cache = CompileCache(tmp_path, {"model": "tiny"})

    def peak(compile_cache=cache, **config) -> int:
        config = EngineConfig(model="tiny", **config)
        return kv_sizing.measured_peak(config, LLAMA_8B, "cuda", 4096, compile_cache, make_runner=None)

    assert peak() == 7 << 30 and len(measured) == 1
    assert peak() == 7 << 30 and len(measured) == 1  # a warm start: read back
    assert peak(max_num_seqs=8) == 9 << 30 and len(measured) == 2  # other inputs
    (tmp_path / cache.key / kv_sizing.KV_SIZING).write_text("{not json")
    assert peak() == 11 << 30 and len(measured) == 3  # damaged: measured again
    assert peak(compile_cache=None) == 13 << 30 and len(measured) == 4
