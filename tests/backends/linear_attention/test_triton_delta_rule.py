"""The gated delta rule's Triton kernels (chunked prefill, one-token decode) against a float64 per-token loop of the
recurrence, under Triton's interpreter on a CPU: query lengths around the 64-token chunk, state carried in or not,
several requests with their own slots in one call, grouped value heads, extreme gates and betas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.backends.linear_attention import torch_forms
from kiln.backends.linear_attention.torch_forms import Fold
from kiln.backends.linear_attention.triton_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

from helpers.kernels import DEVICE

HK, HV, DK, DV = 1, 2, 16, 32  # two value heads a key head (Qwen3.5's grouping)
NUM_SLOTS = 6


def reference(q, k, v, g, beta, states, query_start_loc, seq_lens, state_slots, scale):
    """Float64 outputs [T, Hv, Dv] and the states after the call (slot by slot, as the kernels leave them)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    group = v.shape[1] // k.shape[1]
    q = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale).repeat_interleave(group, 1)
    k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, 1)
    out = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
    states = states.double().clone()
    for i, slot in enumerate(state_slots.tolist()):
        start, end = query_start_loc[i].item(), query_start_loc[i + 1].item()
        has_state = seq_lens[i].item() - (end - start) > 0
        state = states[slot].clone() if has_state else torch.zeros_like(states[slot])  # [Hv, Dk, Dv]
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            state = state + k[t][:, :, None] * (beta[t][:, None] * (v[t] - predicted))[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], state)
        states[slot] = state
    return out, states


def make_inputs(num_tokens, *, dtype=torch.float32, gate=None, beta_value=None, seed=0):
    """q, k, v as strided views of one projection row [q | k | v] (as the conv's output is split), g, beta."""
    torch.manual_seed(seed)
    mixed = torch.randn(num_tokens, 2 * HK * DK + HV * DV + 8, device=DEVICE).to(dtype)
    q = mixed[:, : HK * DK].view(num_tokens, HK, DK)
    k = mixed[:, HK * DK : 2 * HK * DK].view(num_tokens, HK, DK)
    v = mixed[:, 2 * HK * DK : 2 * HK * DK + HV * DV].view(num_tokens, HV, DV)
    if gate is None:
        g = -torch.nn.functional.softplus(torch.randn(num_tokens, HV, device=DEVICE)) * 0.5
    else:
        g = torch.full((num_tokens, HV), gate, device=DEVICE)
    if beta_value is None:
        beta = torch.rand(num_tokens, HV, device=DEVICE)
    else:
        beta = torch.full((num_tokens, HV), beta_value, device=DEVICE)
    return q, k, v, g, beta.to(dtype)


def metadata(q_lens, contexts, slots):
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([c + n for c, n in zip(contexts, q_lens)], dtype=torch.int32, device=DEVICE)
    return query_start_loc, seq_lens, torch.tensor(slots, dtype=torch.int32, device=DEVICE)


def random_states():
    return torch.randn(NUM_SLOTS, HV, DK, DV, device=DEVICE) * 0.3


def run_chunked(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, scale, dtype=torch.float32):
    out = torch.full((q.shape[0], HV, DV), float("nan"), device=DEVICE, dtype=dtype)
    chunk_gated_delta_rule(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, scale, out)
    return out


def assert_state_and_output(out, states, want_out, want_states, slots, tol=2e-5):
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    for slot in slots:
        torch.testing.assert_close(states[slot].double(), want_states[slot], atol=tol, rtol=tol)


@pytest.mark.parametrize("q_len", [1, 3, 63, 64, 65, 130])
@pytest.mark.parametrize("context", [0, 5])
def test_chunked_one_request(q_len, context):
    """Query lengths inside one chunk, at its edge and across two and three, from zeros and from a state."""
    q, k, v, g, beta = make_inputs(q_len, seed=q_len)
    query_start_loc, seq_lens, slots = metadata([q_len], [context], [3])
    states = random_states()
    want_out, want_states = reference(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    out = run_chunked(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    assert_state_and_output(out, states, want_out, want_states, [3])


def test_chunked_mixed_requests_keep_their_own_slots():
    """Long and one-token requests in one call, each with its slot, some with state; the slots no request names
    are untouched, and a request without context ignores what its slot held."""
    q_lens, contexts, slots = [70, 1, 3, 1, 64], [0, 9, 2, 0, 100], [2, 5, 1, 4, 3]
    q, k, v, g, beta = make_inputs(sum(q_lens), seed=1)
    query_start_loc, seq_lens, slot_tensor = metadata(q_lens, contexts, slots)
    states = random_states()
    untouched = states[0].clone()
    want_out, want_states = reference(q, k, v, g, beta, states, query_start_loc, seq_lens, slot_tensor, 0.7)
    out = run_chunked(q, k, v, g, beta, states, query_start_loc, seq_lens, slot_tensor, 0.7)
    assert_state_and_output(out, states, want_out, want_states, slots)
    assert torch.equal(states[0], untouched)


@pytest.mark.parametrize(
    "gate,beta_value",
    [(-1e-4, 1.0), (-20.0, 0.5), (-1e-4, 1e-4), (0.0, 1.0)],
    ids=["decay-near-1", "decay-near-0", "beta-near-0", "no-decay-beta-1"],
)
def test_chunked_extreme_gates_and_betas(gate, beta_value):
    """Gates that keep almost everything or nearly nothing, betas that write almost nothing or overwrite."""
    q_len = 100
    q, k, v, g, beta = make_inputs(q_len, gate=gate, beta_value=beta_value, seed=2)
    query_start_loc, seq_lens, slots = metadata([q_len], [4], [1])
    states = random_states()
    want_out, want_states = reference(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    out = run_chunked(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    assert_state_and_output(out, states, want_out, want_states, [1], tol=1e-4)


def test_chunked_repeated_keys():
    """The UT transform's hardest case: one key repeated through the chunk at beta 1, no decay (L all ones below
    the diagonal): the substitution must not blow up."""
    q_len = 64
    q, k, v, g, beta = make_inputs(q_len, gate=0.0, beta_value=1.0, seed=3)
    k[:] = k[0]
    query_start_loc, seq_lens, slots = metadata([q_len], [0], [2])
    states = random_states()
    want_out, want_states = reference(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    out = run_chunked(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    assert_state_and_output(out, states, want_out, want_states, [2], tol=1e-4)


def test_chunked_prefill_in_two_calls_equals_one():
    """A prefill cut into two steps (the second reads the first's state) gives the outputs and state of one call."""
    q_len, cut = 130, 67
    q, k, v, g, beta = make_inputs(q_len, seed=4)
    states = random_states()
    whole = states.clone()
    query_start_loc, seq_lens, slots = metadata([q_len], [0], [4])
    out_whole = run_chunked(q, k, v, g, beta, whole, query_start_loc, seq_lens, slots, 0.5)
    outs = []
    for first, last, context in ((0, cut, 0), (cut, q_len, cut)):
        query_start_loc, seq_lens, slots = metadata([last - first], [context], [4])
        step = (x[first:last] for x in (q, k, v, g, beta))
        outs.append(run_chunked(*step, states, query_start_loc, seq_lens, slots, 0.5))
    torch.testing.assert_close(torch.cat(outs), out_whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(states[4], whole[4], atol=2e-5, rtol=2e-5)


def test_chunked_16_bit():
    """16-bit inputs and output (the model dtype; float16 here, as Triton's interpreter multiplies bf16 tiles as
    integers), float32 state: the 16-bit path's products (the state split into two 16-bit parts)."""
    q_lens, contexts, slots = [65, 2], [0, 7], [1, 2]
    q, k, v, g, beta = make_inputs(sum(q_lens), dtype=torch.float16, seed=5)
    query_start_loc, seq_lens, slot_tensor = metadata(q_lens, contexts, slots)
    states = random_states()
    want_out, want_states = reference(q, k, v, g, beta, states, query_start_loc, seq_lens, slot_tensor, DK**-0.5)
    out = run_chunked(q, k, v, g, beta, states, query_start_loc, seq_lens, slot_tensor, DK**-0.5, torch.float16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=2e-3)
    # the 16-bit path's A and score products are TF32 on the GPU (a 10-bit mantissa; the interpreter's are exact)
    state_tol = 1e-4 if DEVICE == "cpu" else 2e-3
    for slot in slots:
        torch.testing.assert_close(states[slot].double(), want_states[slot], atol=state_tol, rtol=state_tol)


def test_recurrent_decode_steps_follow_the_reference():
    """Decode steps of three requests (one padded: seq_lens 0, scratch slot 0) after a chunked prefill, each step
    against the float64 loop carried from the same state."""
    q_lens, contexts, slots = [5, 9, 0], [0, 0, 0], [3, 1, 0]
    prefill = make_inputs(sum(q_lens), seed=6)
    states = random_states()
    query_start_loc, seq_lens, slot_tensor = metadata(q_lens, contexts, slots)
    run_chunked(*prefill, states, query_start_loc, seq_lens, slot_tensor, 0.3)
    want_states = states.double()
    lengths = [5, 9, 0]
    for step in range(3):
        q, k, v, g, beta = make_inputs(3, seed=10 + step, gate=-20.0 if step == 1 else None)
        lengths = [n + 1 if n else 0 for n in lengths]  # the padded request stays at 0
        query_start_loc, seq_lens, slot_tensor = metadata([1, 1, 1], [n - 1 for n in lengths], slots)
        want_out, want_states = reference(q, k, v, g, beta, want_states, query_start_loc, seq_lens, slot_tensor, 0.3)
        out = torch.full((3, HV, DV), float("nan"), device=DEVICE)
        recurrent_gated_delta_rule(q, k, v, g, beta, states, seq_lens, slot_tensor, 0.3, out)
        torch.testing.assert_close(out[:2].double(), want_out[:2], atol=2e-5, rtol=2e-5)
        for slot in (3, 1):
            torch.testing.assert_close(states[slot].double(), want_states[slot], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("context", [0, 1, 6])
def test_recurrent_from_zeros_or_from_state(context):
    """One-token requests with and without context (a first token of a prompt runs as decode), grouped heads."""
    q, k, v, g, beta = make_inputs(2, seed=context, beta_value=1.0 if context == 1 else None)
    query_start_loc, seq_lens, slots = metadata([1, 1], [context, context], [2, 5])
    states = random_states()
    want_out, want_states = reference(q, k, v, g, beta, states, query_start_loc, seq_lens, slots, DK**-0.5)
    out = torch.full((2, HV, DV), float("nan"), device=DEVICE)
    recurrent_gated_delta_rule(q, k, v, g, beta, states, seq_lens, slots, DK**-0.5, out)
    assert_state_and_output(out, states, want_out, want_states, [2, 5])


@pytest.mark.parametrize("kernel", ["chunked", "recurrent"])
def test_fold_takes_the_kept_tokens_first(kernel):
    """Speculative decoding's fold: each request first takes its slot record's first counts[i] tokens (a verification
    step's kept ones) into the state it read, then its own; with keep set the state written back is the folded one
    (its own tokens are drafts, folded a step later). Against the float64 loop over the record's tokens then the
    request's, and the plain-torch form (the CPU's) alike."""
    P = 4  # (a record's tokens: 1 + num_speculative_tokens)
    one = kernel == "recurrent"
    q_lens = [1, 1, 1, 1] if one else [3, 1, 4, 2]
    counts, keep, slots = [2, 0, 4, 1], [0 if one else 1, 0, 0, 1 if not one else 0], [2, 5, 1, 3]
    contexts = [7, 3, 9, 4]
    q, k, v, g, beta = make_inputs(sum(q_lens), seed=20)
    record = make_inputs(NUM_SLOTS * P, seed=21)
    fold = Fold(
        torch.tensor(counts, dtype=torch.int32, device=DEVICE),
        torch.tensor(keep, dtype=torch.int32, device=DEVICE),
        record[1].reshape(NUM_SLOTS, P, HK, DK),
        record[2].reshape(NUM_SLOTS, P, HV, DV),
        record[3].reshape(NUM_SLOTS, P, HV).contiguous(),
        record[4].reshape(NUM_SLOTS, P, HV).contiguous(),
    )
    query_start_loc, seq_lens, slot_tensor = metadata(q_lens, contexts, slots)
    states = random_states()
    # the reference: the kept tokens as a step of their own (no output), then the request's tokens
    want_states = states.double().clone()
    kept = [torch.arange(s * P, s * P + n) for s, n in zip(slots, counts)]
    rows = torch.cat(kept)
    fold_loc, fold_lens, fold_slots = metadata(counts, contexts, slots)
    _, want_states = reference(*(x[rows] for x in record), want_states, fold_loc, fold_lens, fold_slots, 1.0)
    folded = want_states.clone()
    want_out, want_states = reference(q, k, v, g, beta, want_states, query_start_loc, seq_lens, slot_tensor, 0.4)
    for i, slot in enumerate(slots):
        if keep[i]:
            want_states[slot] = folded[slot]
    for run in ("kernel", "torch"):
        got = states.clone()
        out = torch.full((sum(q_lens), HV, DV), float("nan"), device=DEVICE)
        if run == "torch":  # (the CPU's form: host tensors throughout)
            cpu, host_states, host_out = (q, k, v, g, beta), got.cpu(), out.cpu()
            args = (*(x.cpu() for x in cpu), host_states, query_start_loc.cpu(), seq_lens.cpu(), slot_tensor.cpu(), 0.4)
            torch_forms.chunk_gated_delta_rule(*args, host_out, Fold(*(x.cpu() for x in fold)))
            got.copy_(host_states), out.copy_(host_out)
        elif one:
            recurrent_gated_delta_rule(q, k, v, g, beta, got, seq_lens, slot_tensor, 0.4, out, fold)
        else:
            chunk_gated_delta_rule(q, k, v, g, beta, got, query_start_loc, seq_lens, slot_tensor, 0.4, out, fold)
        assert_state_and_output(out, got, want_out, want_states, slots)
        untouched = [s for s in range(NUM_SLOTS) if s not in slots]
        assert torch.equal(got[untouched], states[untouched])


def qwen36_inputs(num_tokens, seed):
    """Qwen3.6-35B-A3B's linear layers: 16 key heads, 32 value heads of 128, bf16; q, k, v views of one row."""
    torch.manual_seed(seed)
    hk, hv, d = 16, 32, 128
    mixed = torch.randn(num_tokens, (2 * hk + hv) * d, device="cuda", dtype=torch.bfloat16)
    q = mixed[:, : hk * d].view(num_tokens, hk, d)
    k = mixed[:, hk * d : 2 * hk * d].view(num_tokens, hk, d)
    v = mixed[:, 2 * hk * d :].view(num_tokens, hv, d)
    g = -torch.nn.functional.softplus(torch.randn(num_tokens, hv, device="cuda") - 2)
    beta = torch.rand(num_tokens, hv, device="cuda").bfloat16()
    return q, k, v, g, beta


@pytest.mark.gpu
def test_on_gpu_at_qwen36_shapes():
    """bf16 at the real shapes: a mixed prefill (long and short requests, state in and not), then decode steps,
    against float64: the outputs within bf16 rounding, the states within the chunk's TF32 products (A and the
    scores times the corrected values)."""
    q_lens, contexts, slots = [300, 1, 64, 129], [0, 20, 100, 0], [1, 2, 3, 4]
    inputs = qwen36_inputs(sum(q_lens), seed=0)
    query_start_loc, seq_lens, slot_tensor = (t.cuda() for t in metadata(q_lens, contexts, slots))
    states = torch.randn(5, 32, 128, 128, device="cuda") * 0.1
    want_out, want_states = reference(*inputs, states, query_start_loc, seq_lens, slot_tensor, 128**-0.5)
    out = torch.empty(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    chunk_gated_delta_rule(*inputs, states, query_start_loc, seq_lens, slot_tensor, 128**-0.5, out)
    torch.testing.assert_close(out.double(), want_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(states[1:].double(), want_states[1:], atol=3e-3, rtol=3e-3)
    lengths = [c + n for c, n in zip(contexts, q_lens)]
    for step in range(3):
        inputs = qwen36_inputs(4, seed=1 + step)
        lengths = [n + 1 for n in lengths]
        query_start_loc, seq_lens, slot_tensor = (t.cuda() for t in metadata([1] * 4, [n - 1 for n in lengths], slots))
        want_out, want_states = reference(*inputs, want_states, query_start_loc, seq_lens, slot_tensor, 128**-0.5)
        out = torch.empty(4, 32, 128, device="cuda", dtype=torch.bfloat16)
        recurrent_gated_delta_rule(*inputs, states, seq_lens, slot_tensor, 128**-0.5, out)
        torch.testing.assert_close(out.double(), want_out, atol=1e-3, rtol=1e-2)
        torch.testing.assert_close(states[1:].double(), want_states[1:], atol=3e-3, rtol=3e-3)


def test_kernels_compile_for_sm90_without_spilling(tmp_path):
    """Every Gated DeltaNet kernel (the delta rule's, with and without a fold, the conv's, the norm's) compiled for the
    H200 at Qwen3.6's shapes by `scripts/dev/kernel_resources.py`, on any machine: none spills registers (the chunk
    scan keeps a state slice, and spilled before its scores moved to the UT transform's kernel)."""
    script = Path(__file__).resolve().parents[3] / "scripts" / "dev" / "kernel_resources.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    args = ["--families", "gated_delta_net", "--models", "qwen3-0.6b", "--check"]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("gated_delta_net") == 9 and "spills" not in run.stdout, run.stdout  # (7 + two folds)
