"""What compilation did at start-up, and whether anything compiled afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass


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

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @contextmanager
    def timed(self, field: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, field, getattr(self, field) + time.perf_counter() - start)
