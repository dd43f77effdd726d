"""What goes into and comes out of a model-runner step: the persistent input buffers and their pinned host
mirrors, the graph plan of a step, the handle of a launched step, and its output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.outputs import Logprob
from kiln.engine.sampler import LogprobsTensors
from kiln.engine.scheduler import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[int | None]  # per scheduled request; None where its prefill is still partial
    logprobs: list[dict[int, Logprob] | None]


@dataclass
class StepHandle:
    """A launched step. Its sampled tokens stay on the device (the next step's inputs read them
    there); their copy to the host is in flight until `done`."""

    batch: SchedulerOutput
    sample_rows: list[int]
    sampled_cpu: torch.Tensor | None = None  # [S] int64, valid once `done` has fired
    logprobs_cpu: LogprobsTensors | None = None
    done: torch.cuda.Event | None = None
    gpu_start: torch.cuda.Event | None = None  # with `time_gpu`: the step's device time
    gpu_seconds: float | None = None


MAX_PREFIXES = 1024  # prefix views kept a buffer: without CUDA graphs every token count is a size of its own


class StagedBuffer:
    """A persistent device buffer (fixed address, as graph replay needs) fed from pinned host mirrors.

    Two mirrors alternate from step to step, so the host fills step N+1's while step N's copy may
    still be queued behind step N-1 on the GPU; the runner's fences say when a mirror's copy is done.
    """

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        self.gpu = torch.zeros(*shape, dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.host = [torch.zeros(*shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.np = [h.numpy() for h in self.host]
        # NOTE: slicing a tensor costs ~3 µs of host time, and a step takes a dozen prefixes of these buffers;
        # the views never change (the buffers are never reallocated), so each is kept for the next step
        self._prefixes: dict[tuple[int, int], torch.Tensor] = {}

    def prefix(self, n: int, parity: int = -1) -> torch.Tensor:
        """`gpu[:n]`, or with a parity that mirror's `host[parity][:n]`."""
        view = self._prefixes.get((parity, n))
        if view is None:
            if len(self._prefixes) >= MAX_PREFIXES:
                self._prefixes.clear()
            view = self._prefixes[(parity, n)] = (self.gpu if parity < 0 else self.host[parity])[:n]
        return view

    def copy(self, parity: int, n: int) -> None:
        self.prefix(n).copy_(self.prefix(n, parity), non_blocking=True)


@dataclass(frozen=True)
class GraphPlan:
    mode: str  # "full", "piecewise" or "none"
    num_tokens: int  # padded token count (the capture size for graphs)
    num_reqs: int  # padded request count (a full graph pads requests too)


def logprob_dicts(tensors, requests) -> list[dict[int, Logprob] | None]:
    """vLLM's shape: for each row, {token id: Logprob} with the sampled token and the row's top-N."""
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    rows: list[dict[int, Logprob] | None] = []
    for j, request in enumerate(requests):
        num = request.sampling_params.logprobs
        if num is None:
            rows.append(None)
            continue
        entry = {ids[j][0]: Logprob(values[j][0], ranks[j])}
        for k in range(1, num + 1):
            entry.setdefault(ids[j][k], Logprob(values[j][k], k))
        rows.append(entry)
    return rows
