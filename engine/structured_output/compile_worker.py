"""A grammar compiled for the engine's tokenizer in a process of its own, which is killed when the compile runs past
its time limit: xgrammar's compile of a hostile constraint can run for minutes, and a thread cannot be stopped, so a
compile on a thread would hold its share of the engine's compile capacity (and a CPU) long after its request failed.

The engine side (`CompileProcess`) hands the worker xgrammar's tokenizer info once, as JSON, then one constraint at a
time; the worker answers with the compiled grammar serialized (xgrammar's own JSON form), which the engine turns back
into a `CompiledGrammar` for its matchers. The worker is started with `python -c` rather than `multiprocessing`, so an
offline script without a `__main__` guard is never imported again in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from kiln.engine.sampling_params import StructuredOutputParams
from kiln.engine.structured_output.constraints import WHAT, GrammarError

START_TIMEOUT_S = 120.0
CANCEL_POLL_S = 0.05  # how soon a cancelled compile's process is killed
# NOTE: nice 10 before any import (xgrammar's takes ~4 s of CPU, and cancelled compiles' processes are replaced
# often), set outright: the engine's thread that starts it runs at nice 10 already
_LAUNCH = (
    "import os; os.setpriority(os.PRIO_PROCESS, 0, 10); "
    "from kiln.engine.structured_output.compile_worker import main; main()"
)


class CompileCancelled(Exception):
    """Nobody waits for the compile any more; its process was killed."""


class CompileTimedOut(GrammarError):
    """The compile ran past its time limit; its process was killed."""


class CompileProcess:
    """One worker process compiling grammars for one tokenizer, one at a time."""

    def __init__(self, tokenizer_info_json: str) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(tokenizer_info_json.encode())
        # its start (xgrammar's import, the tokenizer read back) is not part of any compile's time limit
        try:
            if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv_bytes() != b"ready":
                raise EOFError
        except (EOFError, OSError):
            self.kill()
            raise GrammarError("internal error: the grammar compiler's process did not start") from None

    def compile(
        self, params: StructuredOutputParams, timeout_s: float, max_bytes: int, cancelled: threading.Event
    ) -> str:
        """`params` compiled, as xgrammar's JSON of a `CompiledGrammar`. Raises `GrammarError` if the constraint
        cannot be compiled or its JSON would be longer than `max_bytes`, `CompileTimedOut` if the compile runs past
        `timeout_s`, `CompileCancelled` once `cancelled` is set (in those two cases this process is killed: start
        another)."""
        deadline = time.monotonic() + timeout_s
        try:
            self.conn.send((dataclasses.asdict(params), max_bytes))
            while not self.conn.poll(min(CANCEL_POLL_S, max(deadline - time.monotonic(), 0.0))):
                if cancelled.is_set():
                    self.kill()
                    raise CompileCancelled
                if time.monotonic() >= deadline:
                    self.kill()
                    raise CompileTimedOut(f"compiling the {WHAT[params.kind]} took longer than {timeout_s:g} s")
            compiled, problem = self.conn.recv()
        except (EOFError, OSError):  # it died (out of memory, say): its request fails, and the next gets a new one
            self.kill()
            raise GrammarError("internal error: the grammar compiler's process ended during the compile") from None
        if problem is not None:
            raise GrammarError(problem)
        return compiled

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not self.conn.closed

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        self.conn.close()


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when the engine thread that started it ends (or the engine does)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above: nobody is left to ask for anything
        sys.exit(0)


def _serve(conn: Connection) -> None:
    import xgrammar as xgr  # noqa: PLC0415

    from kiln.engine.structured_output.constraints import xgrammar_errors, xgrammar_grammar  # noqa: PLC0415

    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the engine keeps the only cache
    conn.send_bytes(b"ready")
    while True:
        try:
            fields, max_bytes = conn.recv()
            params = StructuredOutputParams(**fields)
        except EOFError:  # the engine is gone
            return
        try:
            with xgrammar_errors(params):
                compiled = compiler.compile_grammar(xgrammar_grammar(params)).serialize_json()
            if len(compiled) > max_bytes:  # NOTE: refused here, the engine never reads it back (a peak of several x)
                raise GrammarError(
                    f"the {WHAT[params.kind]} compiles to a grammar of {len(compiled) / 2**20:.0f} MiB; this server "
                    f"takes at most {max_bytes / 2**20:.0f} MiB"
                )
            conn.send((compiled, None))
        except GrammarError as e:
            conn.send((None, str(e)))
        except Exception as e:  # a bug, not the constraint's fault: still only its requests fail
            conn.send((None, f"internal error while compiling the grammar: {type(e).__name__}: {e}"))


def main() -> None:
    """The worker (at nice 10: a compile yields the CPU to the engine's loop and the API server)."""
    _die_with_parent(int(sys.argv[2]))
    _serve(Connection(int(sys.argv[1])))
