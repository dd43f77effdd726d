"""A tensor-parallel worker process (rank r of `tensor_parallel`): it joins the group, builds its rank's executor,
then runs each step rank 0 announces, until rank 0 says stop or is gone."""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kiln.backends.attention import AttentionMetadata
from kiln.engine.core.tensor_parallel import (
    COLLECTIVE_TIMEOUT,
    SHUTDOWN,
    STARTUP_TIMEOUT,
    StepHeader,
    _backend,
    cpu_threads_per_rank,
    leave_group,
    step_tensors,
)
from kiln.engine.worker.inputs import GraphPlan

if TYPE_CHECKING:
    from kiln.engine.config import EngineConfig
    from kiln.engine.worker.model_runner import ModelRunner


def worker_main(config: EngineConfig, rank: int, port: int, pipe: multiprocessing.connection.Connection) -> None:
    """A worker process: join the group, build this rank's executor, then run rank 0's steps."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-worker-{rank}: %(message)s")
    # Ctrl-C and SIGHUP reach the whole process group; rank 0 decides when workers stop (and its exit ends them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from kiln.engine.core.startup import build_executor, resolve_device  # noqa: PLC0415  (startup imports this module)

    device = resolve_device(config)
    if device.type == "cuda":
        torch.cuda.set_device((device.index or 0) + rank)
    else:
        torch.set_num_threads(cpu_threads_per_rank(config.tensor_parallel_size))
    store = dist.TCPStore(
        "127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT)
    )
    pipe.send_bytes(b"joining")
    dist.init_process_group(
        _backend(device), store=store, rank=rank, world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT
    )
    executor = None
    try:
        executor = build_executor(config, rank)
        serve_steps(executor.runner, pipe)
    finally:
        if executor is not None and executor.compiled is not None:
            executor.compiled.release_graphs()
        leave_group()


def serve_steps(runner: ModelRunner, pipe: multiprocessing.connection.Connection) -> None:
    """Run rank 0's steps until it says stop or its end of the pipe closes (rank 0 is gone)."""
    while True:
        try:
            header = StepHeader.decode(pipe.recv_bytes())
        except EOFError:
            return
        if header.mode == SHUTDOWN:
            return
        with torch.inference_mode():
            run_step(runner, header)


def run_step(runner: ModelRunner, header: StepHeader) -> None:
    for tensor in step_tensors(runner, header):
        dist.broadcast(tensor, src=0)
    inputs = runner.inputs.views(header.num_tokens, header.num_reqs)
    metadata = AttentionMetadata(
        num_actual_tokens=header.num_actual_tokens,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        block_table=inputs.block_table,
        slot_mapping=inputs.slot_mapping[..., : header.num_actual_tokens],
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        query_start_loc_cpu=torch.tensor(header.query_start_loc, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(header.seq_lens, dtype=torch.int32),
        state_slots=inputs.state_slots,
        state_slots_cpu=inputs.state_slots.cpu(),
    )
    if runner.inputs.num_groups > 1:
        metadata = metadata.with_groups(inputs.block_table, metadata.slot_mapping)
    before, after = header.state_copies
    runner.copy_states([tuple(pair) for pair in before])
    hidden, head = runner.forward(metadata, GraphPlan(header.mode, header.num_tokens, header.num_reqs))
    runner.copy_states([tuple(pair) for pair in after])
    if header.logits_indices is not None and head is None:  # a full graph ran the LM head (and its gather) itself
        rows = torch.tensor(header.logits_indices, dtype=torch.int64, device=runner.device)
        runner.model.compute_logits(hidden[rows])  # joins the LM head's all-gather; rank 0 samples
    for start, end in header.prompt_logit_rows:  # rank 0's prompt logprobs, slice by slice
        runner.model.compute_logits(hidden[start:end])
