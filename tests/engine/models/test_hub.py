"""Models by Hub id, fetched by huggingface_hub's own client from a local stand-in of the Hub (helpers/fake_hub.py,
reached through HF_ENDPOINT; nothing reaches the internet): what is downloaded (only the files Kiln reads), a revision,
a gated, private or missing repo, a missing revision, a repo without weights Kiln reads, the Hub unreachable or down,
and a start with HF_HUB_OFFLINE=1 from the cache the downloads filled; the models loaded from it give transformers'
greedy tokens (its `from_pretrained` of the files the Hub serves).

huggingface_hub reads its environment (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN) once, at import, so each client
is a child process started with its own: a short script that resolves model ids (`model_dir`, `tokenizer_dir`),
one that generates with `LLM`, or the `kiln` command line.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.fake_hub import FakeHub, Repo
from helpers.gguf_files import T, make_hf_model, write_gguf
from helpers.models import assert_greedy_matches_hf, make_tiny_model_dir

MODEL = "kiln-test/tiny-llama"  # main: sharded safetensors beside files Kiln does not read; v2: other weights
PT_ONLY = "kiln-test/tiny-llama-pt"  # pytorch_model.bin only
GGUFS = "kiln-test/tiny-llama-gguf"  # two GGUF files, no config
NO_WEIGHTS = "kiln-test/tf-only"  # tf_model.h5 only
GATED = "kiln-test/gated-llama"
PRIVATE = "kiln-test/private-llama"
MISSING = "kiln-test/no-such-model"
TOKEN = "hf_granted"  # the token that may read the gated and the private repo

# What Kiln reads of MODEL at main: configs, tokenizer files, the index and the shards it lists
MAIN_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
}
METADATA = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}

MAX_TOKENS = 8
TOL = 1e-3  # float32 on both sides: only the order of sums differs
PROMPTS = [[1, 17, 250, 33, 9, 101, 77, 5, 300, 2, 41, 42, 43], [500, 3, 3, 3, 64, 128, 256, 9]]

# Resolves each (function, kwargs) of argv[1]; one JSON line each: the directory, or the error's type and message.
RESOLVE = """
import json, sys
from kiln.engine.models.model_dir import model_dir
from kiln.engine.text.tokenizer import tokenizer_dir
for name, kwargs in json.loads(sys.argv[1]):
    try:
        print(json.dumps({"dir": str({"model_dir": model_dir, "tokenizer_dir": tokenizer_dir}[name](**kwargs))}))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""

# Greedy tokens and log-probabilities of argv[1]'s prompts for each LLM(**kwargs) of argv[2]; one JSON line each.
GENERATE = f"""
import json, sys
from kiln.engine import LLM, SamplingParams
params = SamplingParams(max_tokens={MAX_TOKENS}, temperature=0.0, logprobs=1, ignore_eos=True)
for kwargs in json.loads(sys.argv[2]):
    try:
        with LLM(**kwargs, enforce_eager=True, max_model_len=64, num_kv_blocks=16) as llm:
            outputs = llm.generate(json.loads(sys.argv[1]), params, use_tqdm=False)
    except Exception as e:
        print(json.dumps({{"error": type(e).__name__, "message": str(e)}}))
        continue
    completions = [o.outputs[0] for o in outputs]
    print(json.dumps([
        {{"token_ids": c.token_ids, "logprobs": [{{t: lp.logprob for t, lp in e.items()}} for e in c.logprobs]}}
        for c in completions
    ]))
"""


def _shard_in_two(folder: Path) -> None:
    """model.safetensors into two shards and their index, as transformers saves a large model."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, folder / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The repos' files, one local folder a branch."""
    root = tmp_path_factory.mktemp("hub-repos")
    main = make_tiny_model_dir(root / "main", "llama", seed=0)
    _shard_in_two(main)
    # beside the weights Kiln reads: a card, other frameworks' weights, the same weights again in Mistral's own
    # layout (consolidated.safetensors, which the index does not list), a training checkpoint in a subfolder
    (main / "README.md").write_text("# tiny llama\n")
    (main / "flax_model.msgpack").write_bytes(b"flax" * 64)
    (main / "pytorch_model.bin").write_bytes(b"pickle" * 64)
    (main / "consolidated.safetensors").write_bytes(b"mistral" * 64)
    (main / "checkpoint-100").mkdir()
    (main / "checkpoint-100" / "config.json").write_text("{}")
    (main / "checkpoint-100" / "model.safetensors").write_bytes(b"step 100" * 64)
    v2 = make_tiny_model_dir(root / "v2", "llama", seed=1)

    pt = make_tiny_model_dir(root / "pt", "llama", seed=2)
    from safetensors.torch import load_file

    torch.save(load_file(pt / "model.safetensors"), pt / "pytorch_model.bin")
    (pt / "model.safetensors").unlink()

    tf = root / "tf"
    shutil.copytree(v2, tf, ignore=shutil.ignore_patterns("*.safetensors"))
    (tf / "tf_model.h5").write_bytes(b"hdf5" * 64)

    ggufs = root / "ggufs"
    ggufs.mkdir()
    hf_for_gguf = make_hf_model(root / "gguf-hf", "llama")
    write_gguf(hf_for_gguf, ggufs / "tiny-F32.gguf", "llama", {}, T.F32)
    write_gguf(hf_for_gguf, ggufs / "tiny-Q8_0.gguf", "llama", {}, T.Q8_0)
    (ggufs / "README.md").write_text("# tiny llama, GGUF\n")
    return {"main": main, "v2": v2, "pt": pt, "tf": tf, "ggufs": ggufs}


@pytest.fixture(scope="module")
def hub(folders):
    repos = {
        MODEL: Repo({"main": folders["main"], "v2": folders["v2"]}),
        PT_ONLY: Repo({"main": folders["pt"]}),
        GGUFS: Repo({"main": folders["ggufs"]}),
        NO_WEIGHTS: Repo({"main": folders["tf"]}),
        GATED: Repo({"main": folders["v2"]}, gated=True, token=TOKEN),
        PRIVATE: Repo({"main": folders["v2"]}, private=True, token=TOKEN),
    }
    with FakeHub(repos) as hub:
        yield hub


def run(
    hub: FakeHub, hf_home: Path, args: list[str], endpoint: str | None = None, **env
) -> subprocess.CompletedProcess:
    environ = hub.client_env(hf_home, **env)
    if endpoint is not None:
        environ["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, *args], env=environ, capture_output=True, text=True, timeout=300)


def resolve(hub: FakeHub, hf_home: Path, calls: list, **env) -> list[dict]:
    done = run(hub, hf_home, ["-c", RESOLVE, json.dumps(calls)], **env)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def snapshot_files(path: str | Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """The cache the downloads of `generated` fill, which the offline start reads."""
    return tmp_path_factory.mktemp("hf-home")


# The Hub-loaded models `generated` runs: LLM's arguments, and the served folder transformers loads (with its own)
RUNS = {
    "main": ({"model": MODEL}, "main", {}),
    "v2": ({"model": MODEL, "revision": "v2"}, "v2", {}),
    "pt": ({"model": PT_ONLY}, "pt", {}),
    "gguf": ({"model": GGUFS, "gguf_file": "tiny-F32.gguf"}, "ggufs", {"gguf_file": "tiny-F32.gguf"}),
}


@pytest.fixture(scope="module")
def generated(hub, hf_home) -> dict[str, list | dict]:
    """Greedy outputs of each of RUNS, and of an LLM of a repo without weights Kiln reads, all loaded by Hub id (one
    process: the downloads fill `hf_home`)."""
    runs = [kwargs for kwargs, _, _ in RUNS.values()] + [{"model": NO_WEIGHTS}]
    done = run(hub, hf_home, ["-c", GENERATE, json.dumps(PROMPTS), json.dumps(runs)])
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return dict(zip([*RUNS, "no-weights"], lines, strict=True))


def as_outputs(result: list[dict]) -> list:
    """JSON outputs as the RequestOutputs `assert_greedy_matches_hf` reads."""
    return [
        SimpleNamespace(
            outputs=[
                SimpleNamespace(
                    token_ids=r["token_ids"],
                    logprobs=[{int(t): SimpleNamespace(logprob=lp) for t, lp in e.items()} for e in r["logprobs"]],
                )
            ]
        )
        for r in result
    ]


@pytest.mark.parametrize("run_name", list(RUNS))
def test_hub_model_greedy_tokens_equal_transformers(generated, folders, run_name):
    from transformers import AutoModelForCausalLM

    _, folder, hf_kwargs = RUNS[run_name]
    hf = AutoModelForCausalLM.from_pretrained(str(folders[folder]), dtype=torch.float32, **hf_kwargs).eval()
    assert isinstance(generated[run_name], list), generated[run_name]
    assert_greedy_matches_hf(hf, PROMPTS, as_outputs(generated[run_name]), MAX_TOKENS, TOL)


def test_revision_matters(generated):
    main, v2 = ([o["token_ids"] for o in generated[name]] for name in ("main", "v2"))
    assert main != v2  # (the branches' weights differ, so must their tokens)


def test_download_fetches_only_what_kiln_reads(generated, hub, hf_home, folders):
    repo = hf_home / "hub" / "models--kiln-test--tiny-llama"
    main_sha, v2_sha = hub.commit_sha(MODEL, "main"), hub.commit_sha(MODEL, "v2")
    assert (repo / "refs" / "main").read_text() == main_sha and (repo / "refs" / "v2").read_text() == v2_sha
    assert snapshot_files(repo / "snapshots" / main_sha) == MAIN_FILES
    assert snapshot_files(repo / "snapshots" / v2_sha) == METADATA | {"model.safetensors"}
    # and no bytes of the rest: the blobs are those of the snapshots' files
    linked = {p.resolve() for p in (repo / "snapshots").rglob("*") if p.is_file()}
    assert set((repo / "blobs").iterdir()) == linked
    v2_weights = repo / "snapshots" / v2_sha / "model.safetensors"
    assert v2_weights.read_bytes() == (folders["v2"] / "model.safetensors").read_bytes()
    pt = hf_home / "hub" / "models--kiln-test--tiny-llama-pt" / "snapshots" / hub.commit_sha(PT_ONLY)
    assert snapshot_files(pt) == METADATA | {"pytorch_model.bin"}
    ggufs = hf_home / "hub" / "models--kiln-test--tiny-llama-gguf" / "snapshots" / hub.commit_sha(GGUFS)
    assert snapshot_files(ggufs) == {"tiny-F32.gguf"}
    # (the tree listing came in pages, as the Hub sends it)
    trees = [path for _, path in hub.requests if path.startswith(f"/api/models/{MODEL}/tree/")]
    assert len(trees) > 1


def test_repo_without_weights_kiln_reads_is_refused_in_one_line(generated):
    error = generated["no-weights"]
    assert error["error"] == "HubError" and "\n" not in error["message"]
    assert error["message"] == f"{NO_WEIGHTS} has no weights Kiln reads (*.safetensors, or pytorch_model*.bin)"


def test_errors_are_one_line_each(hub, tmp_path):
    calls = [
        ("model_dir", {"model": GATED}),
        ("model_dir", {"model": PRIVATE}),
        ("model_dir", {"model": MISSING}),
        ("model_dir", {"model": MODEL, "revision": "no-such-branch"}),
        ("model_dir", {"model": GGUFS}),
        ("model_dir", {"model": GGUFS, "gguf_file": "tiny-Q2_K.gguf"}),
    ]
    answers = resolve(hub, tmp_path, calls)
    assert all(r.get("error") == "HubError" and "\n" not in r["message"] for r in answers), answers
    gated, private, missing, revision, no_gguf_file, wrong_gguf_file = answers
    assert "gated or private" in gated["message"] and "HF_TOKEN" in gated["message"]
    # (a private repo is answered as a missing one, so that its name is not disclosed)
    for answer, repo in ((private, PRIVATE), (missing, MISSING)):
        assert answer["message"].startswith(f"{repo} is not a model repo on {hub.endpoint}")
        assert "HF_TOKEN" in answer["message"]
    assert revision["message"] == f"{MODEL} has no revision 'no-such-branch' (a branch, tag or commit of the repo)"
    assert "pick one with --gguf-file (e.g. tiny-F32.gguf)" in no_gguf_file["message"]
    assert wrong_gguf_file["message"] == f"{GGUFS} has no file 'tiny-Q2_K.gguf' (--gguf-file)"
    # the gated repo asked with a token it does not grant (403), then with one it does
    (wrong_token,) = resolve(hub, tmp_path, calls[:1], token="hf_not_granted")
    assert wrong_token["error"] == "HubError" and "gated or private" in wrong_token["message"]
    granted, private_granted = resolve(hub, tmp_path, calls[:2], token=TOKEN)
    assert snapshot_files(granted["dir"]) == METADATA | {"model.safetensors"}
    assert snapshot_files(private_granted["dir"]) == METADATA | {"model.safetensors"}


def test_kiln_generate_error_is_one_line(hub, tmp_path):
    done = run(hub, tmp_path, ["-m", "kiln.engine.cli", "generate", GATED, "--max-tokens", "1", "--enforce-eager"])
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith(f"kiln: error: {GATED} is gated or private") and "HF_TOKEN" in errors[0]


def test_tokenizer_from_the_hub_fetches_only_tokenizer_and_config_files(hub, tmp_path, folders):
    (answer,) = resolve(hub, tmp_path, [("tokenizer_dir", {"model": str(folders["v2"]), "tokenizer": MODEL})])
    assert Path(answer["dir"]).name == hub.commit_sha(MODEL)
    assert snapshot_files(answer["dir"]) == METADATA | {"model.safetensors.index.json"}


def test_download_dir_and_a_commit_as_revision(hub, tmp_path):
    v2_sha = hub.commit_sha(MODEL, "v2")
    download_dir = tmp_path / "models"
    (answer,) = resolve(
        hub, tmp_path, [("model_dir", {"model": MODEL, "revision": v2_sha, "download_dir": str(download_dir)})]
    )
    assert Path(answer["dir"]) == download_dir / "models--kiln-test--tiny-llama" / "snapshots" / v2_sha
    assert snapshot_files(answer["dir"]) == METADATA | {"model.safetensors"}
    assert not (tmp_path / "hub").exists()  # (not in HF_HUB_CACHE)


def closed_port_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_not_cached_and_offline_or_unreachable_is_one_line(hub, tmp_path):
    (offline,) = resolve(hub, tmp_path, [("model_dir", {"model": MODEL})], offline=True)
    assert offline["error"] == "HubError" and "\n" not in offline["message"]
    assert offline["message"].startswith(f"{MODEL} is not in the Hub cache and HF_HUB_OFFLINE is set")
    unreachable = closed_port_endpoint()
    (cut_off,) = resolve(hub, tmp_path, [("model_dir", {"model": MODEL})], endpoint=unreachable)
    assert cut_off["error"] == "HubError" and "\n" not in cut_off["message"]
    assert cut_off["message"].startswith(f"{MODEL} is not in the Hub cache and {unreachable} cannot be reached")


def test_cached_model_resolves_without_the_hub(generated, hub, hf_home):
    calls = [("model_dir", {"model": MODEL}), ("model_dir", {"model": MODEL, "revision": "v2"})]
    snapshots = [
        str(hf_home / "hub" / "models--kiln-test--tiny-llama" / "snapshots" / hub.commit_sha(MODEL, rev))
        for rev in ("main", "v2")
    ]
    seen = len(hub.requests)
    for env in ({"offline": True}, {"endpoint": closed_port_endpoint()}):
        assert [r.get("dir") for r in resolve(hub, hf_home, calls, **env)] == snapshots, env
    assert len(hub.requests) == seen
    # the Hub answering 503 (an outage) is no reason to refuse what the cache holds
    hub.outage = 503
    try:
        assert [r.get("dir") for r in resolve(hub, hf_home, calls)] == snapshots
    finally:
        hub.outage = None


def test_kiln_generate_starts_offline_from_the_cache(generated, hub, hf_home):
    seen = len(hub.requests)
    args = ["-m", "kiln.engine.cli", "generate", MODEL, "--revision", "v2", "--tokenizer", MODEL]
    args += ["--max-tokens", "4", "--enforce-eager", "--max-model-len", "64", "--num-kv-blocks", "16"]
    done = run(hub, hf_home, args, offline=True)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout and "DUMMY" not in done.stdout
    assert len(hub.requests) == seen  # (nothing asked of the Hub)
