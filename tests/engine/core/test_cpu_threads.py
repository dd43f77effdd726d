"""The engine's CPU threads: by default the cores this process may use less one (the API server and other processes
keep a core; threads that outnumber free cores spin against each other), OMP_NUM_THREADS where the user set it,
`--cpu-threads` above both; an engine on the CPU computes with them."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.engine import LLM, EngineConfig
from kiln.engine.core.resolve import cpu_threads


def test_default_leaves_a_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(EngineConfig()) == max(1, cores - 1)
    assert cpu_threads(EngineConfig(tensor_parallel_size=2)) == max(1, (cores - 1) // 2)


def test_omp_num_threads_then_the_flag(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(EngineConfig()) == 3
    assert cpu_threads(EngineConfig(cpu_threads=5)) == 5
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineConfig(cpu_threads=0)


def test_an_engine_computes_with_them(tiny_llama_dir):
    before = torch.get_num_threads()
    try:
        with LLM(str(tiny_llama_dir), enforce_eager=True, cpu_threads=1, max_model_len=64, num_kv_blocks=8) as llm:
            assert torch.get_num_threads() == 1
            assert llm.generate([[1, 2, 3]], {"max_tokens": 2}, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        torch.set_num_threads(before)
