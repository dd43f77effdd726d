"""bench_spec.py, speculative decoding's engine-side benchmark, on the CPU: its oracle drafter keeps draft tokens by the
law it claims (against the geometric law's closed form), and gpu_check's spec step runs it end to end on a tiny model,
its table and JSON rows checked: every step-cost point timed with exactly k drafts verified, each end-to-end target's
measured mean accepted length near the target, and greedy outputs with drafts equal to those without (in bf16 too,
with the weights made decisive); `--disable-by-batch-size` leaves large batches undrafted end to end."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"


@pytest.fixture(scope="module")
def bench_spec():
    return runpy.run_path(str(BENCH / "bench_spec.py"), run_name="bench_spec")


@pytest.mark.parametrize("target", [1.0, 1.5, 2.0, 3.0, 4.0])
def test_the_oracle_keeps_drafts_by_the_geometric_law(bench_spec, target):
    """Each draft token kept with probability q given those before it were: j of k kept with q^j (1 - q) (j < k),
    all k with q^k; the mean accepted length 1 + q + ... + q^k is the target."""
    k, calls, vocab = 4, 4000, 100
    q = bench_spec["keep_for"](target, k)
    assert 1 + sum(q**i for i in range(1, k + 1)) == pytest.approx(target, abs=1e-9)
    prompt = list(range(8))
    continuation = [(7 * i) % 90 + 1 for i in range(calls + k)]
    oracle = bench_spec["OracleDrafter"](k, {tuple(prompt): continuation}, q, vocab)
    kept = Counter()
    for done in range(calls):
        draft = oracle.propose(prompt + continuation[:done], k)
        want = continuation[done : done + k]
        assert len(draft) == k
        j = next((i for i, (a, b) in enumerate(zip(draft, want)) if a != b), k)
        assert draft[j + 1 :] == want[j + 1 :]  # (only the first corrupted token is written)
        kept[j] += 1
    law = [q**j * (1 - q) for j in range(k)] + [q**k]
    for j in range(k + 1):
        assert kept[j] / calls == pytest.approx(law[j], abs=0.01)
    assert 1 + sum(j * n for j, n in kept.items()) / calls == pytest.approx(target, abs=0.01)
    # a shorter limit (a request near its max_tokens) proposes fewer
    assert len(oracle.propose(prompt, 2)) == 2 and oracle.propose(prompt + continuation, 4) == []


def test_unreachable_targets_are_refused(bench_spec):
    with pytest.raises(ValueError, match="out of reach"):
        bench_spec["keep_for"](4.5, 3)
    assert bench_spec["keep_for"](4.0, 3) == pytest.approx(1.0)


def test_gpu_check_spec_step_on_a_tiny_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python3: this one
    env["SPEC_ARGS"] = (
        "--enforce-eager --batches 1,4 --k 1,3 --steps 4 --e2e-batches 1,3 --e2e-k 4 --max-tokens 64 --repeats 1"
    )
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), f"spec:{tiny_llama_dir}"],
        cwd=BENCH.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with tarfile.open(out / "logs.tgz") as logs:
        logs.extractall(tmp_path / "logs", filter="data")
    [path] = (tmp_path / "logs").glob("spec_*.json")
    result = json.loads(path.read_text())
    summary = (out / "summary.txt").read_text()

    # step cost: speculation off, a drafter proposing nothing, then 1 and 3 drafts verified by every request, drafted on
    # the device (async scheduling on) and on the host
    steps = result["step"]
    points = [("host", "none"), ("host", 0), *((d, k) for d in ("device", "host") for k in (1, 3))]
    assert [(r["batch"], r["drafter"], r["drafts"]) for r in steps] == [(b, *point) for b in (1, 4) for point in points]
    for r in steps:
        assert r["step_ms"] > 0 and r["preemptions"] == 0
        assert r["query_tokens"] == r["batch"] * (1 + (0 if r["drafts"] == "none" else r["drafts"]))
        assert r["drafts_kept"] <= 1  # (blind drafts: a random model keeps one about once in its vocabulary)
    table = summary[summary.index("step cost:") :].splitlines()
    assert [line.split()[:4] for line in table[2:14]] == [
        [str(r["batch"]), r["drafter"], str(r["drafts"]), str(r["query_tokens"])] for r in steps
    ]
    assert [line.split()[5] for line in table[2:14:6]] == ["1.00", "1.00"]  # (each batch's plain step: 1x itself)

    # end to end: without drafts, then each target with each drafter; the mean accepted length measured near it (the
    # device's drafts read from where the device says each request's kept tokens end), every request's tokens equal
    # to the run without drafts, acceptance rising with the target
    e2e = result["end_to_end"]
    want = [row for b in (1, 3) for row in want_of(b, (1, 1.5, 2, 3, 4))]
    assert [(r["batch"], r.get("drafter"), r["target"]) for r in e2e] == want
    for r in e2e:
        assert r["same"] == r["batch"] and r["tokens_per_s"] > 0
        assert r["mean_accepted"] == pytest.approx(r["target"] or 1.0, abs=0.25)
    for batch in (1, 3):
        for drafter in ("device", "host"):
            with_drafts = [r for r in e2e if r["batch"] == batch and r.get("drafter") == drafter]
            assert with_drafts[0]["acceptance"] == 0 and with_drafts[0]["corrupt"] == pytest.approx(1)
            assert all(a["acceptance"] < b["acceptance"] for a, b in zip(with_drafts, with_drafts[1:]))
    table = summary[summary.index("end to end: greedy") :].splitlines()
    rows = [line.split() for line in table[2:24]]
    assert [tuple(row[:3]) for row in rows] == [
        (str(r["batch"]), r.get("drafter", "-"), "none" if r["target"] is None else f"{r['target']:g}") for r in e2e
    ]
    assert all(row[-4] == f"{row[0]}/{row[0]}" for row in rows)  # (same as without drafts: every request)
    # no full graphs on the CPU: the runs without drafts have none to count, those with drafts replayed none
    assert [row[-3] for row in rows] == ["-" if row[2] == "none" else "0%" for row in rows]
    # where a step's time went: the host's part and its wait for the device, as the engine's step timing has them
    assert [row[-2:] for row in rows] == [[f"{r['host_ms']:.3f}", f"{r['wait_ms']:.3f}"] for r in e2e]
    assert all(r["host_ms"] > 0 and r["wait_ms"] >= 0 for r in e2e)


def want_of(batch: int, targets: tuple) -> list[tuple]:
    """The end-to-end rows of a batch: the run without drafts, then each drafter's targets."""
    return [(batch, None, None), *((batch, d, t) for d in ("device", "host") for t in targets)]


def test_decisive_weights_keep_bf16_greedy_exact(tiny_llama_dir, tmp_path):
    """In bf16, near-tied logits of random weights let a verification step take another token than a one-row step;
    with --decisive on each request's tokens with drafts equal those without and the targets are hit."""
    out = tmp_path / "spec.json"
    args = "--enforce-eager --dtype bfloat16 --decisive on --batches 1 --k 2 --steps 2 --e2e-batches 2 --max-tokens 48"
    args = ["--model", str(tiny_llama_dir), *args.split(), "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_spec.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert "bfloat16" in result["header"] and "greedy made decisive" in result["header"]
    for r in result["end_to_end"]:
        assert r["same"] == 2
        assert r["mean_accepted"] == pytest.approx(r["target"] or 1.0, abs=0.25)


def test_step_cost_of_the_engines_device_ngram_lookup(tiny_llama_dir, tmp_path):
    """`--drafters ngram`: step-cost rows of DeviceNgramProposer itself, every request verifying k tokens a step (the
    decisive model repeats its input token: matches found, fillers after them, all kept; the kept count is the real
    drafts', one a step), and no end-to-end rows for it; a drafter it does not know is one error."""
    json_path = tmp_path / "spec.json"
    args = ["--model", str(tiny_llama_dir), "--enforce-eager", "--batches", "2", "--k", "2", "--steps", "4"]
    args += ["--repeats", "1", "--e2e-batches", "", "--drafters", "ngram", "--decisive", "on", "--json", str(json_path)]
    run = [sys.executable, str(BENCH / "bench_spec.py")]
    done = subprocess.run([*run, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(json_path.read_text())
    steps = result["step"]
    assert [(r["drafter"], r["drafts"], r["query_tokens"]) for r in steps] == [
        ("host", "none", 2),
        ("host", 0, 2),
        ("ngram", 2, 6),
    ]
    assert steps[-1]["drafts_kept"] == 2 * 4 and result["end_to_end"] == []
    wrong = subprocess.run([*run, *args[:-2], "--drafters", "gpu"], capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "--drafters: device, host or ngram" in wrong.stderr


def test_disable_by_batch_size_leaves_large_batches_undrafted(tiny_llama_dir, tmp_path):
    """`--disable-by-batch-size 2`: end to end, a batch of 2 drafts nothing (mean accepted 1, none drafted) and one
    request alone drafts as aimed; the step-cost rows still verify every request's k drafts at batch 2."""
    json_path = tmp_path / "spec.json"
    args = ["--model", str(tiny_llama_dir), "--enforce-eager", "--batches", "2", "--k", "2", "--steps", "2"]
    args += ["--repeats", "1", "--e2e-batches", "1,2", "--e2e-k", "2", "--targets", "3", "--max-tokens", "24"]
    args += ["--disable-by-batch-size", "2", "--json", str(json_path)]
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_spec.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(json_path.read_text())
    assert "disable_by_batch_size 2" in result["header"]
    # (the step-cost rows verified every request's drafts at batch 2: step_ms asserts it, the exit code above)
    drafted = [r for r in result["end_to_end"] if r["target"] is not None]
    assert [(r["batch"], r["drafter"]) for r in drafted] == [(1, "device"), (1, "host"), (2, "device"), (2, "host")]
    for r in drafted:
        assert r["same"] == r["batch"]
        if r["batch"] == 2:
            assert r["mean_accepted"] == 1.0 and r["acceptance"] == 0.0
        else:
            assert r["mean_accepted"] == pytest.approx(3, abs=0.25)
