"""Speculative decoding, the engine's side, on any model (random weights welcome): what a verification step costs, and
what tokens/s drafts of a known quality buy.

Random weights give no real acceptance, so no real drafter is run here. Two drafters stand in, installed as the
scheduler's (`llm.engine.scheduler.drafter`: `propose(token_ids, limit) -> list[int]`); neither belongs in the product:

- step cost: `BlindDrafter` proposes k tokens every step, which the model all but never keeps, so every step of B
  decoding requests verifies exactly B * k drafts (1 + k query tokens a request) and the context grows one token a
  step, as in the plain decode step it is timed against (a verdict does not change what a verification costs). Rows:
  `none` is the plain step with speculation off (asynchronous scheduling as configured), `0` a drafter that proposes
  nothing (the synchronous step a step with drafts is today), `1`..`k` the verification steps. A step of ratio r
  pays for itself once the mean accepted length (tokens a request gains a step) passes r.
- end to end: a greedy run without drafts gives each prompt's continuation; `OracleDrafter` then proposes it, each
  draft token corrupted with the chance that makes the expected mean accepted length the target (1.5, 2, 3, 4; 1:
  every draft rejected, the overhead alone). Measured: tokens/s (whole greedy runs, median of `--repeats`), the mean
  accepted length from the scheduler's counters (1 + drafts kept / steps that verified drafts), the speedup over the
  run without drafts, and whether every request's tokens equal that run's (greedy is exact).

Each drafter runs on the host (`propose(token_ids, limit)`, as n-gram drafts are made without a GPU: a step with
drafts waits for the one before it) and on the device (`DeviceDrafter`, as EAGLE-3's, MTP's and n-gram's on a GPU:
async scheduling stays on while drafting), `--drafters device,host`; the `drafter` column says which. `ngram` adds
step-cost rows of the engine's own device n-gram lookup (`DeviceNgramProposer`, prompt_lookup 1-4) in the blind
drafter's place: its k drafts a step cost what the device drafter's do, plus the lookup (its acceptance is the
decisive model's, which repeats its input token: not a workload's, so it has no end-to-end rows).

`--disable-by-batch-size N` sets speculative_config's `disable_by_batch_size`: end-to-end runs of N requests or more
draft nothing (the device stand-in makes no drafts then, as EAGLE-3's proposer runs no chain), what a user who sets it
gets, while the step-cost rows still time verification at every batch.

With dummy weights the greedy choice is first made decisive (`--decisive`, `make_greedy_decisive`): their near-flat
logits would otherwise let a verification step and a one-row step round to different tokens in bf16.

    python scripts/bench/bench_spec.py --model llama-3.1-8b                       # compiled, CUDA graphs
    python scripts/bench/bench_spec.py --model qwen3-0.6b --enforce-eager --batches 1,8 --e2e-batches 1 \\
        --max-tokens 64 --steps 8 --repeats 1                                     # a quick CPU run
    python scripts/bench/bench_spec.py --model DIR --load-format safetensors      # a checkpoint's own weights

`--json PATH` writes the rows of both tables. Exits 1 after the tables when some outputs with drafts differ from the
run without them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from kiln.compile import default_capture_sizes
from kiln.engine import LLM, SamplingParams
from kiln.engine.spec_decode.eagle_proposer import next_position_shift
from kiln.engine.spec_decode.ngram_device import DeviceNgramProposer
from kiln.engine.worker.sampler import to_device

PROMPT_LEN = 32
GOLDEN = (5**0.5 - 1) / 2


class BlindDrafter:
    """Proposes `k` tokens after every token (the last one's successors in the vocabulary): a verification's full cost,
    with drafts a model keeps about once in its vocabulary's size."""

    def __init__(self, k: int, vocab_size: int) -> None:
        self.k, self.vocab_size = k, vocab_size

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        return [(token_ids[-1] + 1 + i) % self.vocab_size for i in range(min(self.k, limit))]


class GoldenPhase:
    """Which draft a stand-in corrupts: the first past those that survive, by the next point of a golden-ratio
    sequence instead of a random draw, so the kept lengths' mean reaches its target within a few dozen steps rather
    than a few thousand."""

    keep: float
    phase: float = 0.0

    def survivors(self, n: int) -> int:
        """How many of n drafts survive before the first corrupted one."""
        self.phase = (self.phase + GOLDEN) % 1.0
        # draft token i (from 1) survives when u < keep^i: P(the first i survive) = keep^i, as with independent draws
        return sum(self.phase < self.keep ** (i + 1) for i in range(n))


class OracleDrafter(GoldenPhase):
    """Proposes each request's continuation from a greedy run without drafts (found by its first `prompt_len`
    tokens), up to `k` tokens, each kept with probability `keep` given that those before it were, else corrupted.

    Only a draft's first corrupted token is written (GoldenPhase): verification keeps nothing after it anyway."""

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]], keep: float, vocab_size: int) -> None:
        self.k, self.continuations, self.keep, self.vocab_size = k, continuations, keep, vocab_size
        self.prompt_len = len(next(iter(continuations)))

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        continuation = self.continuations[tuple(token_ids[: self.prompt_len])]
        done = len(token_ids) - self.prompt_len
        draft = continuation[done : done + min(self.k, limit)]
        kept = self.survivors(len(draft))
        if kept < len(draft):
            draft[kept] = (draft[kept] + 1) % self.vocab_size
        return draft


class DeviceDrafter(GoldenPhase):
    """The two drafters above on the device, as EAGLE-3's proposer runs (`EagleProposer`'s interface): right after a
    step's sampling each decoding request's drafts are left there, read from where its kept tokens end, which only
    the device knows yet, so the engine schedules the next step without waiting for the verdict (async scheduling
    while drafting). `continuations`: None for the blind drafter (its input token's successors), else each request's
    prompt and greedy continuation, whose first corrupted draft (if any) the same golden-ratio phase picks.
    Past disable_by_batch_size (the step's `drafting`) it makes none, as `EagleProposer`."""

    drafts_after_step = True

    def __init__(self, k: int, vocab_size: int, continuations=None, keep: float = 1.0) -> None:
        self.k, self.vocab_size, self.keep = k, vocab_size, keep
        self.drafts, self.draft_rows = None, {}
        self.table, self.row_of = None, {}
        if continuations is not None:  # (a row a request: its prompt, then the continuation)
            rows = [[*prompt, *tokens, *[0] * (k + 1)] for prompt, tokens in continuations.items()]
            self.table = torch.tensor(rows, dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
            self.row_of = {prompt: i for i, prompt in enumerate(continuations)}
            self.prompt_len = len(next(iter(continuations)))

    @property
    def device_drafts(self):
        return None if self.drafts is None else (self.drafts, self.draft_rows)

    def has_drafts(self, request_id: str) -> bool:
        return request_id in self.draft_rows

    def propose(self, batch, sample_rows, step, shift) -> None:
        self.drafts, self.draft_rows = None, {}
        if step is None:
            return
        if not batch.drafting:  # (the scheduler drafts nothing at that size)
            return
        device = step.next_ids.device
        offsets = torch.arange(1, self.k + 1, device=device)
        if self.table is None:
            self.drafts = (step.next_ids[:, None] + offsets) % self.vocab_size
        else:
            # each next input token's position: after the step's, back by its shift and its rejected drafts; the
            # first corrupted draft from the host's phase, as OracleDrafter's (one pinned copy: no wait on the device)
            ends = [batch.num_computed_tokens[i] + batch.num_new_tokens[i] for i in sample_rows]
            rows = [self.row_of[tuple(batch.requests[i].prompt_token_ids[: self.prompt_len])] for i in sample_rows]
            corrupt = [self.survivors(self.k) for _ in sample_rows]
            position, table_rows, corrupt = to_device([ends, rows, corrupt], torch.int64, device).unbind()
            correction = next_position_shift(sample_rows, step, shift)
            if correction is not None:
                position = position + correction
            at = (position[:, None] + offsets).clamp(max=self.table.shape[1] - 1)
            drafts = self.table[table_rows[:, None], at]
            first_corrupt = offsets[None, :] == corrupt[:, None] + 1
            self.drafts = torch.where(first_corrupt, (drafts + 1) % self.vocab_size, drafts)
        self.draft_rows = {batch.requests[i].request_id: j for j, i in enumerate(sample_rows)}


def install(llm: LLM, drafter) -> None:
    """Make `drafter` the engine's (None: speculation off); one on the device runs after each step, and the scheduler
    schedules ahead of its verdicts where the engine can (as with EAGLE-3)."""
    engine = llm.engine
    engine.scheduler.drafter = drafter
    on_device = getattr(drafter, "drafts_after_step", False)
    engine.runner.drafter = drafter if on_device else None
    engine.scheduler.optimistic = on_device and engine.async_scheduling and engine.runner.shifts_positions


def make_greedy_decisive(llm: LLM) -> None:
    """Dummy weights (std 0.02) give near-flat logits: the top two of 128k lie within bf16's rounding, so a verification
    step of 1 + k rows and a one-row step round them differently and take different tokens (on an H100, within a few
    tokens), and no continuation stays the model's own. Here each step's greedy token becomes its input token, by a
    wide margin: the input embedding, scaled up, outweighs what the layers add to the residual stream, and the LM head
    reads the same rows. Values only: a dense model's step costs the same (a mixture of experts' routing follows the
    token; rank 0's weights only, no tensor parallelism)."""
    model = llm.engine.executor.model
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        if head is not embed:
            head.copy_(embed)
        # each random layer adds a norm of tens to the residual; an embedding row's is about 1
        embed.mul_(1e4)


def expected_mean_accepted(keep: float, k: int) -> float:
    """1 + the expected drafts kept of k, each kept with probability `keep` given the ones before it were."""
    return 1 + sum(keep**i for i in range(1, k + 1))


def keep_for(target: float, k: int) -> float:
    """The per-token keep probability whose expected mean accepted length with k drafts is `target` (bisection)."""
    if not 1 <= target <= 1 + k:
        raise ValueError(f"a mean accepted length of {target} is out of reach with {k} drafts (1 to {1 + k})")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_mean_accepted(mid, k) < target else (low, mid)
    return (low + high) / 2


def make_prompts(batch: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`batch` distinct random prompts of PROMPT_LEN tokens (distinct: a drafter tells requests apart by them)."""
    rng = random.Random(seed)
    prompts: dict[tuple[int, ...], None] = {}
    while len(prompts) < batch:
        prompts[tuple(rng.randrange(1, min(vocab_size, 10000)) for _ in range(PROMPT_LEN))] = None
    return [list(p) for p in prompts]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def full_verifications(llm: LLM) -> int:
    """Steps that verified drafts in a full CUDA graph (the runner's counter; 0 where the runner is in another
    process, as with tensor parallelism)."""
    runner = getattr(llm.engine, "runner", None)
    return getattr(runner, "full_verifications", 0)


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    scheduler = llm.engine.scheduler
    return scheduler.num_spec_steps, scheduler.num_draft_tokens, scheduler.num_accepted_tokens


def step_ms(llm: LLM, batch: int, drafts: int | None, steps: int, repeats: int, kind: str, warmup: int = 4) -> dict:
    """A decode step of `batch` requests each verifying `drafts` drafts (None: speculation off), median of `repeats`
    windows of `steps` steps; `kind`: the drafter's (device: DeviceDrafter, host: BlindDrafter, ngram: the engine's
    DeviceNgramProposer)."""
    engine = llm.engine
    vocab_size = engine.model_config.vocab_size
    # a verification's cost is timed at every batch, whatever disable_by_batch_size says
    draft_below, engine.scheduler.draft_below = engine.scheduler.draft_below, None
    drafter = None
    if drafts and kind == "ngram":
        drafter = DeviceNgramProposer(drafts, 1, 4, engine.runner)
    elif drafts is not None:
        drafter = DeviceDrafter(drafts, vocab_size) if kind == "device" and drafts else BlindDrafter(drafts, vocab_size)
    install(llm, drafter)
    # room for every step's drafts, were they all kept (the drafter proposes fewer once a request nears max_tokens)
    max_tokens = (warmup + steps * repeats + 2) * (1 + (drafts or 0)) + 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch, vocab_size, seed=batch)):
        engine.add_request(f"step-{batch}-{drafts}-{i}", prompt, params)
    while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
        engine.step()  # the prefills
    for _ in range(warmup):
        engine.step()
    before, preemptions, times = spec_counters(llm), engine.scheduler.num_preemptions, []
    full_before = full_verifications(llm)
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        times.append((time.perf_counter() - start) / steps)
    spec_steps, drafted, kept = (now - then for now, then in zip(spec_counters(llm), before))
    full = full_verifications(llm) - full_before
    engine.abort_requests(list(engine.scheduler.requests))
    while engine.has_unfinished_requests():
        engine.step()
    install(llm, None)
    engine.scheduler.draft_below = draft_below
    if drafts and kind != "ngram":  # every timed step verified `drafts` drafts of every request
        assert spec_steps == batch * steps * repeats and drafted == spec_steps * drafts, (spec_steps, drafted)
    return {
        "batch": batch,
        "drafter": kind if drafts else "host",
        "drafts": "none" if drafts is None else drafts,
        "query_tokens": batch * (1 + (drafts or 0)),
        "step_ms": statistics.median(times) * 1e3,
        "drafts_kept": kept,
        "full_graph_share": full / (steps * repeats),
        "preemptions": engine.scheduler.num_preemptions - preemptions,
    }


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def timed_runs(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> tuple[list, dict]:
    """`repeats` timed runs, and where an engine step's time went over them: the host's ms a step (scheduling,
    inputs, launches, outputs) and its wait for the device's tokens (none: the host sets the pace)."""
    engine = llm.engine
    engine.step_timing = type(engine.step_timing)()
    runs = [timed_generate(llm, prompts, max_tokens) for _ in range(repeats)]
    t = engine.step_timing
    steps = max(t.steps, 1)
    return runs, {"host_ms": t.host_seconds / steps * 1e3, "wait_ms": t.wait_seconds / steps * 1e3}


def same_requests(runs: list[tuple[float, list[list[int]]]], reference: list[list[int]]) -> int:
    """The requests whose tokens equal the reference's in every run."""
    return sum(all(tokens[i] == want for _, tokens in runs) for i, want in enumerate(reference))


def end_to_end(
    llm: LLM, batch: int, k: int, targets: list[float], max_tokens: int, repeats: int, drafters: list[str]
) -> list[dict]:
    """Greedy runs of `batch` requests: without drafts (the reference), then with the oracle at each target, on the
    host (OracleDrafter) and on the device (DeviceDrafter) as `drafters` say; at `disable_by_batch_size` requests or
    more none drafts (the scheduler holds it from speculative_config)."""
    vocab_size = llm.engine.model_config.vocab_size
    prompts = make_prompts(batch, vocab_size, seed=1000 + batch)
    install(llm, None)
    timed_generate(llm, prompts, 8)  # (warm-up)
    runs, split = timed_runs(llm, prompts, max_tokens, repeats)
    reference = runs[0][1]
    base = batch * max_tokens / statistics.median(seconds for seconds, _ in runs)
    row = {"batch": batch, "k": k, "target": None, "corrupt": None, "mean_accepted": 1.0, "acceptance": None}
    # a request counts as the same when every run's tokens equal the reference's (the first run without drafts)
    rows = [{**row, "tokens_per_s": base, "speedup": 1.0, "same": same_requests(runs, reference), **split}]
    continuations = {tuple(p): tokens for p, tokens in zip(prompts, reference)}
    for drafter, target in [(d, t) for d in drafters for t in targets]:
        keep = keep_for(target, k)
        if drafter == "device":
            install(llm, DeviceDrafter(k, vocab_size, continuations, keep))
        else:
            install(llm, OracleDrafter(k, continuations, keep, vocab_size))
        timed_generate(llm, prompts, 8)  # (warm-up: the first steps with drafts)
        before, full_before = spec_counters(llm), full_verifications(llm)
        runs, split = timed_runs(llm, prompts, max_tokens, repeats)
        spec_steps, drafted, kept = (now - then for now, then in zip(spec_counters(llm), before))
        full = full_verifications(llm) - full_before
        rate = batch * max_tokens / statistics.median(seconds for seconds, _ in runs)
        rows.append(
            {
                **row,
                "drafter": drafter,
                "target": target,
                "corrupt": 1 - keep,
                "mean_accepted": 1 + kept / spec_steps if spec_steps else 1.0,
                "acceptance": kept / drafted if drafted else 0.0,
                "tokens_per_s": rate,
                "speedup": rate / base,
                "same": same_requests(runs, reference),
                "full_graph_share": full / spec_steps * batch if spec_steps else 0.0,
                **split,
            }
        )
    install(llm, None)
    return rows


def print_tables(header: str, step_rows: list[dict], e2e_rows: list[dict], max_tokens: int) -> None:
    """The tables (gpu_check's summary keeps them from their first line on)."""
    print(f"\nspeculative decoding, the engine's side: {header}")
    if step_rows:
        print("step cost: B decoding requests each verifying k drafts (1 + k query tokens) against a plain decode step")
        print(
            f"{'batch':>5} {'drafter':>7} {'drafts':>6} {'tokens':>6} {'ms/step':>9} {'x plain':>8} {'kept':>5} "
            f"{'preempt':>7} {'full graph':>10}"
        )
        plain = {r["batch"]: r["step_ms"] for r in step_rows if r["drafts"] == "none"}
        for r in step_rows:
            print(
                f"{r['batch']:>5} {r['drafter']:>7} {r['drafts']:>6} {r['query_tokens']:>6} {r['step_ms']:>9.3f} "
                f"{r['step_ms'] / plain[r['batch']]:>8.2f} {r['drafts_kept']:>5} {r['preemptions']:>7} "
                f"{r['full_graph_share']:>10.0%}"
            )
        print(
            "(a verification step pays for itself once the mean accepted length passes its 'x plain'; 'full graph': "
            "the timed steps replayed as one CUDA graph, captured for num_speculative_tokens drafts a request)"
        )
    if e2e_rows:
        k = e2e_rows[0]["k"]
        print(
            f"end to end: greedy, B requests x {max_tokens} tokens, k={k} oracle drafts (the run without drafts' "
            "tokens, each corrupted at 'corrupt' given those before it were kept)"
        )
        print(
            f"{'batch':>5} {'drafter':>7} {'target':>6} {'corrupt':>7} {'mean accepted':>13} {'kept':>6} "
            f"{'tok/s':>9} {'speedup':>8} {'same':>6} {'full graph':>10} {'host ms':>8} {'wait ms':>8}"
        )
        for r in e2e_rows:
            target = "none" if r["target"] is None else f"{r['target']:g}"
            corrupt = "-" if r["corrupt"] is None else f"{r['corrupt']:.0%}"
            acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            same = f"{r['same']}/{r['batch']}"
            full = f"{r['full_graph_share']:.0%}" if "full_graph_share" in r else "-"
            print(
                f"{r['batch']:>5} {r.get('drafter', '-'):>7} {target:>6} {corrupt:>7} {r['mean_accepted']:>13.2f} "
                f"{acceptance:>6} "
                f"{r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {same:>6} {full:>10} "
                f"{r.get('host_ms', 0):>8.3f} {r.get('wait_ms', 0):>8.3f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", help="a preset or a model directory")
    p.add_argument("--load-format", default="auto", help="auto: dummy (random) weights for a preset")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on GPU, float32 on CPU (the engine's choice)")
    p.add_argument("--enforce-eager", action="store_true", help="no compile, no CUDA graphs (default: both)")
    p.add_argument("--quantization", default=None, help="fp8: the linear layers quantized at load")
    p.add_argument("--batches", default="1,8,64", help="step cost: decoding requests a step")
    p.add_argument("--k", default="1,2,3,4,5", help="step cost: drafts a request verifies a step")
    p.add_argument("--steps", type=int, default=32, help="step cost: steps a timed window")
    p.add_argument("--e2e-batches", default="1,8,64", help="end to end: requests a run (empty: none)")
    p.add_argument("--e2e-k", type=int, default=4, help="end to end: num_speculative_tokens")
    p.add_argument("--targets", default="1,1.5,2,3,4", help="end to end: mean accepted lengths aimed at")
    p.add_argument("--max-tokens", type=int, default=128, help="end to end: tokens a request generates")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (windows) a point; the median is reported")
    p.add_argument(
        "--drafters",
        default="device,host",
        help="where the stand-in drafters run: device (as EAGLE-3's: async scheduling stays on), host (as n-gram's "
        "without a GPU); ngram: step-cost rows of the engine's device n-gram lookup too",
    )
    p.add_argument(
        "--decisive",
        choices=["auto", "on", "off"],
        default="auto",
        help="make greedy decisive (make_greedy_decisive); auto: with dummy weights",
    )
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's disable_by_batch_size: end to end, no drafts at this many requests or more",
    )
    p.add_argument("--json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    ks = [int(k) for k in args.k.split(",") if k]
    e2e_batches = [int(b) for b in args.e2e_batches.split(",") if b]
    targets = [float(t) for t in args.targets.split(",") if t]
    for target in targets:
        keep_for(target, args.e2e_k)  # (an unreachable target fails before the engine starts)

    largest_step = max([b * (1 + max(ks, default=0)) for b in batches] + [b * (1 + args.e2e_k) for b in e2e_batches])
    step_tokens = (4 + args.steps * args.repeats + 2) * (1 + max(ks, default=0)) + 1
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        max_num_seqs=max(batches + e2e_batches),
        max_model_len=PROMPT_LEN + max(step_tokens, args.max_tokens) + 16,
        # verification steps of every request's 1 + k tokens replay graphs too
        cudagraph_capture_sizes=tuple(default_capture_sizes(-(-largest_step // 2))),
        # the engine sets itself up for drafts; the scheduler's drafter is then swapped for this script's
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": max([*ks, args.e2e_k]),
            "disable_by_batch_size": args.disable_by_batch_size,
        },
    )
    mode = "eager" if args.enforce_eager else "compiled"
    weights = "dummy weights" if llm.uses_dummy_weights else "checkpoint weights"
    weights += f", --quantization {args.quantization}" if args.quantization else ""
    if args.decisive == "on" or (args.decisive == "auto" and llm.uses_dummy_weights):
        make_greedy_decisive(llm)
        weights += " (greedy made decisive)"
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    header = f"{args.model}, {dtype}, {weights}, {mode}, {device_name()}, torch {torch.__version__}"
    if args.disable_by_batch_size is not None:
        header += f", disable_by_batch_size {args.disable_by_batch_size} (end to end)"
    print(f"started: {header}", flush=True)

    step_rows = []
    drafters = [d for d in args.drafters.split(",") if d]
    if set(drafters) - {"device", "host", "ngram"}:
        p.error(f"--drafters: device, host or ngram, got {args.drafters!r}")
    for batch in batches:
        points = [(None, "host"), (0, "host"), *((k, d) for d in drafters for k in ks)]
        for drafts, kind in points:
            row = step_ms(llm, batch, drafts, args.steps, args.repeats, kind)
            print(f"step: {row}", flush=True)
            step_rows.append(row)
    e2e_rows = []
    for batch in e2e_batches:
        oracles = [d for d in drafters if d != "ngram"]
        for row in end_to_end(llm, batch, args.e2e_k, targets, args.max_tokens, args.repeats, oracles):
            print(f"end to end: {row}", flush=True)
            e2e_rows.append(row)
    llm.close()

    print_tables(header, step_rows, e2e_rows, args.max_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "step": step_rows, "end_to_end": e2e_rows}, f, indent=1)
    differ = [r for r in e2e_rows if r["same"] < r["batch"]]
    if differ:
        print(
            f"outputs with drafts differ from those without in {len(differ)} rows: greedy is exact where the top two "
            "logits lie further apart than the dtype's rounding (random weights: float32, or --decisive on)"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
