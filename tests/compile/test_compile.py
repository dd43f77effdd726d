"""The compiled path on CPU (Inductor's C++ backend): split, equality with eager, the disk cache,
and no compilation after start-up."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from kiln.backends import environment
from kiln.backends.attention.op import attend
from kiln.compile import cache as cache_module
from kiln.compile.backend import CompiledPiece
from kiln.engine import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], [7, 7, 7], list(range(20, 61)), [300, 12]]


@pytest.fixture(params=["llama", "qwen3"])
def model_dir(request, tiny_llama_dir, tiny_model_dir_qwen3):
    return tiny_llama_dir if request.param == "llama" else tiny_model_dir_qwen3


def test_compiled_equals_eager_and_never_recompiles(model_dir, tmp_path):
    compiled = LLM(str(model_dir), max_model_len=256, compile_cache_dir=str(tmp_path))
    eager = LLM(str(model_dir), max_model_len=256, enforce_eager=True)
    stats = compiled.engine.startup_stats
    num_layers = compiled.engine.model_config.num_layers
    assert stats["dynamo_traces"] == 1
    assert stats["compute_pieces"] == num_layers + 1 and stats["attention_ops"] == num_layers
    assert stats["inductor_compiles"] == stats["unique_pieces"] <= 3  # identical middle layers share one
    # the attention pieces call the op's body directly, not through the dispatcher
    split = compiled.engine.executor.compiled.backend.split
    calls = [
        node.target
        for _, piece in split.named_children()
        if not isinstance(piece, CompiledPiece)
        for node in piece.graph.nodes
        if node.op == "call_function"
    ]
    assert calls == [attend] * num_layers

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    a = compiled.generate(PROMPTS, params, use_tqdm=False)
    b = eager.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert all(math.isclose(lx[t].logprob, ly[t].logprob, abs_tol=1e-4) for t in lx)

    # Many more shapes: single tokens (the trace was at 16, and T = 1 runs the same code), long chunks, mixed
    # batches; still the eager tokens. The fail_on_recompile stance would raise on a new trace; the counters
    # must not move either.
    compiles = compiled.engine.executor.counters.inductor_compiles
    shapes = [[[1]], [list(range(1, 200))], [[3] * n for n in (1, 2, 5, 33, 64)], [[9] * 130, [4]]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for prompts in shapes:
        got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (compiled, eager))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert compiled.engine.executor.counters.dynamo_traces == 1
    assert compiled.engine.executor.counters.inductor_compiles == compiles

    # Closing drops the trace's Dynamo cache entry: its guards hold the model (on a GPU they outlived the engine)
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    code = compiled.engine.executor.compiled._code
    assert len(entries(code)) == 1
    compiled.close()
    assert len(entries(code)) == 0


def _start_in_subprocess(model_dir, cache_dir, dtype="float32") -> subprocess.Popen:
    code = (
        "import json, sys; from kiln.engine import LLM, SamplingParams; "
        f"llm = LLM({str(model_dir)!r}, dtype={dtype!r}, max_model_len=128, compile_cache_dir={str(cache_dir)!r}); "
        "params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True); "
        "out = llm.generate([[1, 2, 3]], params, use_tqdm=False); "
        "print(json.dumps({**llm.engine.startup_stats, 'tokens': out[0].outputs[0].token_ids}))"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stats(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_disk_cache_across_processes(tiny_llama_dir, tmp_path):
    """Two processes warming one empty cache at once both succeed; a third starts warm."""
    cache = tmp_path / "cache"
    first, second = _start_in_subprocess(tiny_llama_dir, cache), _start_in_subprocess(tiny_llama_dir, cache)
    a, b = _stats(first), _stats(second)
    assert a["tokens"] == b["tokens"]
    assert a["inductor_compiles"] + a["cache_hits"] == a["unique_pieces"]
    warm = _stats(_start_in_subprocess(tiny_llama_dir, cache))
    assert warm["inductor_compiles"] == 0 and warm["cache_hits"] == warm["unique_pieces"]
    assert warm["dynamo_traces"] == 0  # the saved split graph, rebuilt: no trace
    assert warm["tokens"] == a["tokens"]
    assert warm["compile_cache_dir"] == a["compile_cache_dir"]
    pieces = list((cache / a["compile_cache_dir"].rsplit("/", 1)[-1] / "pieces").glob("*.bin"))
    assert len(pieces) == a["unique_pieces"]
    assert not list(cache.rglob("*.tmp"))  # no half-written artifacts left behind
    split = (cache / a["compile_cache_dir"].rsplit("/", 1)[-1] / "split_graph.py").read_text()
    assert "submod_0" in split and "attention (eager)" in split

    # A different dtype or model config is a different cache entry: a miss.
    other = _stats(_start_in_subprocess(tiny_llama_dir, cache, dtype="bfloat16"))
    assert other["cache_hits"] == 0 and other["inductor_compiles"] > 0
    assert other["compile_cache_dir"] != a["compile_cache_dir"]


def test_warm_start_runs_the_saved_graph_without_dynamo(tiny_llama_dir, tmp_path):
    """The traced split graph is saved beside the artifacts; a start that finds both neither traces nor compiles
    and gives the cold start's logprobs exactly. A damaged saved graph, or a missing artifact, is a miss: that
    start traces (and compiles what is missing) as a cold one would, and repairs the entry."""
    cache = tmp_path / "cache"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def start() -> tuple[dict, list]:
        llm = LLM(str(tiny_llama_dir), max_model_len=128, compile_cache_dir=str(cache))
        outputs = [
            (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params, use_tqdm=False)
        ]
        stats = llm.engine.startup_stats
        llm.close()
        return stats, outputs

    cold, want = start()
    folder = cache / cold["compile_cache_dir"].rsplit("/", 1)[-1]
    assert cold["dynamo_traces"] == 1 and (folder / "forward.json").exists()
    warm, got = start()
    assert warm["dynamo_traces"] == 0 and warm["inductor_compiles"] == 0
    assert warm["cache_hits"] == warm["unique_pieces"] == cold["unique_pieces"]
    assert (warm["compute_pieces"], warm["attention_ops"]) == (cold["compute_pieces"], cold["attention_ops"])
    assert got == want

    (folder / "forward.json").write_text("{")  # damaged
    stats, got = start()
    assert stats["dynamo_traces"] == 1 and stats["inductor_compiles"] == 0 and got == want
    assert json.loads((folder / "forward.json").read_text())["pieces"]  # written again
    next((folder / "pieces").glob("*.bin")).unlink()  # an artifact gone
    stats, got = start()
    assert stats["dynamo_traces"] == 1 and stats["inductor_compiles"] == 1 and got == want


def test_saved_graph_refuses_what_it_cannot_describe():
    """Only the split's own shape is saved (pieces, getitems, attention): anything else stays with Dynamo."""
    import torch

    from kiln.compile.saved_graph import Unsaveable, describe

    example = {"input_ids": torch.zeros(4, dtype=torch.long), "positions": torch.zeros(4, dtype=torch.long)}
    relu = torch.fx.symbolic_trace(lambda input_ids: (torch.relu(input_ids),))
    with pytest.raises(Unsaveable, match="relu"):
        describe(relu, ["L['input_ids']"], {}, example)
    identity = torch.fx.symbolic_trace(lambda input_ids: (input_ids,))
    with pytest.raises(Unsaveable, match="G\\['table'\\]"):
        describe(identity, ["G['table']"], {}, example)
    assert describe(identity, ["L['input_ids']"], {}, example)["traced"]["input_ids"]["offset"] == 0


def test_changed_config_misses(tiny_llama_dir, tmp_path):
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(tiny_llama_dir, changed)
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (changed / "config.json").write_text(json.dumps(config))
    cache = tmp_path / "cache"
    a = LLM(str(tiny_llama_dir), max_model_len=128, compile_cache_dir=str(cache)).engine.startup_stats
    b = LLM(str(changed), max_model_len=128, compile_cache_dir=str(cache)).engine.startup_stats
    assert a["compile_cache_dir"] != b["compile_cache_dir"] and b["cache_hits"] == 0


def test_precompile_cli_warms_the_cache(tiny_llama_dir, tmp_path):
    cache = tmp_path / "cache"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.engine.cli",
            "precompile",
            str(tiny_llama_dir),
            "--max-model-len",
            "128",
            "--compile-cache-dir",
            str(cache),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compile cache:" in result.stdout and "inductor_compiles" in result.stdout
    llm = LLM(str(tiny_llama_dir), max_model_len=128, compile_cache_dir=str(cache))
    stats = llm.engine.startup_stats
    assert stats["inductor_compiles"] == 0 and stats["cache_hits"] == stats["unique_pieces"]


def test_cache_can_be_disabled(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "ENV", dataclasses.replace(environment.ENV, compile_cache=False))
    llm = LLM(str(tiny_llama_dir), max_model_len=128, compile_cache_dir=str(tmp_path / "cache"))
    assert llm.engine.startup_stats["cache_hits"] == 0 and not (tmp_path / "cache").exists()


def test_a_read_only_or_unusable_cache_folder_is_a_warning(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """A warm cache that cannot be written (a read-only mount: every write fails as one does there) is used as it
    is; a folder that cannot be made at all (under a file) is a warning and a run without the cache."""
    cache = tmp_path / "cache"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def start(root) -> tuple[dict, list]:
        llm = LLM(str(tiny_llama_dir), max_model_len=128, compile_cache_dir=str(root))
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.close()
        return llm.engine.startup_stats, out

    cold, want = start(cache)
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_module, "atomic_write_bytes", read_only)
    monkeypatch.setattr(cache_module, "tempfile", types.SimpleNamespace(mkstemp=read_only))
    warm, got = start(cache)
    assert warm["inductor_compiles"] == 0 and warm["cache_hits"] == cold["unique_pieces"] and got == want
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before  # (key.json too: it was not rewritten)
    monkeypatch.undo()

    (tmp_path / "a-file").write_text("")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        stats, got = start(tmp_path / "a-file" / "cache")
    assert stats["compile_cache_dir"] is None and stats["inductor_compiles"] > 0 and got == want
    assert "cannot be used" in caplog.text and "running without it" in caplog.text


def test_each_gpu_has_its_own_cache_key(monkeypatch):
    """Inductor's artifacts are bound to the GPU they were compiled on: tensor-parallel ranks (GPU 0 and 1)
    must not share a key. CUDA is faked here; the two-GPU tests exercise the real thing."""
    import torch

    from kiln.compile.cache import device_target

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    gpu0, gpu1 = device_target(torch.device("cuda", 0)), device_target(torch.device("cuda", 1))
    assert gpu0 != gpu1
    assert device_target(torch.device("cuda")) == gpu1  # no index: the current GPU


def test_an_op_schema_is_in_the_cache_key(monkeypatch):
    """A saved graph calls Kiln's ops by their schemas, which can change in files the model's classes do not live in
    (gpt-oss's experts once took their routing, now the router's logits): another schema is another key."""
    import torch

    from kiln.backends.kernels import ops

    model = torch.nn.Linear(2, 2)
    key = lambda: cache_module.cache_key_inputs("v", model, {}, torch.float32, torch.device("cpu"), {})  # noqa: E731
    before = key()
    schemas = [s.replace("int top_k", "int k") if s.startswith("gpt_oss_moe(") else s for s in ops.SCHEMAS]
    assert schemas != ops.SCHEMAS  # (the op is defined: the models' modules are imported)
    monkeypatch.setattr(ops, "SCHEMAS", schemas)
    assert key()["ops"] != before["ops"] and key()["source"] == before["source"]


def test_kiln_choices_make_norm_sized_rows_persistent():
    """Inductor's own heuristic loops over an inner reduction of more than 1,024 elements (two passes over an
    RMSNorm row of hidden 2,048); Kiln's takes rows up to 4,096 in one pass and leaves the rest as Inductor does."""
    from types import SimpleNamespace

    import sympy
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    from kiln.compile.inductor_choices import PERSISTENT_REDUCTION_MAX, KilnChoices

    def features(numel, hint=ReductionHint.INNER):
        return SimpleNamespace(reduction_numel=sympy.Integer(numel), numel=1, get_reduction_hint=lambda: hint)

    graph = SimpleNamespace(
        sizevars=SimpleNamespace(statically_known_leq=lambda a, b: bool(a <= b), optimization_hint=lambda n: n)
    )
    with V.set_graph_handler(graph):
        ours, inductors = KilnChoices(), InductorChoices()
        for numel in (512, 1024, 2048, PERSISTENT_REDUCTION_MAX, 2 * PERSISTENT_REDUCTION_MAX):
            expected = numel <= PERSISTENT_REDUCTION_MAX
            assert bool(ours.should_use_persistent_reduction(features(numel), False)) == expected, numel
            assert bool(inductors.should_use_persistent_reduction(features(numel), False)) == (numel <= 1024), numel
            # a cooperative reduction (rows split across programs) stays Inductor's call
            assert bool(ours.should_use_persistent_reduction(features(numel), True)) == bool(
                inductors.should_use_persistent_reduction(features(numel), True)
            )
        assert not ours.should_use_persistent_reduction(features(2048, ReductionHint.OUTER), False)
    assert ours.uuid() != getattr(inductors, "uuid", lambda: None)()  # its own entry in Inductor's cache key


def test_start_up_counters_count_triton_compiles_and_cache_hits(tmp_path):
    """`pin_triton_setup` counts Triton's compiles into the start-up counters through Triton's compilation listener:
    one kernel built for sm_90 (no GPU needed) into an empty cache is a compile, the same kernel again a cache hit."""
    code = (
        "import json, triton, triton.language as tl\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from kiln.compile import CompileCounters, pin_triton_setup\n"
        "pin_triton_setup()\n"
        "if not hasattr(triton.knobs.compilation, 'listener'): print('null'); raise SystemExit\n"
        "@triton.jit\n"
        "def copy(x_ptr, y_ptr, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    tl.store(y_ptr + offs, tl.load(x_ptr + offs))\n"
        "counters = CompileCounters()\n"
        "source = ASTSource(copy, {'x_ptr': '*fp32', 'y_ptr': '*fp32', 'BLOCK': 'constexpr'}, {(2,): 64})\n"
        "seen = []\n"
        "for _ in range(2):\n"
        "    triton.compile(source, target=GPUTarget('cuda', 90, 32))\n"
        "    stats = counters.as_dict(); seen.append([stats['triton_compiles'], stats['triton_cache_hits']])\n"
        "print(json.dumps(seen))\n"
    )
    script = tmp_path / "count_compiles.py"  # (a @triton.jit kernel must live in a file)
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if seen is None:
        pytest.skip("this Triton has no compilation listener")
    assert seen == [[1, 0], [1, 1]]
