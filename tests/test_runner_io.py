"""The runner's staged input buffers: device buffer, two host mirrors, and the prefix views a step uses."""

from __future__ import annotations

import torch

from kiln.engine.runner_io import MAX_PREFIXES, StagedBuffer


def test_copy_moves_only_the_prefix_of_one_mirror():
    buf = StagedBuffer(8, dtype=torch.int64, device=torch.device("cpu"))
    buf.np[0][:] = range(10, 18)
    buf.np[1][:] = range(20, 28)
    buf.copy(1, 3)
    assert buf.gpu.tolist() == [20, 21, 22, 0, 0, 0, 0, 0]
    buf.copy(0, 5)
    assert buf.gpu.tolist() == [10, 11, 12, 13, 14, 0, 0, 0]


def test_prefix_views_alias_the_buffers_and_are_made_once():
    buf = StagedBuffer(4, 3, dtype=torch.int32, device=torch.device("cpu"))
    view = buf.prefix(2)
    assert view is buf.prefix(2) and view.shape == (2, 3)
    buf.gpu[1, 2] = 7  # a view, not a copy: it sees later writes
    assert view[1, 2] == 7
    host = buf.prefix(2, parity=1)
    assert host is buf.prefix(2, parity=1) and host is not buf.prefix(2, parity=0)
    buf.np[1][0, 0] = 5
    assert host[0, 0] == 5


def test_prefix_memo_stays_bounded():
    """Without CUDA graphs every token count is a prefix size of its own."""
    buf = StagedBuffer(4096, dtype=torch.int64, device=torch.device("cpu"))
    for n in range(1, 4097):
        assert buf.prefix(n, n % 2).shape == (n,)
    assert len(buf._prefixes) <= MAX_PREFIXES
