"""The draft chain's passes in CUDA graphs. After an EAGLE-3 or MTP draft's first pass (over the step's kept
tokens: any shape, eager), each of the k - 1 passes after it is one token a decoding request, a fixed shape for a
request count: it replays a graph captured at start-up for the nearest capture size, where an eager pass would
launch each of its kernels one by one (a one-layer draft at batch 1 is launch-bound). Padded requests have one
token of no context whose K/V goes to the scratch block, as in the target's decode graphs.

A graph reads the runner's persistent input buffers (written by `InputWriter.write` before the replay) and the
`hidden` buffer here, and leaves each row's draft token and next state in buffers of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.backends.attention import set_forward_context
from kiln.compile.cudagraph import GraphPool
from kiln.engine.worker.inputs import GraphPlan

if TYPE_CHECKING:
    from kiln.engine.worker.model_runner import ModelRunner


@dataclass
class ChainGraph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, H] the pass's input state
    tokens: torch.Tensor  # [size] its draft tokens
    hidden_out: torch.Tensor  # [size, H] the next pass's state


def chain_sizes(runner: ModelRunner) -> list[int]:
    """The request counts whose chain passes take a graph: the target's full-graph sizes (none without them)."""
    if runner.cudagraph_mode != "full_and_piecewise":
        return []
    return [s for s in runner.capture_sizes if s <= runner.largest_full]


class ChainGraphs:
    def __init__(self, draft, context, runner: ModelRunner, sizes: list[int]) -> None:
        """`context(metadata)`: the draft's forward context (its KV cache) over these inputs."""
        self.draft, self.context, self.runner = draft, context, runner
        self.sizes = sorted(sizes)
        self.graphs: dict[int, ChainGraph] = {}
        self.replays = 0  # chain passes that replayed a graph
        self.pool = GraphPool()
        for size in self.sizes[::-1]:  # (largest first: the smaller ones reuse its pool's memory)
            self.graphs[size] = self._capture(size)
        torch.cuda.synchronize()

    def size_for(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def replay(self, size: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft tokens, next states) of the rows of `hidden` (the inputs written for `size` requests): the
        tokens a copy (the chain keeps them), the states the graph's buffer (read before the next replay)."""
        graph, rows = self.graphs[size], hidden.shape[0]
        graph.hidden[:rows].copy_(hidden)
        graph.graph.replay()
        self.replays += 1
        return graph.tokens[:rows].clone(), graph.hidden_out[:rows]

    @torch.inference_mode()
    def _capture(self, size: int) -> ChainGraph:
        runner = self.runner
        plan = GraphPlan("full", size, size)
        zeros, ones = np.zeros(size, dtype=np.int64), np.ones(size, dtype=np.int64)
        metadata, _ = runner.writer.write(zeros, zeros, ones, [[0]] * size, plan)  # (the scratch block)
        inputs = runner.inputs.views(size, size)
        weight = self.draft.norm.weight
        hidden = torch.zeros(size, weight.shape[0], dtype=weight.dtype, device=weight.device)
        with set_forward_context(self.context(metadata)):
            self._body(inputs, hidden)  # (once uncaptured: every kernel compiled before the capture)
            graph = torch.cuda.CUDAGraph()
            with self.pool.capture(graph):
                tokens, hidden_out = self._body(inputs, hidden)
        return ChainGraph(graph, hidden, tokens, hidden_out)

    def _body(self, inputs, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, hidden_out = self.draft(inputs.input_ids, inputs.positions, hidden)
        return self.draft.draft_tokens(normed), hidden_out
