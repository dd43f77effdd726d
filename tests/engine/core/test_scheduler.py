"""Scheduler decisions on a real KV cache manager, with hand-made requests and no model."""

from __future__ import annotations

from kiln.cache import KVCacheManager
from kiln.engine.core.request import Request, RequestStatus
from kiln.engine.core.scheduler import Scheduler
from kiln.engine.sampling_params import SamplingParams

EOS = 99


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(range(1, prompt_len + 1)), sp, (EOS,), max_tokens)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(kv, max_num_seqs, budget, max_model_len), kv


def step(scheduler: Scheduler, token: int = 5):
    """Schedule, then pretend the model sampled `token` for every request that caught up."""
    out = scheduler.schedule()
    sampled = [token if sample else None for sample in out.samples]
    return out, scheduler.update_from_output(out, sampled)


def test_budget_and_chunked_prefill():
    s, _ = make_scheduler(budget=10, prefix=False)
    a, b = make_request("a", 7), make_request("b", 9)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"] and out.num_new_tokens == [7, 3]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0  # b's prefill is partial: no sample
    out, _ = step(s)
    # running first: a decodes one token, b gets the rest of its prompt
    assert out.num_new_tokens == [1, 6] and b.num_output_tokens == 1
    out, _ = step(s)
    assert out.num_new_tokens == [1, 1]


def test_max_num_seqs_caps_running():
    s, _ = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(str(i), 3))
    out, _ = step(s)
    assert len(out.requests) == 2 and len(s.waiting) == 2


def test_preempts_newest_and_recomputes():
    # 7 usable blocks of 4 tokens = 28 slots; two requests of 12 prompt tokens grow past that.
    s, kv = make_scheduler(num_blocks=8, block_size=4, prefix=False)
    a, b = make_request("a", 12, max_tokens=16), make_request("b", 12, max_tokens=16)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"b"}  # always the newer one
    assert b.num_preemptions >= 1
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 16
    assert kv.num_free_blocks == 7


def test_preempted_request_goes_to_front_of_waiting():
    s, _ = make_scheduler(num_blocks=6, block_size=4, prefix=False)
    a, b, c = make_request("a", 8, max_tokens=20), make_request("b", 8, max_tokens=20), make_request("c", 2)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a and b take 4 of 5 blocks
    s.add_request(c)
    for _ in range(10):
        out, _ = step(s)
        if out.preempted:
            break
    assert out.preempted == [b] and s.waiting[0] is b and b.num_computed_tokens == 0


def test_stop_conditions():
    s, _ = make_scheduler()
    eos = make_request("eos", 3)
    ignore = make_request("ignore", 3, max_tokens=2, ignore_eos=True)
    stop_id = make_request("stopid", 3, stop_token_ids=[5], ignore_eos=True)
    late = make_request("late", 3, min_tokens=2)
    for r in (eos, ignore, stop_id, late):
        s.add_request(r)
    _, (_, finished) = step(s, token=EOS)
    assert {r.request_id for r in finished} == {"eos"} and eos.status == RequestStatus.FINISHED_STOPPED
    _, (_, finished) = step(s, token=5)
    assert {r.request_id for r in finished} == {"ignore", "stopid"}
    assert ignore.status == RequestStatus.FINISHED_LENGTH and stop_id.stop_reason == 5
    _, (_, finished) = step(s, token=EOS)  # min_tokens=2 reached now: EOS stops it
    assert finished == [late] and late.output_token_ids == [EOS, 5, EOS]


def test_max_model_len_stops():
    s, _ = make_scheduler(max_model_len=10)
    r = make_request("r", 6, max_tokens=100)
    s.add_request(r)
    while s.has_unfinished_requests():
        step(s)
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks():
    s, kv = make_scheduler()
    free = kv.num_free_blocks
    running, waiting = make_request("run", 9), make_request("wait", 5)
    s.add_request(running)
    step(s)
    s.add_request(waiting)
    assert kv.num_free_blocks < free
    s.abort_request("run")
    s.abort_request("wait")
    assert kv.num_free_blocks == free and not s.has_unfinished_requests()
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED


def test_prefix_hit_skips_computed_tokens():
    s, _ = make_scheduler(block_size=4)
    first = make_request("first", 10, max_tokens=1)
    s.add_request(first)
    step(s)
    second = make_request("second", 10, max_tokens=1)
    s.add_request(second)
    out, _ = step(s)
    assert out.num_new_tokens == [2] and second.num_cached_tokens == 8


class DrafterOnDevice:
    """Stands in for EAGLE-3's proposer: it always holds k drafts on the device for every request."""

    drafts_after_step, k, lookahead, device_drafts = True, 3, 3, None

    def has_drafts(self, request_id: str) -> bool:
        return True


def test_a_window_frees_no_block_a_rejected_draft_in_flight_would_need():
    """Scheduled ahead of a verdict (async scheduling while drafting), a request counts its drafts in flight as kept;
    if the step rejects them all its next positions are 3 earlier, so a sliding window (8 tokens, blocks of 4) may only
    free the blocks wholly behind the window of that earliest position."""
    window, block_size, k = 8, 4, DrafterOnDevice.k
    kv = KVCacheManager(64, block_size, enable_prefix_caching=False, sliding_window=window)
    scheduler = Scheduler(kv, 8, 64, 128, DrafterOnDevice(), optimistic=True)
    request = make_request("a", 16, max_tokens=40)
    scheduler.add_request(request)
    in_flight = scheduler.schedule()  # the prefill
    checked = 0
    for _ in range(12):
        ahead = scheduler.schedule()  # (the step in flight's verdict not seen yet)
        if ahead.shifted_rows:
            earliest = ahead.num_computed_tokens[0] - k  # (where it starts if the step in flight kept no draft)
            freed = kv.req_to_freed.get("a", 0)
            assert freed * block_size <= max(earliest - window + 1, 0), (earliest, freed)
            checked += 1
        drafts = in_flight.spec_token_ids[0] if in_flight.spec_token_ids else []
        scheduler.update_from_output(in_flight, [5], [[]] if drafts else None)  # (every draft rejected)
        in_flight = ahead
    assert checked > 5 and kv.req_to_freed.get("a", 0) > 0
