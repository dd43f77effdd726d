"""The causal conv's Triton kernels (any query length, one-token decode) against a float64 loop over each request's
history, under Triton's interpreter on a CPU: requests shorter than the window, across it, with and without state,
several slots in one call, chained calls, padded decode rows."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.linear_attention.triton_conv import causal_conv1d, causal_conv1d_update

from helpers.kernels import DEVICE

K = 4
DIM = 160  # past one 128-channel block
NUM_SLOTS = 5


def reference(x, weight, conv_states, query_start_loc, seq_lens, state_slots):
    """Float64 outputs [T, D] and the conv states after the call."""
    x, weight, states = x.double(), weight.double(), conv_states.double().clone()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for i, slot in enumerate(state_slots.tolist()):
        start, end = query_start_loc[i].item(), query_start_loc[i + 1].item()
        has_state = seq_lens[i].item() - (end - start) > 0
        old = states[slot] if has_state else torch.zeros_like(states[slot])
        history = torch.cat([old, x[start:end]])  # [K - 1 + q_len, D]
        for t in range(end - start):
            window = history[t : t + K]  # rows t - (K - 1) .. t of the request, in history's numbering
            out[start + t] = torch.nn.functional.silu((window * weight.T).sum(0))
        states[slot] = history[-(K - 1) :]
    return out, states


def metadata(q_lens, contexts, slots):
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([c + n for c, n in zip(contexts, q_lens)], dtype=torch.int32, device=DEVICE)
    return query_start_loc, seq_lens, torch.tensor(slots, dtype=torch.int32, device=DEVICE)


def make_inputs(num_tokens, dtype=torch.float32, seed=0):
    """x as a strided view (the qkv part of a wider projection row), weight [D, K], conv states [S, K - 1, D]."""
    torch.manual_seed(seed)
    x = torch.randn(num_tokens, DIM + 24, device=DEVICE).to(dtype)[:, 8 : 8 + DIM]
    weight = (torch.randn(DIM, K, device=DEVICE) * 0.5).to(dtype)
    conv_states = torch.randn(NUM_SLOTS, K - 1, DIM, device=DEVICE).to(dtype)
    return x, weight, conv_states


def run_conv(x, weight, conv_states, query_start_loc, seq_lens, slots):
    out = torch.full(x.shape, float("nan"), device=DEVICE, dtype=x.dtype)
    causal_conv1d(x, weight, conv_states, query_start_loc, seq_lens, slots, out)
    return out


@pytest.mark.parametrize("q_len", [1, 2, 3, 5, 40])
@pytest.mark.parametrize("context", [0, 1, 7])
def test_conv_one_request(q_len, context):
    """Fewer tokens than the window's K - 1 (the new state keeps old rows), exactly that many, and more."""
    x, weight, conv_states = make_inputs(q_len, seed=q_len)
    query_start_loc, seq_lens, slots = metadata([q_len], [context], [2])
    want_out, want_states = reference(x, weight, conv_states, query_start_loc, seq_lens, slots)
    out = run_conv(x, weight, conv_states, query_start_loc, seq_lens, slots)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states.double(), want_states, atol=0, rtol=0)


def test_conv_mixed_requests():
    """Requests of 1, 2, 20, 0 and 17 tokens in one call, with and without state, each with its slot: no tap reads
    across a request's start."""
    q_lens, contexts, slots = [1, 2, 20, 0, 17], [3, 0, 5, 0, 0], [1, 2, 3, 0, 4]
    x, weight, conv_states = make_inputs(sum(q_lens), seed=1)
    query_start_loc, seq_lens, slot_tensor = metadata(q_lens, contexts, slots)
    want_out, want_states = reference(x, weight, conv_states, query_start_loc, seq_lens, slot_tensor)
    out = run_conv(x, weight, conv_states, query_start_loc, seq_lens, slot_tensor)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states.double(), want_states, atol=0, rtol=0)


def test_conv_in_pieces_equals_one_call():
    """A prefill in pieces of 2, 1 and 9 tokens (each reading the state the last left) equals one call."""
    x, weight, conv_states = make_inputs(12, seed=2)
    whole = conv_states.clone()
    out_whole = run_conv(x, weight, whole, *metadata([12], [0], [3]))
    outs, done = [], 0
    for piece in (2, 1, 9):
        outs.append(run_conv(x[done : done + piece], weight, conv_states, *metadata([piece], [done], [3])))
        done += piece
    torch.testing.assert_close(torch.cat(outs), out_whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(conv_states[3], whole[3], atol=0, rtol=0)


def test_conv_bfloat16():
    q_lens, contexts, slots = [2, 9], [4, 0], [1, 2]
    x, weight, conv_states = make_inputs(sum(q_lens), dtype=torch.bfloat16, seed=3)
    query_start_loc, seq_lens, slot_tensor = metadata(q_lens, contexts, slots)
    want_out, want_states = reference(x, weight, conv_states, query_start_loc, seq_lens, slot_tensor)
    out = run_conv(x, weight, conv_states, query_start_loc, seq_lens, slot_tensor)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(conv_states.double(), want_states, atol=0, rtol=0)


def test_conv_update_decode_steps():
    """Decode steps after a two-token prefill, against the reference's one-token steps; a padded row (seq_lens 0)
    neither reads its slot's state nor disturbs the others."""
    x, weight, conv_states = make_inputs(2, seed=4)
    run_conv(x, weight, conv_states, *metadata([2], [0], [1]))
    want_states = conv_states.double()
    lengths = [2, 6, 0]  # request 1 has an older state in slot 3; the last row is padding
    slots = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    for step in range(4):
        token_x = make_inputs(3, seed=10 + step)[0]
        lengths = [n + 1 if n else 0 for n in lengths]
        query_start_loc, seq_lens, _ = metadata([1, 1, 1], [n - 1 for n in lengths], [1, 3, 0])
        want_out, want_states = reference(token_x, weight, want_states, query_start_loc, seq_lens, slots)
        out = torch.full(token_x.shape, float("nan"), device=DEVICE)
        causal_conv1d_update(token_x, weight, conv_states, seq_lens, slots, out)
        torch.testing.assert_close(out[:2].double(), want_out[:2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_states[[1, 3]].double(), want_states[[1, 3]], atol=0, rtol=0)
        assert torch.equal(conv_states[0, -1], token_x[2])  # the padded row wrote the scratch slot


def test_conv_update_first_token_without_state():
    """A one-token request with no context (a one-token prompt) reads zeros, whatever its slot held."""
    x, weight, conv_states = make_inputs(1, seed=5)
    query_start_loc, seq_lens, slots = metadata([1], [0], [2])
    want_out, want_states = reference(x, weight, conv_states, query_start_loc, seq_lens, slots)
    out = torch.empty_like(x)
    causal_conv1d_update(x, weight, conv_states, seq_lens, slots, out)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states.double(), want_states, atol=0, rtol=0)


@pytest.mark.gpu
def test_conv_on_gpu_at_qwen36_shapes():
    """bf16, 8,192 channels (Qwen3.6-35B-A3B's q, k and v), a mixed prefill and a decode step."""
    torch.manual_seed(0)
    dim, q_lens, contexts, slots = 8192, [300, 1, 2, 70], [0, 9, 5, 0], [1, 2, 3, 4]
    x = torch.randn(sum(q_lens), dim + 4096, device="cuda", dtype=torch.bfloat16)[:, :dim]
    weight = torch.randn(dim, K, device="cuda", dtype=torch.bfloat16) * 0.5
    conv_states = torch.randn(5, K - 1, dim, device="cuda", dtype=torch.bfloat16)
    query_start_loc, seq_lens, slot_tensor = (t.cuda() for t in metadata(q_lens, contexts, slots))
    want_out, want_states = reference(x, weight, conv_states, query_start_loc, seq_lens, slot_tensor)
    out = torch.empty(x.shape, device="cuda", dtype=torch.bfloat16)
    causal_conv1d(x, weight, conv_states, query_start_loc, seq_lens, slot_tensor, out)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(conv_states.double(), want_states, atol=0, rtol=0)
    step = torch.randn(4, dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = seq_lens + 1
    want_out, want_states = reference(
        step, weight, conv_states, *(t.cuda() for t in metadata([1] * 4, [1] * 4, [1, 2, 3, 4]))
    )
    out = torch.empty_like(step)
    causal_conv1d_update(step, weight, conv_states, seq_lens, slot_tensor, out)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(conv_states.double(), want_states, atol=0, rtol=0)
