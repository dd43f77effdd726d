"""The engine core as its own process: a busy loop over `EngineCore.step()`, fed and drained by two IO
threads so the GPU loop never waits on a socket (and a slow socket never waits on the GPU).

    API server --PUSH--> [input socket] -> input thread -> queue -> busy loop -> queue -> output thread
               <--PULL-- [output socket] <----------------------------------------------+
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, fields
from typing import Any

import zmq

from kiln.engine import messages
from kiln.engine.config import EngineConfig
from kiln.engine.core.engine_core import EngineCore, EngineCoreOutput
from kiln.engine.core.tensor_parallel import WorkerDiedError
from kiln.engine.sampling_params import SamplingParams

logger = logging.getLogger("kiln")

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


def run_engine_core(config: dict[str, Any], input_address: str, output_address: str, parent_pid: int) -> None:
    """Entry point of the engine-core process. Sends `Ready` (or dies with the reason on stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    # NOTE: SIGHUP is the API server's (it reloads --api-keys-file); one sent to the whole process group must
    # not kill the engine under a server that lives on. Without the server the engine stops by itself.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    context = zmq.Context()
    inputs: queue.Queue = queue.Queue()
    outputs: queue.Queue = queue.Queue()
    output_thread = threading.Thread(target=_output_thread, args=(context, output_address, outputs), daemon=True)
    output_thread.start()
    try:
        core = EngineCore(EngineConfig(**config))
    except (ValueError, FileNotFoundError, NotADirectoryError, TypeError) as e:
        # a bad model or setting: the server says it in a line and exits, as `kiln generate` does
        outputs.put(messages.StartupFailed(f"{e}"))
        outputs.put(None)
        output_thread.join()
        sys.exit(2)
    threading.Thread(target=_input_thread, args=(context, input_address, inputs), daemon=True).start()
    outputs.put(messages.Ready(core.max_model_len, core.model_config.vocab_size, core.num_kv_blocks,
                               _jsonable(core.startup_stats), _stats(core)))  # fmt: skip
    try:
        _busy_loop(core, inputs, outputs, parent_pid)
    finally:
        core.close()  # tensor-parallel workers
    outputs.put(None)
    logger.info("engine core stopped")


def _busy_loop(core: EngineCore, inputs: queue.Queue, outputs: queue.Queue, parent_pid: int) -> None:
    last_sent = time.monotonic()
    while True:
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
                    outputs.put(messages.EngineOutputs([], [], _stats(core)))
                    continue
                break
            block = False
            if isinstance(message, messages.Shutdown):
                return
            _handle(core, message, failed)
            handled = True
        step_outputs = _step(core, failed)
        # An abort alone changes what /metrics shows; and a long prefill with nothing to emit still
        # sends a word each second, so the server never mistakes a busy engine for a stuck one.
        if step_outputs or failed or handled or time.monotonic() - last_sent > 1.0:
            outputs.put(messages.EngineOutputs([_to_wire(o) for o in step_outputs], failed, _stats(core)))
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


def _step(core: EngineCore, failed: list[messages.RequestFailed]) -> list[EngineCoreOutput]:
    try:
        outputs = core.step(isolate_failures=True)
    except WorkerDiedError:
        raise  # no request's fault and no step can run: the engine core exits and the server sees it die
    except Exception:
        # NOTE: not one request's fault (isolation found none): fail what was running, keep serving.
        logger.error("step failed:\n%s", traceback.format_exc())
        victims = [r.request_id for r in core.scheduler.running]
        for rid in victims:
            core.kv_cache_manager.uncache(rid)
        core.abort_requests(victims)
        core.failed_requests += [(rid, "internal error while running the request") for rid in victims]
        outputs = []
    failed.extend(messages.RequestFailed(rid, message) for rid, message in core.failed_requests)
    core.failed_requests.clear()
    return outputs


def _to_wire(out: EngineCoreOutput) -> tuple:
    """A messages.RequestOutput as the tuple of its fields (what goes on the wire, without the dataclass)."""
    logprobs = None
    if out.new_logprobs is not None:
        logprobs = [[[tid, lp.logprob, lp.rank] for tid, lp in entry.items()] for entry in out.new_logprobs]
    return out.request_id, out.new_token_ids, logprobs, out.finish_reason, out.stop_reason, out.num_cached_tokens


def _stats(core: EngineCore) -> dict[str, float]:
    kv = core.kv_cache_manager
    waiting = len(core.scheduler.waiting) + len(core.grammar_admission.waiting)  # compiling a grammar is waiting too
    return {"running": len(core.scheduler.running), "waiting": waiting, "kv_usage": kv.usage,
            "free_blocks": kv.num_free_blocks, "prefix_queries": kv.prefix_cache_queries,
            "prefix_hits": kv.prefix_cache_hits, "preemptions": core.scheduler.num_preemptions}  # fmt: skip


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


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    return asdict(config)
