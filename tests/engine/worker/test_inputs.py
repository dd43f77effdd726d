"""The runner's input arena: one device buffer, two host mirrors, fields laid out by (tokens, requests)."""

from __future__ import annotations

import torch

from kiln.engine.worker.inputs import ALIGN, MAX_VIEWS, InputArena

CPU = torch.device("cpu")


def test_one_copy_moves_the_steps_fields_and_nothing_past_them():
    arena = InputArena(16, 4, 5, CPU)
    for parity in (0, 1):
        arena.host_bytes[parity].view(torch.int8).fill_(-1 - parity)  # every byte of each mirror marked
    host = arena.views(3, 2, parity=1, numpy=True)
    host.input_ids[:] = [7, 8, 9]
    host.positions[:] = [0, 1, 5]
    host.query_start_loc[:] = [0, 2, 3]
    host.block_table[0] = [4, 3, 2, 1, 0]
    arena.copy(1, 3, 2, block_rows=1)
    device = arena.views(3, 2)
    assert device.input_ids.tolist() == [7, 8, 9] and device.positions.tolist() == [0, 1, 5]
    assert device.query_start_loc.tolist() == [0, 2, 3] and device.block_table[0].tolist() == [4, 3, 2, 1, 0]
    # the span ends after the first block-table row: the second row and everything after stay as they were
    assert device.block_table[1].tolist() == [0] * 5
    end = device.block_table[1].data_ptr() - arena.device_bytes.data_ptr()
    assert (arena.device_bytes[:end] == arena.host_bytes[1][:end]).all()
    assert not arena.device_bytes[end:].any()


def test_layout_keeps_graph_inputs_in_place_and_fields_apart():
    """input_ids always at the start and positions where the token count alone puts them (a piecewise graph of
    size n finds them there whatever the request count); every field 16-byte aligned, none overlapping."""
    arena = InputArena(64, 16, 9, CPU)
    base = arena.device_bytes.data_ptr()
    for n in (1, 3, 8, 64):
        by_reqs = [arena.views(n, r) for r in (1, 2, 7, 16) if r <= n]
        assert {v.input_ids.data_ptr() for v in by_reqs} == {base}
        assert len({v.positions.data_ptr() for v in by_reqs}) == 1
        for views in by_reqs:
            spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in views)
            assert all(start % ALIGN == 0 for start, _ in spans)
            assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
            assert spans[-1][1] <= base + arena.device_bytes.numel()
    largest = arena.views(64, 16)
    assert largest.block_table.shape == (16, 9) and largest.carry.shape == (2, 16)


def test_views_are_made_once_and_stay_bounded():
    """Without CUDA graphs every token count is a layout of its own."""
    arena = InputArena(4096, 8, 4, CPU)
    view = arena.views(5, 2)
    assert view is arena.views(5, 2) and view is not arena.views(5, 2, parity=0)
    arena.device_bytes[:8].view(torch.int64)[0] = 11  # views, not copies: they see later writes
    assert view.input_ids[0] == 11
    for n in range(1, 4097):
        assert arena.views(n, 1, n % 2).input_ids.shape == (n,)
    assert len(arena._views) <= MAX_VIEWS


def test_a_write_waits_only_for_copies_two_steps_old():
    """A step with an EAGLE-3 or MTP drafter writes inputs k + 1 times (its own, the draft's first pass, k - 1 chain
    passes); a write waits for the copy out of the mirror it reuses, so with 2 (k + 1) mirrors taking turns it never
    waits for a copy of the step it belongs to or of the step before (still running while the host prepares the next
    one with async scheduling), only for older ones."""
    import numpy as np  # noqa: PLC0415

    from kiln.engine.worker.input_writer import InputWriter  # noqa: PLC0415
    from kiln.engine.worker.inputs import GraphPlan  # noqa: PLC0415

    k = 3
    writes = 1 + k
    writer = InputWriter(16, 4, 64, 4, torch.device("cpu"), writes_per_step=writes)
    waited = []

    class Fence:  # (the CPU records no events: each write's copy gets one here)
        def __init__(self, index: int) -> None:
            self.index = index

        def synchronize(self) -> None:
            waited.append((count, self.index))

    count = 0
    for count in range(5 * writes):
        used = writer._parity
        ones = np.ones(2, dtype=np.int64)
        writer.write(np.zeros(2, dtype=np.int64), ones, ones, [[1], [2]], GraphPlan("none", 2, 2))
        writer._fences[used] = Fence(count)
    assert waited and all(now // writes - then // writes >= 2 for now, then in waited)
