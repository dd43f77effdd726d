"""What compilation did at start-up, and whether anything compiled afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

# Triton's compiles in this process, and its disk-cache hits, from the moment `watch_triton_compiles` is called
TRITON_EVENTS = {"compiles": 0, "cache_hits": 0}


def watch_triton_compiles() -> None:
    """Count Triton's compiles (kernels not found in its disk cache) and cache hits in TRITON_EVENTS, through its
    compilation listener (chained to one already set); once a process. Where this Triton has no listener, nothing is
    counted."""
    from triton import knobs  # noqa: PLC0415

    previous = getattr(knobs.compilation, "listener", False)
    if previous is False or getattr(previous, "kiln_counts", False):
        return

    def listener(**event) -> None:
        TRITON_EVENTS["cache_hits" if event.get("cache_hit") else "compiles"] += 1
        if previous is not None:
            previous(**event)

    listener.kiln_counts = True
    knobs.compilation.listener = listener


@dataclass
class CompileCounters:
    dynamo_traces: int = 0  # times Dynamo handed Kiln's backend a graph (1 at start-up, never after)
    compute_pieces: int = 0  # pieces of the split graph (L attention layers -> L + 1)
    attention_ops: int = 0
    unique_pieces: int = 0  # distinct piece graphs (identical middle layers share one compiled artifact)
    inductor_compiles: int = 0
    cache_hits: int = 0  # pieces loaded from the on-disk compile cache
    cudagraphs_captured: int = 0
    dynamo_seconds: float = 0.0
    inductor_seconds: float = 0.0
    cache_load_seconds: float = 0.0
    capture_seconds: float = 0.0
    # the engine's other start-up stages: the memory profile, the KV cache's allocation and the runner; the dummy
    # steps before capture (on a cold start the Dynamo trace and Inductor's compiles are among them)
    kv_sizing_seconds: float = 0.0
    warm_up_seconds: float = 0.0
    # Triton kernels compiled since these counters were made (the engine's start-up, onwards): its cache's misses
    # (Kiln's own kernels and Inductor's; a warm start should have none), and its hits
    triton_compiles: int = 0
    triton_cache_hits: int = 0
    _triton_mark: dict = field(default_factory=lambda: dict(TRITON_EVENTS), repr=False)

    def as_dict(self) -> dict[str, float]:
        self.triton_compiles, self.triton_cache_hits = (
            TRITON_EVENTS[k] - self._triton_mark[k] for k in ("compiles", "cache_hits")
        )
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @contextmanager
    def timed(self, field: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, field, getattr(self, field) + time.perf_counter() - start)
