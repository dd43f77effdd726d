"""A tensor-parallel worker process (rank r of `tensor_parallel`): it joins the group, builds its rank's executor,
then runs each step rank 0 announces, until rank 0 says stop or is gone."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing.connection
import signal
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kiln.backends.attention import AttentionMetadata
from kiln.engine.core.resolve import resolve_device
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


def worker_main(
    config: EngineConfig,
    rank: int,
    host: str,
    port: int,
    local_index: int,
    pipe: multiprocessing.connection.Connection | None = None,
) -> None:
    """A worker process: join the group whose store is at `host:port`, build this rank's executor, then run rank 0's
    steps. `local_index`: this rank's GPU among those visible here. `pipe`: rank 0's end for headers, when rank 0
    started this process; a rank started elsewhere (another node, a Ray actor) connects back for them."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-worker-{rank}: %(message)s")
    # Ctrl-C and SIGHUP reach the whole process group; rank 0 decides when workers stop (and its exit ends them).
    with contextlib.suppress(ValueError):  # (a Ray actor's method runs off the main thread: it has no say)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from kiln.engine.core.startup import build_executor, freeze_startup_objects  # noqa: PLC0415  (startup imports this module)

    device = resolve_device(config)
    size = config.tensor_parallel_size
    if device.type == "cuda":
        torch.cuda.set_device((device.index or 0) + local_index)
    else:
        torch.set_num_threads(cpu_threads_per_rank(max(1, size // config.nnodes)))  # (the ranks on this node)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT))
    if pipe is None:
        address, key = store.get("kiln/header_address").decode(), bytes.fromhex(store.get("kiln/header_key").decode())
        header_host, header_port = address.rsplit(":", 1)
        pipe = multiprocessing.connection.Client((header_host, int(header_port)), authkey=key)
    pipe.send_bytes(f"joining {rank}".encode())
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    executor = None
    try:
        executor = build_executor(config, rank)
        freeze_startup_objects()
        serve_steps(executor.runner, pipe)
    finally:
        gc.unfreeze()  # (else the libraries' objects go unfreed at exit, and some of them complain of it)
        if executor is not None and executor.compiled is not None:
            executor.compiled.release_graphs()
        leave_group()
        pipe.close()  # (rank 0 of another node sees this rank gone)


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
        state_folds=inputs.state_folds,
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
