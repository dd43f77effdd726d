"""Tensor parallelism on CPU: 2 ranks over gloo (rank 0 in this process, rank 1 a spawned worker).

Greedy tokens with TP=2 equal TP=1 and Hugging Face on the tiny Llama (2 KV heads: split, one per rank), Qwen3 (1 KV
head: replicated on both ranks), Qwen2 (QKV biases, tied embeddings, and an odd vocabulary that pads the last rank's
shard), Gemma 2 and Gemma 3 (sliding windows, soft-caps, two RoPEs) and Qwen3-MoE (experts cut along their columns),
eager, and compiled from a cold compile cache then from the warm one; a rank that lacks its own saved graph makes every
rank trace; a killed worker fails the engine fast; shutdown, a failed start-up, and dropping the engine, leave no child
process behind. Without processes: how the layers cut their weights for more ranks than the CPU tests start.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams
from kiln.engine.config import EngineConfig
from kiln.engine.core.tensor_parallel import RanksOutOfStepError, TensorParallelWorkers
from kiln.engine.models.parallel import QKVParallelLinear, TensorParallelShard, VocabParallelEmbedding
from kiln.engine.models.source import resolve_model
from kiln.engine.worker import model_runner

from helpers.fault_injection.sitecustomize import failing_launch
from helpers.models import make_tiny_model_dir

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], [7, 7, 7], list(range(20, 61)), [300, 12]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# Small KV caches (the CPU default is 1 GiB per rank) and a budget that chunks the 41-token prompt, so
# steps mix prefill chunks with decodes.
ENGINE = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def qwen2_odd_vocab_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen2-odd-vocab"), "qwen2", vocab_size=509)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2", "gemma2", "gemma3", "qwen3_moe"])
def model_dir(request, tiny_llama_dir, tiny_model_dir_qwen3, qwen2_odd_vocab_dir, tiny_qwen3_moe_dir, tmp_path_factory):
    if request.param.startswith("gemma"):  # (windows of 8, soft-caps or two RoPEs, four norms a layer)
        return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    made = {"llama": tiny_llama_dir, "qwen3": tiny_model_dir_qwen3, "qwen2": qwen2_odd_vocab_dir}
    return {**made, "qwen3_moe": tiny_qwen3_moe_dir}[request.param]


@pytest.fixture(scope="module")
def reference(model_dir):
    """TP=1 outputs of the same engine, and a check against Hugging Face's greedy tokens."""
    single = LLM(str(model_dir), enforce_eager=True, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def assert_matches_hf(prompt: list[int], tokens: list[int]) -> None:
        """Equal up to a near-tie of the reference's top two logits, where either token is a right argmax."""
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        for i, (got, want) in enumerate(zip(tokens, expected)):
            if got != want:
                with torch.no_grad():
                    top2 = hf(torch.tensor([prompt + expected[:i]])).logits[0, -1].topk(2).values
                assert top2[0] - top2[1] <= 1e-5, f"token {i} differs ({got} vs {want}) without a near-tie"
                return

    return single, assert_matches_hf


def _assert_reaped(processes: list[multiprocessing.Process]) -> None:
    """Exited and waited for (an exit code is only known once reaped): no zombie, no orphan."""
    assert processes and all(p.exitcode is not None for p in processes)
    assert not set(processes) & set(multiprocessing.active_children())


def _assert_no_workers() -> None:
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("kiln-tp-worker")]
    assert not dist.is_initialized()


def test_tiny_models_exercise_split_and_replicated_kv_heads(tiny_llama_dir, tiny_model_dir_qwen3, qwen2_odd_vocab_dir):
    llama, qwen3, qwen2 = (
        resolve_model(str(d)).model_config for d in (tiny_llama_dir, tiny_model_dir_qwen3, qwen2_odd_vocab_dir)
    )
    assert llama.num_heads % 2 == 0 and llama.num_kv_heads == 2  # one KV head per rank
    assert qwen3.num_heads % 2 == 0 and qwen3.num_kv_heads == 1  # the one KV head on both ranks
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.vocab_size % 2 == 1


def generate_tp2(model_dir, **kwargs) -> tuple[list, dict]:
    """TP=2's greedy outputs of PROMPTS and its start-up stats; each rank holds its share of the heads, and the
    workers exit when told to."""
    with LLM(str(model_dir), tensor_parallel_size=2, **ENGINE, **kwargs) as llm:
        workers = llm.engine.executor.tp_workers.processes
        config = llm.engine.model_config
        assert llm.engine.executor.kv_spec.num_kv_heads == max(config.num_kv_heads // 2, 1)
        assert llm.engine.executor.model.model.layers[0].self_attn.num_heads == config.num_heads // 2
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.engine.startup_stats
    _assert_reaped(workers)
    assert all(p.exitcode == 0 for p in workers)  # told to stop, not killed
    return outputs, stats


def assert_equal_to_tp1_and_hf(outputs, reference) -> None:
    single, assert_matches_hf = reference
    for prompt, got, want in zip(PROMPTS, outputs, single, strict=True):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        for lp_got, lp_want in zip(got.logprobs, want.logprobs):
            assert lp_got.keys() == lp_want.keys()
            assert all(math.isclose(lp_got[t].logprob, lp_want[t].logprob, abs_tol=1e-4) for t in lp_got)
        assert_matches_hf(prompt, got.token_ids)


def cache_entries(root: Path) -> dict[int, Path]:
    """The compile cache's entries under `root`, by the tensor-parallel rank their key names."""
    keys = {path.parent: json.loads(path.read_text()) for path in root.glob("*/key.json")}
    return {key["settings"]["tensor_parallel"]["rank"]: folder for folder, key in keys.items()}


def test_tp2_eager_equals_tp1_and_hf(model_dir, reference):
    outputs, _ = generate_tp2(model_dir, enforce_eager=True)
    assert_equal_to_tp1_and_hf(outputs, reference)


def test_tp2_compiled_cold_then_warm_equals_tp1_and_hf(model_dir, reference, tmp_path):
    """A cold start traces and compiles; a second start from the same cache folder loads each rank's own saved graph
    and pieces (a rank's pieces hold its shard's constants, the vocabulary range of its embedding: each rank keeps an
    entry of its own) and neither traces nor compiles. Every rank loads or every rank traces, so rank 0's stats speak
    for both."""
    outputs, cold = generate_tp2(model_dir, compile_cache_dir=str(tmp_path))
    num_layers = resolve_model(str(model_dir)).model_config.num_layers
    assert cold["dynamo_traces"] == 1 and cold["compute_pieces"] == num_layers + 1
    assert cold["inductor_compiles"] == cold["unique_pieces"] and cold["cache_hits"] == 0
    assert sorted(cache_entries(tmp_path)) == [0, 1]
    assert_equal_to_tp1_and_hf(outputs, reference)

    outputs, warm = generate_tp2(model_dir, compile_cache_dir=str(tmp_path))
    assert warm["dynamo_traces"] == 0 and warm["inductor_compiles"] == 0
    assert warm["cache_hits"] == warm["unique_pieces"] == cold["unique_pieces"]
    assert warm["compute_pieces"] == cold["compute_pieces"]
    assert_equal_to_tp1_and_hf(outputs, reference)


def test_a_rank_without_its_own_saved_graph_makes_every_rank_trace(tiny_llama_dir, tmp_path):
    """Rank 1's entry holding rank 0's saved graph (what one entry shared by the ranks left behind): rank 1 refuses
    it, and rank 0, which has its own, traces as well; the pieces still come from the cache, and the outputs are
    TP=1's."""
    single = LLM(str(tiny_llama_dir), enforce_eager=True, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    _, cold = generate_tp2(tiny_llama_dir, compile_cache_dir=str(tmp_path))
    entries = cache_entries(tmp_path)
    shutil.copy(entries[0] / "forward.json", entries[1] / "forward.json")
    outputs, stats = generate_tp2(tiny_llama_dir, compile_cache_dir=str(tmp_path))
    assert stats["dynamo_traces"] == 1 and stats["inductor_compiles"] == 0
    assert stats["cache_hits"] == stats["unique_pieces"] == cold["unique_pieces"]
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in single]
    for got, want in zip(outputs, single):
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert all(math.isclose(lp_got[t].logprob, lp_want[t].logprob, abs_tol=1e-4) for t in lp_got)
    assert json.loads((entries[1] / "forward.json").read_text())["cache_key"] == entries[1].name  # its own again


def test_dummy_weights_do_not_depend_on_tp_size(tiny_model_dir_qwen3):
    """Each rank draws every whole tensor from the seed and keeps its slice: the same model as TP=1."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kwargs = dict(load_format="dummy", enforce_eager=True, **ENGINE)
    single = LLM(str(tiny_model_dir_qwen3), **kwargs).generate(PROMPTS, params, use_tqdm=False)
    with LLM(str(tiny_model_dir_qwen3), tensor_parallel_size=2, **kwargs) as llm:
        split = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]


def test_killed_worker_fails_fast(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    workers = llm.engine.executor.tp_workers.processes
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # the engine runs
    killer = threading.Timer(0.5, os.kill, (workers[0].pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel worker .* exited with code -9"):
            llm.generate(PROMPTS, long, use_tqdm=False)  # killed mid-generation, inside a collective or between
    finally:
        killer.cancel()
    assert time.monotonic() - start < 10.0
    # The engine stays down: a new request fails at once, it does not wait on the dead rank.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel worker"):
        llm.generate(PROMPTS[:1], long, use_tqdm=False)
    assert time.monotonic() - start < 2.0
    llm.close()
    _assert_reaped(workers)


def test_a_rank0_only_failure_is_fatal_not_retried(tiny_llama_dir, monkeypatch):
    """A step that fails on rank 0 alone (the fault hook exists only in this process) cannot be retried
    request by request as with one rank: the workers may be inside its collectives. The server's
    isolating step raises instead of pairing collectives wrongly."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    workers = list(llm.engine.executor.tp_workers.processes)
    monkeypatch.setattr(model_runner.ModelRunner, "launch", failing_launch(model_runner.ModelRunner.launch, 7))
    llm.engine.add_request("faulty", [7, 8, 9], SamplingParams(max_tokens=2))
    with pytest.raises(RanksOutOfStepError, match="injected fault"):
        llm.engine.step(isolate_failures=True)
    llm.close()
    _assert_reaped(workers)


def listening_addresses(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1].split(":")[0])
    return found


def test_the_rendezvous_and_the_ranks_listen_on_loopback_only(tiny_llama_dir):
    """The TCPStore (the ranks' rendezvous, up for the whole run) and gloo's sockets, in rank 0 and a worker."""
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    with LLM(str(tiny_llama_dir), enforce_eager=True, tensor_parallel_size=2, **ENGINE) as llm:
        for pid in (os.getpid(), *(p.pid for p in llm.engine.executor.tp_workers.processes)):
            addresses = listening_addresses(pid)
            assert set(addresses) <= loopback, (pid, addresses)
        assert listening_addresses(os.getpid())  # (the store is there to be found)


def test_dropped_engine_reaps_its_workers(tiny_llama_dir):
    """No close(): garbage collection stops the workers (and a new TP engine can start after it)."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    workers = list(llm.engine.executor.tp_workers.processes)
    del llm
    gc.collect()
    _assert_reaped(workers)


def test_failed_start_up_stops_its_workers(tiny_llama_dir, tmp_path):
    """A start-up that fails once the workers run stops them at once, though the traceback keeps the
    half-built engine. An error every rank raises is rank 0's to report, not a worker's exit."""
    held = []  # NOTE: the tracebacks, kept as a caller or a REPL would keep them
    with pytest.raises(ValueError, match="KV cache holds") as failure:
        LLM(str(tiny_llama_dir), enforce_eager=True, tensor_parallel_size=2, **{**ENGINE, "num_kv_blocks": 4})
    held.append(failure)
    _assert_no_workers()
    with pytest.raises(FileNotFoundError, match="no tokenizer") as failure:  # before the engine: no worker starts
        LLM(str(tiny_llama_dir), tokenizer=str(tmp_path), enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    held.append(failure)
    _assert_no_workers()


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(model="llama-3.2-1b", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"needs GPUs 1\.\.2, but 2 are visible"):
        TensorParallelWorkers(config, torch.device("cuda", 1))
    _assert_no_workers()


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
@torch.no_grad()
def test_qkv_shards_pair_query_heads_with_their_kv_heads(num_kv_heads):
    """4 ranks, 8 query heads: each local query head must find, through the rank's own GQA grouping, the KV
    head Hugging Face pairs it with (query head h reads KV head h // (8 / num_kv_heads))."""
    hidden, head_dim, num_heads, tp_size = 4, 2, 8, 4
    full = {
        "q": torch.arange(num_heads).repeat_interleave(head_dim).float(),
        "k": 100 + torch.arange(num_kv_heads).repeat_interleave(head_dim).float(),
        "v": 200 + torch.arange(num_kv_heads).repeat_interleave(head_dim).float(),
    }
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, True, TensorParallelShard(rank, tp_size))
        for name, rows in full.items():
            layer.load_weight("weight", rows[:, None].expand(-1, hidden), name)
            layer.load_weight("bias", rows, name)
        q, k, v = layer.bias.split([layer.num_heads * head_dim, *[layer.num_kv_heads * head_dim] * 2])
        assert torch.equal(layer.weight[:, 0], layer.bias)
        per_group = layer.num_heads // layer.num_kv_heads
        for j in range(layer.num_heads):
            h = int(q[j * head_dim])
            assert h == rank * layer.num_heads + j
            kv_head = h // (num_heads // num_kv_heads)
            assert k[j // per_group * head_dim] == 100 + kv_head and v[j // per_group * head_dim] == 200 + kv_head


@pytest.mark.parametrize(("vocab_size", "tp_size"), [(509, 2), (509, 4), (5, 4)])
@torch.no_grad()
def test_vocab_shards_join_to_the_vocabulary(vocab_size, tp_size):
    """The LM head's all-gather puts the ranks' rows side by side: the vocabulary, then padding only."""
    full = torch.arange(vocab_size, dtype=torch.float32)[:, None].expand(-1, 3)
    shards = []
    for rank in range(tp_size):
        layer = VocabParallelEmbedding(vocab_size, 3, TensorParallelShard(rank, tp_size))
        layer.weight.fill_(float("nan"))
        layer.load_weight("weight", full, None)
        shards.append(layer.weight)
    joined = torch.cat(shards)
    assert torch.equal(joined[:vocab_size], full) and not joined[vocab_size:].any()
