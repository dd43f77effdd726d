"""The engine core as its own process: a busy loop over `EngineCore.step()`, fed and drained by two IO
threads so the GPU loop never waits on a socket (and a slow socket never waits on the GPU).

    API server --PUSH--> [input socket] -> input thread -> queue -> busy loop -> queue -> output thread
               <--PULL-- [output socket] <----------------------------------------------+

The API server starts it as a program of its own (`python -m kiln.engine.core`, `kiln.engine.serving.engine_client`)
and writes its `messages.EngineCoreArgs` to its standard input: the two processes share no code but the messages.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import fields
from typing import Any

import zmq

from kiln.engine import messages
from kiln.engine.core.engine_core import EngineCore
from kiln.engine.core.kv_event_publisher import KVEventPublisher
from kiln.engine.core.startup import freeze_startup_objects
from kiln.engine.core.tensor_parallel import WorkerDiedError
from kiln.engine.kv_events_config import KVEventsConfig
from kiln.engine.sampling_params import SamplingParams

logger = logging.getLogger("kiln")

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
LOG_INTERVAL = 10.0  # seconds between the periodic lines


def main() -> None:
    """Entry point of the engine-core process. Sends `Ready` (or `StartupFailed`, with the reason in a line)."""
    # NOTE: SIGHUP is the API server's (it reloads --api-keys-file); one sent to the whole process group must
    # not kill the engine under a server that lives on. Without the server the engine stops by itself.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    args = messages.EngineCoreArgs.from_json(sys.stdin.read())
    name = "engine-core" if args.data_parallel_rank == 0 else f"engine-core-{args.data_parallel_rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    context = zmq.Context()
    inputs: queue.Queue = queue.Queue()
    outputs: queue.Queue = queue.Queue()
    output_thread = threading.Thread(target=_output_thread, args=(context, args.output_address, outputs), daemon=True)
    output_thread.start()
    core = None
    try:
        config = args.engine_config()
        core = EngineCore(config)
        kv_events = _kv_event_publisher(core, config.kv_events_config, args.data_parallel_rank)
    except (ValueError, FileNotFoundError, NotADirectoryError, TypeError) as e:
        # a bad model or setting: the server says it in a line and exits, as `kiln generate` does
        if core is not None:
            core.close()
        outputs.put(messages.StartupFailed(f"{e}"))
        outputs.put(None)
        output_thread.join()
        sys.exit(2)
    freeze_startup_objects()  # (this process's engine lives as long as the process; close() on the way out)
    threading.Thread(target=_input_thread, args=(context, args.input_address, inputs), daemon=True).start()
    ready = messages.Ready(
        core.max_model_len,
        core.model_config.vocab_size,
        core.num_kv_blocks,
        core.tokenizer_class,
        _jsonable(core.startup_stats),
        _stats(core),
    )
    outputs.put(ready)
    threading.Thread(target=_heartbeat, args=(outputs,), daemon=True).start()
    try:
        _busy_loop(core, inputs, outputs, args.parent_pid, kv_events)
    except WorkerDiedError as e:  # (the API server's /health says why, not only this log)
        outputs.put(messages.EngineFailed(str(e)))
        raise
    finally:
        core.close()  # tensor-parallel workers
        if kv_events is not None:
            kv_events.close()
        outputs.put(None)
        output_thread.join(timeout=5)
    if os.getppid() != args.parent_pid:  # the server died without cleaning up: its IPC folder would stay behind
        _remove_ipc_folder(args.input_address, args.output_address)
    logger.info("engine core stopped")


def _heartbeat(outputs: queue.Queue) -> None:
    """A word each second however long a step takes (the server's watchdog waits for one)."""
    while True:
        time.sleep(1.0)
        outputs.put(messages.Alive())


def _remove_ipc_folder(*addresses: str) -> None:
    paths = [address.removeprefix("ipc://") for address in addresses]
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(paths[0]))


def _kv_event_publisher(core: EngineCore, config: KVEventsConfig | None, rank: int) -> KVEventPublisher | None:
    if config is None or not config.enabled:
        return None
    return KVEventPublisher(config, core.kv_cache_manager.block_pool.record_kv_events(), rank)


def _busy_loop(
    core: EngineCore,
    inputs: queue.Queue,
    outputs: queue.Queue,
    parent_pid: int,
    kv_events: KVEventPublisher | None = None,
) -> None:
    last_sent = last_logged = time.monotonic()
    speculation = (0, 0, 0)
    while True:
        if core.scheduler.drafter is not None and time.monotonic() - last_logged > LOG_INTERVAL:
            speculation, last_logged = _log_speculation(core, speculation), time.monotonic()
        failed: list[messages.RequestFailed] = []
        handled = False
        block = not core.has_unfinished_requests()
        while True:
            try:
                message = inputs.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                if os.getppid() != parent_pid:  # the API server is gone: nobody to serve
                    return
                if block:  # idle: a heartbeat, so the server can tell an idle engine from a stuck one
                    if core.executor.tp_workers is not None:  # (a rank gone while idle ends the engine now)
                        core.executor.tp_workers.check_alive()
                    outputs.put(messages.EngineOutputs([], [], _stats(core)))
                    continue
                break
            block = False
            if isinstance(message, messages.Shutdown):
                return
            _handle(core, message, failed)
            handled = True
        # NOTE: a dead tensor-parallel worker raises out of here: the process exits and the server sees it die
        step = core.step(isolate_failures=True)
        step.failed = failed + step.failed
        if kv_events is not None:  # (an abort alone may uncache blocks: its step's events too)
            kv_events.flush()
        # An abort alone changes what /metrics shows, and the stats are sent at least each second between steps
        if step.outputs or step.failed or handled or time.monotonic() - last_sent > 1.0:
            step.stats = _stats(core)
            outputs.put(step)
            last_sent = time.monotonic()


def _handle(core: EngineCore, message: Any, failed: list[messages.RequestFailed]) -> None:
    if isinstance(message, messages.AbortRequests):
        core.abort_requests(message.request_ids)
    elif isinstance(message, messages.AddRequest):
        try:
            params = SamplingParams(**{k: v for k, v in message.params.items() if k in _PARAM_FIELDS})
            core.add_request(message.request_id, message.prompt_token_ids, params)
        except (ValueError, TypeError) as e:
            failed.append(messages.RequestFailed(message.request_id, str(e)))


def _stats(core: EngineCore) -> dict[str, float]:
    kv = core.kv_cache_manager
    waiting = len(core.scheduler.waiting) + len(core.grammar_admission.waiting)  # compiling a grammar is waiting too
    return {
        "running": len(core.scheduler.running),
        "waiting": waiting,
        "kv_usage": kv.usage,
        "free_blocks": kv.num_free_blocks,
        "prefix_queries": kv.prefix_cache_queries,
        "prefix_hits": kv.prefix_cache_hits,
        "preemptions": core.scheduler.num_preemptions,
        # speculative decoding: request-steps that verified drafts, the drafts, those kept (0 without)
        "spec_drafts": core.scheduler.num_spec_steps,
        "spec_draft_tokens": core.scheduler.num_draft_tokens,
        "spec_accepted_tokens": core.scheduler.num_accepted_tokens,
    }


def _log_speculation(core: EngineCore, last: tuple[int, int, int]) -> tuple[int, int, int]:
    """The periodic line of speculative decoding since the last one: acceptance and mean accepted length."""
    scheduler = core.scheduler
    now = (scheduler.num_spec_steps, scheduler.num_draft_tokens, scheduler.num_accepted_tokens)
    steps, drafted, accepted = (a - b for a, b in zip(now, last))
    if steps:
        logger.info(
            "speculative decoding: %d drafts, %.1f%% of %d draft tokens accepted, mean accepted length %.2f",
            steps,
            100.0 * accepted / max(drafted, 1),
            drafted,
            1.0 + accepted / steps,
        )
    return now


def _input_thread(context: zmq.Context, address: str, inputs: queue.Queue) -> None:
    socket = context.socket(zmq.PULL)
    socket.bind(address)
    while True:
        frame = socket.recv()
        try:
            inputs.put(messages.decode(frame))
        except messages.ProtocolError as e:
            logger.warning("dropped a frame on the input socket: %s", e)


def _output_thread(context: zmq.Context, address: str, outputs: queue.Queue) -> None:
    socket = context.socket(zmq.PUSH)
    socket.bind(address)
    while (message := outputs.get()) is not None:
        socket.send(messages.encode(message))
    socket.close(linger=1000)


def _jsonable(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if isinstance(v, int | float | str | type(None))}
