"""Loading from a local Hugging Face directory: sharded checkpoints, EOS ids, and readable errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.compile.cache import JsonFolder
from kiln.engine import LLM, SamplingParams
from kiln.engine.models.loader import WeightLoadError
from kiln.engine.models.source import resolve_model


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_same_weights(tiny_llama_dir, tmp_path):
    """Split model.safetensors into two shards with an index; the model must come out identical."""
    sharded = copy_dir(tiny_llama_dir, tmp_path / "sharded")
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128).generate([[1, 2, 3]], params, use_tqdm=False)
    b = LLM(str(sharded), enforce_eager=True, max_model_len=128).generate([[1, 2, 3]], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_eos_ids_from_generation_config(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    # then the tokenizer's EOS token (<|endoftext|>, id 0 in the built-in tokenizer), as vLLM stops on it too
    assert resolve_model(str(d)).model_config.eos_token_ids == (7, 9, 0)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "Ġthe"}))  # not an added token
    from transformers import AutoTokenizer  # noqa: PLC0415

    the = AutoTokenizer.from_pretrained(d).convert_tokens_to_ids("Ġthe")
    assert resolve_model(str(d)).model_config.eos_token_ids == (7, 9, the)  # (a changed file: resolved again)


def test_generation_stops_on_the_tokenizers_eos(tiny_llama_dir):
    """A model whose configs name one EOS (511) and whose tokenizer another (<|endoftext|>, 0) stops on both."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, logit_bias={0: 100.0}), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == [0] and out.finish_reason == "stop" and out.stop_reason is None


def test_the_config_memo_key_reads_the_code_that_builds_the_config(tmp_path, monkeypatch):
    """A change to any Kiln module whose functions build a ModelConfig (config.py and those it calls into) misses the
    memo: else a fixed field builder would keep serving the old config from every memo."""
    import inspect

    from kiln.engine.models import config, source

    modules = {config}
    for value in vars(config).values():
        module = inspect.getmodule(value)
        if module is not None and module.__name__.startswith("kiln.engine.models") and inspect.isfunction(value):
            modules.add(module)
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {"config", "config_families", "quant_config"}
    key = source._hash(b"parts")
    for module in modules:
        changed = tmp_path / f"{module.__name__}.py"
        changed.write_bytes(Path(module.__file__).read_bytes() + b"\n# changed\n")
        with monkeypatch.context() as patch:
            patch.setattr(module, "__file__", str(changed))
            assert source._hash(b"parts") != key, module.__name__
    assert source._hash(b"parts") == key


def test_resolved_config_is_kept_and_read_back_without_transformers(tiny_llama_dir, tmp_path, caplog):
    """The engine keeps what transformers resolved (a later start skips transformers' model classes); the same
    config and checkpoint dtype come back, and a changed config.json or a damaged memo resolves again."""
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    memo = tmp_path / "memo"
    (tmp_path / "weights.bin").write_text("a file, not a folder")
    plain = resolve_model(str(d))
    first = resolve_model(str(d), JsonFolder(memo))
    assert first.model_config == plain.model_config and len(list(memo.glob("*.json"))) == 1
    # a fresh process reads it back, and never imports transformers
    code = (
        "import sys, json; from kiln.engine.models.source import resolve_model as r; "
        "from kiln.compile.cache import JsonFolder; s = r(sys.argv[1], "
        "JsonFolder(sys.argv[2])); print(json.dumps([repr(s.model_config), "
        "s.checkpoint_dtype_name, any(m.startswith('transformers') for m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(d), str(memo)], capture_output=True, text=True, check=True)
    config, dtype, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert config == repr(plain.model_config) and dtype == plain.checkpoint_dtype_name and not imported
    assert plain.checkpoint_dtype_name == "float32" and first.hf_config.num_hidden_layers == 2
    # a changed config misses the memo: its new value comes through transformers
    config_json = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config_json, "rms_norm_eps": 1e-3}))
    assert resolve_model(str(d), JsonFolder(memo)).model_config.rms_norm_eps == 1e-3
    assert len(list(memo.glob("*.json"))) == 2
    # a damaged memo is resolved again (and rewritten)
    for f in memo.glob("*.json"):
        f.write_text("{not json")
    assert resolve_model(str(d), JsonFolder(memo)).model_config.rms_norm_eps == 1e-3
    assert any('"rms_norm_eps": 0.001' in f.read_text() for f in memo.glob("*.json"))
    # a memo folder that can be neither read nor made (under a file): resolved all the same, with a warning
    with caplog.at_level("WARNING", logger="kiln"):
        assert resolve_model(str(d), JsonFolder(tmp_path / "weights.bin" / "memo")).model_config.rms_norm_eps == 1e-3
    assert "not kept" in caplog.text


def test_missing_directory_is_clear():
    with pytest.raises(FileNotFoundError, match="neither a local directory or GGUF file, a Hub id"):
        resolve_model("/no/such/model")


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="a file but not a .gguf file"):
        resolve_model(str(f))


def test_unknown_architecture_is_named(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        resolve_model(str(d))


def test_missing_tensor_names_file_and_tensor(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.qkv_proj"):
        LLM(str(d), enforce_eager=True, max_model_len=128)


def test_mismatched_tensor_names_file_and_tensor(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, d / "model.safetensors")
    expected = r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(3, 3\)"
    with pytest.raises(WeightLoadError, match=expected):
        LLM(str(d), enforce_eager=True, max_model_len=128)


def test_unexpected_tensor_is_named(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match="extra.weight"):
        LLM(str(d), enforce_eager=True, max_model_len=128)


def test_no_weights(tiny_llama_dir, tmp_path):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no weights Kiln reads"):
        LLM(str(d), enforce_eager=True, max_model_len=128)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_load(tiny_llama_dir, dtype):
    llm = LLM(str(tiny_llama_dir), dtype=dtype, enforce_eager=True, max_model_len=128)
    assert next(llm.engine.executor.model.parameters()).dtype == getattr(torch, dtype)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_preset_runs_with_dummy_weights():
    llm = LLM("qwen3-0.6b", enforce_eager=True, max_model_len=64, num_kv_blocks=16)
    assert llm.uses_dummy_weights
    config = llm.engine.model_config
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.qk_norm) == (28, 1024, 8, True)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def _edited(src, dst, **fields):
    d = copy_dir(src, dst)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **fields}))
    return d


def test_a_sliding_window_caps_the_context_of_a_backend_without_windows(
    tiny_mistral_dir, tiny_llama_dir, tmp_path, monkeypatch
):
    """A backend that attends to the whole context computes a sliding window's attention only up to the window:
    there a windowed model runs at most that long, and asking for more is refused, never silently wrong. Kiln's two
    backends have windows (test_sliding_window.py); one is made to lack them here."""
    from kiln.backends.attention.triton_backend import TritonAttentionBackend  # noqa: PLC0415

    mistral = _edited(tiny_mistral_dir, tmp_path / "mistral", sliding_window=16)
    config = resolve_model(str(mistral)).model_config
    assert (config.sliding_window, config.sliding_layers, config.max_context) == (16, (0, 1), 512)
    with LLM(str(mistral), enforce_eager=True, attention_backend="triton") as llm:
        assert llm.engine.max_model_len == 512
    monkeypatch.setattr(TritonAttentionBackend, "sliding_window", False)
    with pytest.raises(ValueError, match="sliding window of 16 tokens: the triton attention backend"):
        LLM(str(mistral), enforce_eager=True, max_model_len=32, attention_backend="triton")
    with LLM(str(mistral), enforce_eager=True, attention_backend="triton") as llm:
        assert llm.engine.max_model_len == 16
    # Qwen2 slides only where transformers marks the layers so: from layer max_window_layers on
    for layers, sliding in ((2, ()), (0, (0, 1))):  # (2 of 2 layers: none slides)
        qwen = _edited(
            tiny_llama_dir,
            tmp_path / f"qwen{layers}",
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=layers,
        )
        assert resolve_model(str(qwen)).model_config.sliding_layers == sliding, layers


def test_what_the_mlp_cannot_do_is_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        resolve_model(str(_edited(tiny_llama_dir, tmp_path / "relu", hidden_act="relu")))
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        resolve_model(str(_edited(tiny_llama_dir, tmp_path / "bias", mlp_bias=True)))


def test_a_linear_ropes_factor_stretches_the_context(tiny_llama_dir, tmp_path):
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    d = _edited(
        tiny_llama_dir, tmp_path / "linear", max_position_embeddings=32, rope_parameters=rope, rope_scaling=rope
    )
    assert resolve_model(str(d)).model_config.max_context == 128


def test_a_missing_tokenizer_fails_before_the_model_loads(tiny_llama_dir, tmp_path, monkeypatch):
    d = copy_dir(tiny_llama_dir, tmp_path / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    import kiln.engine.llm as llm_module  # noqa: PLC0415

    monkeypatch.setattr(llm_module, "EngineCore", lambda config: pytest.fail("the engine started"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer_config.json"):
        LLM(str(d), enforce_eager=True)


def test_generation_config_sets_the_sampling_defaults(tiny_llama_dir, tmp_path, monkeypatch):
    """As vLLM's --generation-config auto: the file's temperature, top_p, top_k, min_p and repetition_penalty
    (where they differ from transformers' own defaults) are what a request without them samples with."""
    from kiln.engine.models.model_dir import generation_defaults  # noqa: PLC0415

    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.0, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.0})
    )
    assert generation_defaults(d) == {"temperature": 0.0, "top_p": 0.95}  # top_k 50: transformers' default
    llm = LLM(str(d), enforce_eager=True, max_model_len=64)
    assert llm.get_default_sampling_params().temperature == 0.0
    prompts = [[5, 6, 7], [8, 9]]
    default = llm.generate(prompts, use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in default] == [o.outputs[0].token_ids for o in greedy]
    llm.close()
    assert LLM(str(d), enforce_eager=True, max_model_len=64, generation_config="vllm").sampling_defaults == {}
    (d / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        generation_defaults(d)
    import kiln.engine.llm as llm_module  # noqa: PLC0415

    with monkeypatch.context() as m:  # refused before the model is loaded
        m.setattr(llm_module, "EngineCore", lambda config: pytest.fail("the engine started"))
        with pytest.raises(ValueError, match="generation_config.json: temperature"):
            LLM(str(d), enforce_eager=True)


_CT_FP8 = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}


def _compressed(weights: dict, activations: dict | None = None, fmt: str = "float-quantized") -> dict:
    group = {"targets": ["Linear"], "weights": {**_CT_FP8, **weights}, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, "ignore": []}


@pytest.mark.parametrize(
    "quantization,named",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes'"),
        ({"quant_method": "made-up"}, "'made-up'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
        (_compressed({"strategy": "channel"}, fmt="pack-quantized"), "format 'pack-quantized'"),
        (_compressed({"strategy": "channel", "type": "int"}), "weights of type 'int', 8 bits"),
        (_compressed({"strategy": "group", "group_size": 128}), "weight strategy 'group'"),
        (_compressed({"strategy": "channel"}, {**_CT_FP8, "strategy": "channel"}), "strategy 'channel' (static)"),
        ({**_compressed({"strategy": "tensor"}), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({**_compressed({"strategy": "tensor"}), "config_groups": {}}, "0 compressed-tensors config groups"),
    ],
)
def test_an_unsupported_quantization_is_refused_in_one_line_naming_it(tiny_llama_dir, tmp_path, quantization, named):
    """AWQ, GPTQ, bitsandbytes, unknown methods and the FP8 variants Kiln does not read (other formats, strategies,
    scale types) are refused before any tensor is read, never loaded as garbage (the FP8 ones Kiln reads:
    test_fp8.py)."""
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=f"quantization_config.*{re.escape(named)}.*not supported"):
        resolve_model(str(d))


@pytest.mark.parametrize(
    "quantization,named",
    [({"quant_method": "awq", "bits": 4}, "'awq'"), (_compressed({"strategy": "group"}), "strategy 'group'")],
)
def test_the_cli_refuses_an_unsupported_quantization_in_one_line(tiny_llama_dir, tmp_path, quantization, named):
    d = copy_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    run = subprocess.run(
        [sys.executable, "-m", "kiln.engine.cli", "generate", str(d), "--max-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("kiln: error:")]
    assert named in line and "Traceback" not in run.stderr and run.returncode != 0
