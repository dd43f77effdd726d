"""CUDA graphs: piecewise (each compiled piece captured per size, attention eager between) and full
(the whole forward, attention inside, for decode-only batches).

All graphs of one engine share one memory pool. A piece's outputs are kept only as *weak* views: once its capture
pass is over, the pool may hand that memory to graphs of other sizes — harmless, since graphs of
different sizes never run in one forward — and returning weak views at replay costs no memory.
Within one size, every piece's outputs were alive while the later pieces were captured, so no graph
of that size writes over another's outputs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from kiln.backends.attention.forward_context import current_cudagraph_size


class GraphPool:
    """The memory pool one engine's graphs, full and piecewise, share (a handle made on first use), and the side
    stream they are captured on.

    NOTE: one per engine, and a new one after `reset`: once every graph of a pool is gone the allocator
    retires it, and capturing into a retired pool's handle fails an allocator assertion."""

    def __init__(self) -> None:
        self._handle = None
        self._stream = None

    def __call__(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def reset(self) -> None:
        self._handle = None

    @contextmanager
    def capture(self, graph: torch.cuda.CUDAGraph):
        """`torch.cuda.graph(graph, pool=self())` without what that does before every capture: a device
        synchronize and emptying the allocator's caches (so that each graph finds the most free memory). A start
        captures ~1,700 graphs (a piece a layer, per size), and the one pool they share already holds their
        memory; vLLM also skips the emptying after its first capture."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self())
            try:
                yield
            finally:
                graph.capture_end()


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), max = min(2 * max_num_seqs, 512)."""
    largest = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [s for s in sizes if s <= largest]


def weak_ref(x: Any) -> Any:
    """A tensor viewing x's memory without keeping it allocated (recursively through tuples/lists)."""
    if isinstance(x, torch.Tensor):
        storage = torch._C._construct_storage_from_data_pointer(
            x.untyped_storage().data_ptr(), x.device, x.untyped_storage().nbytes()
        )
        return torch.empty(0, dtype=x.dtype, device=x.device).set_(storage, x.storage_offset(), x.shape, x.stride())
    if isinstance(x, tuple | list):
        return type(x)(weak_ref(y) for y in x)
    return x


class PiecewiseCudaGraphs:
    """Runs a compiled piece directly, or — when the forward context names a capture size — replays
    (capturing on first use) the piece's CUDA graph for that size."""

    def __init__(self, compiled, pool: GraphPool) -> None:
        self.compiled = compiled
        self.pool = pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any, list[int]]] = {}

    def __call__(self, *args):
        size = current_cudagraph_size()
        if size is None:
            return self.compiled(*args)
        entry = self.graphs.get(size)
        pointers = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
        if entry is None:
            graph = torch.cuda.CUDAGraph()
            with self.pool.capture(graph):
                out = self.compiled(*args)
            self.graphs[size] = (graph, weak_ref(out), pointers)
            return out
        graph, out, captured_pointers = entry
        if pointers != captured_pointers:
            # NOTE: replay reads the addresses captured; new ones would be silently ignored.
            raise RuntimeError(f"piecewise CUDA graph for size {size} replayed with inputs at new addresses")
        graph.replay()
        return out
