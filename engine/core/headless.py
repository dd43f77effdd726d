"""`kiln serve --headless`: a node of `--nnodes` that runs tensor-parallel ranks only (vLLM's name). Node r of M
runs ranks r*N/M .. (r+1)*N/M - 1 of N; each joins rank 0's store at --master-addr:--master-port (node 0's
`kiln serve`, which runs the engine core and the API server) and connects back to rank 0 for its step headers.

The ranks exit when rank 0 says stop or is gone; this process exits when they have, with a failing rank's code.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.connection
import signal

import torch.multiprocessing as mp

from kiln.engine.config import EngineConfig
from kiln.engine.core.tensor_parallel_worker import worker_main

logger = logging.getLogger("kiln")


def run_headless(config: EngineConfig) -> int:
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError("--headless runs node 1.. of --nnodes N (node 0 runs the engine core and the API server)")
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s kiln-headless: %(message)s")
    spawn = mp.get_context("spawn")
    processes = []
    for index in range(per_node):
        rank = first + index
        args = (config, rank, config.master_addr, config.master_port, index)
        processes.append(spawn.Process(target=_rank_main, args=args, name=f"kiln-tp-worker-{rank}"))
    for process in processes:
        process.start()
    logger.info(
        "node %d of %d: tensor-parallel ranks %d..%d joining %s:%d",
        config.node_rank,
        config.nnodes,
        first,
        first + per_node - 1,
        config.master_addr,
        config.master_port,
    )

    def stop(signum, frame) -> None:
        for process in processes:
            process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    waiting = {process.sentinel: process for process in processes}
    code = 0
    while waiting:
        for sentinel in multiprocessing.connection.wait(list(waiting)):
            process = waiting.pop(sentinel)
            process.join()
            if process.exitcode:
                logger.error("%s exited with code %s", process.name, process.exitcode)
                code = code or 1
    logger.info("node %d: every rank has exited", config.node_rank)
    return code


def _rank_main(config: EngineConfig, rank: int, host: str, port: int, local_index: int) -> None:
    # NOTE: a rank outlives a killed headless process unless told to die with it (Linux's parent-death signal): a
    # node that is gone must take its ranks with it, so rank 0 fails instead of serving with a rank nobody owns
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    worker_main(config, rank, host, port, local_index)
