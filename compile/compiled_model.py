"""The model's forward, traced once and compiled piecewise; plus full-forward CUDA graphs for decode."""

from __future__ import annotations

import itertools
import json
import logging
import time
import types
from collections.abc import Callable

import torch
from torch import nn

from kiln.compile.backend import CompiledPiece, KilnBackend
from kiln.compile.cache import CompileCache
from kiln.compile.counters import CompileCounters
from kiln.compile.cudagraph import weak_ref
from kiln.compile.saved_graph import SavedForward, rebuild

logger = logging.getLogger("kiln")

# Several engines in one process (tests, benchmarks) each trace their own model: let Dynamo keep them all.
torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)


_instances = itertools.count()
SAVED_GRAPH = "forward.json"


def _without_shape_guards(entries) -> list[bool]:
    """Keep every guard of the traced frame but the symbolic-shape ones (T >= 2 among them)."""
    return [entry.guard_type != "SHAPE_ENV" for entry in entries]


def _private_forward(model: nn.Module):
    """`model(input_ids, positions)` under a code object of its own.

    NOTE: Dynamo caches compiled code per code object. Two engines in one process (tests, benchmarks)
    compiling the same `forward` would share one cache, and each would fail the other's guards and
    retrace; a distinct code object per engine keeps their entries apart.
    """

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)

    code = forward.__code__.replace(co_name=f"kiln_forward_{next(_instances)}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


class CompiledModel:
    """`model.forward(input_ids[T], positions[T])`, compiled for any T by one Dynamo trace.

    The first call traces, with T marked dynamic. The split graph it gives is saved in the compile cache
    (`saved_graph.py`) and every call after it runs that graph rebuilt, outside Dynamo: nothing can trace or
    compile again while serving. A start that finds the saved graph and its artifacts in the cache rebuilds it
    (`load_saved`, once the weights are in place) and never traces. (A graph that cannot be saved runs in Dynamo's
    frame, under `fail_on_recompile`, so a batch that would need a new trace is an error, never a silent compile.)

    NOTE: T is a *backed* symbol (traced at a size >= 2, so it has a hint) and the frame keeps no shape
    guards, so T = 1 runs the same code. Marked unbacked instead (no 0/1 specialisation, no guard to drop),
    Inductor cannot split the flattened range of a pointwise kernel into (T, hidden) without a hint, and
    leaves e.g. RMSNorm as a reduction kernel plus a pointwise one (plus the residual add's) instead of one.
    The model's code never branches on T, so dropping those guards hides nothing it depends on.
    """

    def __init__(self, model: nn.Module, cache: CompileCache, counters: CompileCounters) -> None:
        self.model = model
        self.counters = counters
        self.backend = KilnBackend(cache, counters)
        self._forward = None  # torch.compile's wrapper, made for the trace (a warm start never needs it)
        self._code: types.CodeType | None = None  # the code object Dynamo keeps the trace's cache entry on
        # keyed (tokens, requests): a decode's (n, n), a verification of k drafts a request's ((1 + k) r, r)
        self.full_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # None until traced or loaded

    def load_saved(self, every_rank: Callable[[bool], bool] | None = None) -> None:
        """A warm start: the split graph saved in the compile cache, rebuilt with its pieces' artifacts, if the cache
        holds one saved under this very key (else, or if it cannot be rebuilt, the first call traces).

        With tensor-parallel ranks, `every_rank(found)` says whether every rank found its own: where one did not,
        none runs its saved graph and every rank traces (its pieces still load from the cache). Rank 0's start-up
        stats are the engine's, so "no trace, no compile" there then holds for every rank."""
        cache = self.backend.cache
        saved = cache.read_json(SAVED_GRAPH)
        forward = None
        if isinstance(saved, dict) and saved.get("cache_key") == cache.key:
            forward = self._load(saved)
        elif saved is not None:
            # NOTE: a graph saved under another key (a folder copied from another rank's entry, say) was traced for
            # another shard: its pieces would run with that rank's constants (its vocabulary range).
            logger.warning("compile cache: %s was not saved under this key; tracing instead", SAVED_GRAPH)
        if every_rank is not None and not every_rank(forward is not None):
            forward = None
        if forward is None:
            return
        self.run, self.backend.split = forward, forward.split
        pieces = saved["pieces"].values()
        self.counters.compute_pieces = sum("compute" in piece for piece in pieces)
        self.counters.attention_ops = len(pieces) - self.counters.compute_pieces
        self.counters.unique_pieces = self.counters.cache_hits = len({p["compute"] for p in pieces if "compute" in p})

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.run is None:
            return self._trace(input_ids, positions)
        return self.run(input_ids, positions)

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] < 2:
            raise ValueError("the first (tracing) call needs at least 2 tokens: a size of 1 would be specialised")
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        forward = _private_forward(self.model)
        self._code = forward.__code__
        self._forward = torch.compile(
            forward,
            backend=self.backend,
            fullgraph=True,
            options={"guard_filter_fn": _without_shape_guards},
        )
        before = self.counters.inductor_seconds + self.counters.cache_load_seconds
        start = time.perf_counter()
        out = self._forward(input_ids, positions)
        after = self.counters.inductor_seconds + self.counters.cache_load_seconds
        self.counters.dynamo_seconds += time.perf_counter() - start - (after - before)
        saved = self.backend.saved
        if saved is not None:
            self.run = rebuild(
                saved,
                self.model,
                lambda digest, single: CompiledPiece(self.backend.artifacts[digest], single, self.backend.graph_pool),
            )
            self.backend.split = self.run.split
            self.backend.cache.write_text(SAVED_GRAPH, json.dumps({**saved, "cache_key": self.backend.cache.key}))
        else:
            self.run = self._in_dynamo
        return out

    def _in_dynamo(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._forward(input_ids, positions)

    def _load(self, saved: dict) -> SavedForward | None:
        """The saved split graph rebuilt with its pieces' artifacts from the cache; None if any is missing or the
        saved form is not one this code reads."""
        artifacts: dict[str, object] = {}

        def compute_piece(digest: str, single: bool) -> CompiledPiece:
            if digest not in artifacts:
                with self.counters.timed("cache_load_seconds"):
                    artifacts[digest] = self.backend.cache.load(digest)
                if artifacts[digest] is None:
                    raise LookupError(f"the artifact of piece {digest} is missing")
            return CompiledPiece(artifacts[digest], single, self.backend.graph_pool)

        try:
            return rebuild(saved, self.model, compute_piece)
        except Exception as e:  # a stale or damaged cache entry is a miss, never a crash
            logger.warning("compile cache: cannot rebuild the saved forward (%s); tracing it instead", e)
            return None

    # ---- full CUDA graphs (decode-only batches) --------------------------------------------------------

    def capture_full_graph(
        self,
        size: int,
        num_reqs: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        head: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        """Record the whole forward for `size` tokens of `num_reqs` requests, then `head(hidden)` (the runner's LM
        head and greedy argmax) in the same graph. The caller has set a forward context whose metadata lives in
        persistent buffers, and has run every kernel variant this size uses (the runner's warm-up)."""
        graph = torch.cuda.CUDAGraph()
        with self.backend.graph_pool.capture(graph):
            hidden = self(input_ids[:size], positions[:size])
            outputs = (hidden, *(head(hidden) if head is not None else ()))
        self.full_graphs[size, num_reqs] = (graph, weak_ref(outputs))
        self.counters.cudagraphs_captured += 1

    def release_graphs(self) -> None:
        """Drop every CUDA graph, full and piecewise; the model still runs, compiled, without them.

        NOTE: a graph that captured an NCCL collective holds a reference on its communicator, and tearing the
        communicator down (abort or destroy) waits until every such graph is gone: tensor-parallel ranks
        call this before they leave their group."""
        self.full_graphs.clear()
        self.backend.release_graphs()

    def close(self) -> None:
        """Drop the CUDA graphs and Dynamo's cache entry of the trace: its guards hold the model (every weight) and
        outlive this object on a GPU, so a closed engine's memory would stay taken."""
        self.release_graphs()
        if self._code is not None:
            torch._dynamo.reset_code(self._code)
        self._forward = self._code = self.run = None

    def replay_full_graph(self, size: int, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """The hidden states, then the head's outputs, of the graph of `size` tokens and `num_reqs` requests (views
        of the graphs' shared pool: valid until the next replay)."""
        graph, outputs = self.full_graphs[size, num_reqs]
        graph.replay()
        return outputs
