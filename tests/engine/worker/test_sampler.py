"""Sampler: every stage against a float64 / per-row plain-Python reference written here.

Distribution tests draw N tokens and bound the total-variation distance to the reference with
    E[TV] <= 0.5 * sqrt((K - 1) / N)          (Cauchy-Schwarz on E|p_hat_i - p_i| <= sqrt(p_i / N))
    P(TV > E[TV] + t) <= exp(-2 N t^2)          (McDiarmid: one draw moves TV by at most 1 / N)
so a correct sampler fails with probability below 1e-6 (and the global seed makes runs repeatable).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kiln.backends.kernels import argmax
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.worker.sampler import (
    Sampler,
    SamplingMetadata,
    make_generator,
    process_logits,
    row_argmax,
    sampling_probs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

EOS = (0,)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def build(params, vocab, prompts=None, outputs=None, generators=None, eos=EOS) -> SamplingMetadata:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    if generators is None:
        generators = [None if p.seed is None else make_generator(p.seed, "cpu") for p in params]
    return SamplingMetadata.build(params, prompts, outputs, generators, eos, vocab, "cpu")


def tv_tolerance(support: int, num_samples: int, delta: float = 1e-6) -> float:
    return 0.5 * math.sqrt((support - 1) / num_samples) + math.sqrt(math.log(1 / delta) / (2 * num_samples))


# ---- float64 references of the random-row distribution (vLLM order) -------------------------------


def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """One row: temperature, min-p, top-k, top-p, each renormalising, in float64."""
    probs = torch.softmax(logits.double() / temperature, dim=0)
    if min_p > 0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    if top_k > 0:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[probs.argsort(descending=True)[:top_k]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1:
        order = probs.argsort(descending=True)
        mass_above = torch.cumsum(probs[order], 0) - probs[order]
        assert (mass_above - top_p).abs().min() > 1e-4, "test logits too close to the top-p boundary"
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[mass_above < top_p]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def empirical(row: torch.Tensor, params: SamplingParams, copies=5000, runs=4) -> torch.Tensor:
    """Frequencies of ``copies * runs`` draws of one row, batched ``copies`` at a time."""
    vocab = row.shape[0]
    metadata = build([params] * copies, vocab)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(runs):
        tokens = Sampler()(row.expand(copies, vocab), metadata).sampled_token_ids
        counts += torch.bincount(tokens, minlength=vocab)
    return counts / counts.sum()


def assert_matches(observed: torch.Tensor, expected: torch.Tensor, num_samples: int):
    assert (observed[expected == 0] == 0).all(), "a token outside the support was sampled"
    tv = 0.5 * (observed - expected).abs().sum().item()
    assert tv < tv_tolerance(int((expected > 0).sum()), num_samples), tv


ROW = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.7, -1.1, -1.6, -2.5])


def test_greedy_is_argmax_of_any_dtype():
    logits = torch.randn(64, 1000) * 4
    metadata = build([SamplingParams(temperature=0.0)] * 64, 1000)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler()(logits.to(dtype), metadata)
        assert out.logprobs is None and out.sampled_token_ids.dtype == torch.int64
        assert torch.equal(out.sampled_token_ids, logits.to(dtype).double().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 2 * argmax.CHUNK, 3 * argmax.CHUNK + 5])
def test_argmax_kernel_equals_argmax_ties_included(dtype, vocab):
    """The small-batch GPU argmax (a maximum per chunk, the last chunk to finish reducing them; Triton's
    interpreter on the CPU) against torch's argmax, with ties inside a chunk, across chunks, a row of one
    repeated value, infinities and a NaN, twice in a row (the arrival counts must return to zero)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (9, vocab), generator=g).to(dtype)  # few distinct values: ties everywhere
    x[1] = 2.0
    x[2, vocab - 1] = x[2, 5] = 50.0  # the same maximum in the first and the last chunk: the first one wins
    x[3, 9] = float("inf")
    x[4] = float("-inf")
    x[5, vocab - 1] = 9.0
    x[6, vocab // 2] = float("nan")
    x[7, 3] = x[7, vocab // 3] = float("nan")
    x = x.to(DEVICE)
    for rows in (slice(0, 9), slice(2, 3)):
        for _ in range(2):
            assert torch.equal(argmax.argmax(x[rows]), x[rows].argmax(dim=-1))


@pytest.mark.gpu
def test_row_argmax_on_gpu_equals_argmax():
    x = torch.randn(argmax.MAX_ROWS + 1, 128256, device="cuda").to(torch.bfloat16)  # bf16: ties at this width
    x[2, 1000] = x[2, 90000] = 100.0
    for rows in (1, 4, argmax.MAX_ROWS, argmax.MAX_ROWS + 1):
        assert torch.equal(row_argmax(x[:rows]), x[:rows].argmax(dim=-1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"top_k": 4},
        {"top_k": 1},
        {"temperature": 0.7, "top_p": 0.8},
        {"top_p": 0.3},
        {"min_p": 0.3},
        {"temperature": 1.5, "min_p": 0.1},
        {"temperature": 1.3, "top_k": 8, "top_p": 0.9, "min_p": 0.05},
    ],
)
def test_random_rows_follow_reference_distribution(kwargs):
    observed = empirical(ROW, SamplingParams(**kwargs))
    assert_matches(observed, reference_probs(ROW, **kwargs), 20000)


def test_sampling_probs_equal_reference_per_row():
    """The exact distribution, row by row, in one mixed batch with a larger vocabulary."""
    vocab = 500
    logits = torch.randn(6, vocab) * 2
    kwargs = [
        {"temperature": 0.8},
        {"top_k": 50, "temperature": 1.2},
        {"top_p": 0.65},
        {"min_p": 0.02, "top_p": 0.9},
        {"temperature": 0.6, "top_k": 30, "top_p": 0.75, "min_p": 0.01},
        {"temperature": 1.0},
    ]
    metadata = build([SamplingParams(**k) for k in kwargs], vocab)
    probs = sampling_probs(process_logits(logits, metadata), metadata)
    for i, k in enumerate(kwargs):
        torch.testing.assert_close(probs[i].double(), reference_probs(logits[i], **k), rtol=1e-4, atol=1e-6)
        assert (probs[i][reference_probs(logits[i], **k) == 0] == 0).all()


def test_top_k_through_the_sort_path_when_another_row_uses_top_p():
    vocab = 200
    logits = torch.randn(2, vocab)
    metadata = build([SamplingParams(top_k=7), SamplingParams(top_p=0.5)], vocab)
    assert metadata.top_p is not None
    probs = sampling_probs(logits, metadata)
    torch.testing.assert_close(probs[0].double(), reference_probs(logits[0], top_k=7), rtol=1e-5, atol=1e-7)


def test_mixed_greedy_and_random_batch():
    copies = 4000
    other = ROW.flip(0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.8),
        SamplingParams(temperature=0.0, seed=5),
    ] * copies
    logits = torch.stack([other, ROW, other] * copies)
    metadata = build(params, ROW.shape[0])
    counts = torch.zeros(ROW.shape[0], dtype=torch.float64)
    for _ in range(5):
        tokens = Sampler()(logits, metadata).sampled_token_ids.view(copies, 3)
        assert (tokens[:, 0] == other.argmax()).all() and (tokens[:, 2] == other.argmax()).all()
        counts += torch.bincount(tokens[:, 1], minlength=ROW.shape[0])
    assert_matches(counts / counts.sum(), reference_probs(ROW, top_p=0.8), 5 * copies)


# ---- logit processing against a per-row plain-Python loop -----------------------------------------


def reference_process(
    row: list[float], params: SamplingParams, prompt: list[int], output: list[int], eos=EOS
) -> list[float]:
    logits = [float(x) for x in row]
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    if len(output) < params.min_tokens:
        for token in set(eos) | set(params.stop_token_ids):
            logits[token] = -math.inf
    for token in range(len(logits)):
        if token in prompt or token in output:
            penalty = params.repetition_penalty
            logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
        logits[token] -= params.frequency_penalty * output.count(token)
        if token in output:
            logits[token] -= params.presence_penalty
    return logits


PROCESS_CASES = [
    (SamplingParams(), [1, 2], [3]),
    (SamplingParams(repetition_penalty=1.3), [1, 2, 2, 9], [3, 3, 5]),
    (SamplingParams(repetition_penalty=0.7), [4, 6], []),
    (SamplingParams(frequency_penalty=0.6), [1, 2], [3, 3, 3, 7, 7]),
    (SamplingParams(frequency_penalty=-1.0), [], [2, 2]),
    (SamplingParams(presence_penalty=1.5), [1], [3, 3, 8]),
    (SamplingParams(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=1.2), [5, 6], [6, 7, 7]),
    (SamplingParams(logit_bias={3: 5.0, 11: -100.0, 0: 2.5}), [3], [3]),
    (SamplingParams(logit_bias={4: 3.0}, repetition_penalty=2.0, frequency_penalty=0.5), [4], [4, 4]),
    (SamplingParams(min_tokens=3, stop_token_ids=[5, 9], repetition_penalty=1.5), [5], [9, 2]),
    (SamplingParams(min_tokens=2, stop_token_ids=[5]), [], [1, 2]),
]


def test_process_logits_equals_per_row_reference():
    vocab = 16
    logits = torch.randn(len(PROCESS_CASES), vocab) * 3
    params, prompts, outputs = (list(column) for column in zip(*PROCESS_CASES))
    metadata = build(params, vocab, prompts, outputs)
    original = logits.clone()
    processed = process_logits(logits, metadata)
    assert torch.equal(logits, original), "process_logits modified its input"
    for i, (p, prompt, output) in enumerate(PROCESS_CASES):
        expected = torch.tensor(reference_process(logits[i].tolist(), p, prompt, output), dtype=torch.float64)
        torch.testing.assert_close(processed[i].double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(processed[0], logits[0]), "a row without features must pass through unchanged"
    greedy = build([dataclasses.replace(p, temperature=0.0) for p in params], vocab, prompts, outputs)
    sampled = Sampler()(logits, greedy).sampled_token_ids
    reference = [
        max(range(vocab), key=reference_process(logits[i].tolist(), *case).__getitem__)
        for i, case in enumerate(PROCESS_CASES)
    ]
    assert sampled.tolist() == reference


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    vocab, eos = 10, (0, 7)
    logits = torch.zeros(1, vocab)
    logits[0, [0, 5, 7, 9]] = torch.tensor([10.0, 9.0, 8.0, 1.0])  # EOS, stop id, EOS, the rest
    for params in (
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5]),
    ):
        for produced in range(5):
            metadata = build([params] * 2000, vocab, outputs=[[9] * produced] * 2000, eos=eos)
            tokens = Sampler()(logits.expand(2000, vocab), metadata).sampled_token_ids
            blocked = torch.isin(tokens, torch.tensor([0, 5, 7]))
            if produced < 3:
                assert not blocked.any(), produced
                if params.is_greedy:
                    assert (tokens == 9).all()
            elif params.is_greedy:
                assert (tokens == 0).all()
            else:
                assert blocked.float().mean() > 0.9  # EOS and the stop id hold almost all the mass


def test_requests_without_a_feature_pay_nothing():
    metadata = build([SamplingParams(), SamplingParams(temperature=0.5)], 32, outputs=[[1, 1], []])
    assert metadata.all_random and metadata.greedy_mask is None
    assert metadata.penalties is None and metadata.logit_bias is None and metadata.min_tokens_block is None
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.max_num_logprobs is None and metadata.generators == {}
    greedy = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)], 32)
    assert greedy.all_greedy and greedy.temperature is None and greedy.top_k is None and greedy.top_p is None
    only_one = build([SamplingParams(), SamplingParams(frequency_penalty=0.5)], 32, outputs=[[1], [2]])
    assert only_one.penalties.rows.tolist() == [1] and only_one.penalties.prompt_token_ids is None


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.build([SamplingParams(seed=1)], [[]], [[]], [None], EOS, 8, "cpu")
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        build([SamplingParams(logit_bias={8: 1.0})], 8)
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [[]], [], [None], EOS, 8, "cpu")
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(2, 9), build([SamplingParams()] * 2, 8))


# ---- seeds ----------------------------------------------------------------------------------------


def run_seeded(seed: int, steps: torch.Tensor, batch: int, position_of_step) -> list[int]:
    """The seeded row's tokens over ``steps``, surrounded by ``batch - 1`` other random rows."""
    generator = make_generator(seed, "cpu")
    others = [
        SamplingParams(),
        SamplingParams(top_k=20, seed=99),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.05),
    ]
    other_generators = [None, make_generator(99, "cpu"), None, None, None]
    tokens = []
    for step, row in enumerate(steps):
        position = position_of_step(step)
        params = [others[j % len(others)] for j in range(batch - 1)]
        generators = [other_generators[j % len(others)] for j in range(batch - 1)]
        params.insert(position, SamplingParams(seed=seed))
        generators.insert(position, generator)
        logits = torch.randn(batch, row.shape[0])
        logits[position] = row
        metadata = build(params, row.shape[0], generators=generators)
        tokens.append(Sampler()(logits, metadata).sampled_token_ids[position].item())
    return tokens


def test_seeded_row_is_independent_of_the_batch():
    steps = torch.randn(12, 64) * 0.5
    alone = run_seeded(1234, steps, 1, lambda step: 0)
    assert alone == run_seeded(1234, steps, 7, lambda step: step % 7)
    assert alone == run_seeded(1234, steps, 16, lambda step: 15 - step)
    assert alone != run_seeded(4321, steps, 1, lambda step: 0)


# ---- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_top_k_and_ranks(dtype):
    vocab = 300
    # Distinct multiples of 1/16 below 10 are exact in bfloat16, so no ties make the top-K ambiguous.
    logits = torch.stack([(torch.randperm(vocab) - 150) / 16 for _ in range(6)]).to(dtype)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(logprobs=3, logit_bias={7: 50.0}, temperature=0.0),
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(logprobs=2, top_k=10),
        SamplingParams(temperature=3.0),
    ]
    metadata = build(params, vocab, prompts=[[1, 2]] * 6, outputs=[[3]] * 6)
    out = Sampler()(logits, metadata)
    reference = torch.log_softmax(logits.double(), dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[2].item() == 7  # the bias moved the token, not the logprobs
    lp = out.logprobs
    assert lp.token_ids.shape == (6, 6) and lp.logprobs.shape == (6, 6) and lp.ranks.shape == (6,)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    assert torch.equal(lp.token_ids[:, 0], sampled)
    rows = torch.arange(6)
    torch.testing.assert_close(lp.logprobs[:, 0].double(), reference[rows, sampled], rtol=0, atol=1e-5)
    order = reference.argsort(dim=-1, descending=True)
    assert torch.equal(lp.token_ids[:, 1:], order[:, :5])
    torch.testing.assert_close(lp.logprobs[:, 1:].double(), reference.gather(1, order[:, :5]), rtol=0, atol=1e-5)
    expected_ranks = [order[i].tolist().index(sampled[i].item()) + 1 for i in range(6)]
    assert lp.ranks.tolist() == expected_ranks


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.randn(3, 50)
    out = Sampler()(logits, build([SamplingParams(logprobs=0)] * 3, 50))
    assert out.logprobs.token_ids.shape == (3, 1) and torch.equal(out.logprobs.token_ids[:, 0], out.sampled_token_ids)
