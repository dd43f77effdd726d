"""The grammar compiles waiting for a compile worker, and the order they get one in.

A compile holds its worker (a thread and its process) for up to its time limit, so who waits behind whom decides
whether one user's slow schemas make another's quick one time out (six 21 KB schemas once failed a one-property
request at 30 s). How long a compile will take is not known before it runs (a 25 KB schema can take 20 s, so can
a 300-byte one), so:

- every compile is tried first in the first-try lane, which gives it FIRST_TRY_S: a compile past that is stopped
  and waits again for a worker of the general lanes, which give it the full time limit; a quick constraint thus
  waits at most FIRST_TRY_S for each compile queued before it, however many slow ones keep the general lanes busy;
- the shortest constraint goes first (ties: first come);
- a compile nobody waits for any more is dropped (`GrammarCache.release`), or its process killed if it runs.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from kiln.engine.sampling_params import StructuredOutputParams

FIRST_TRY_S = 2.0  # a plain schema compiles in well under a second, even for a vocabulary of 150k tokens


@dataclass(eq=False)
class CompileJob:
    params: StructuredOutputParams
    future: Future
    waiters: int = 0  # requests waiting for it (a compile asked for outside a request has none, and is never cancelled)
    running: bool = False  # a worker has it (the cache's lock guards this)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set while it runs: its process is killed
    timed_out: bool = False  # cancelled because its requests ran out of time (not because they left)

    @property
    def key(self) -> tuple[str, str]:
        return self.params.kind, self.params.spec


class CompileQueue:
    """`lock`: the cache's, so whether a job runs and whether it is cancelled change together."""

    def __init__(self, lock: threading.Lock) -> None:
        self._fresh: list[tuple[int, int, CompileJob]] = []  # not tried yet
        self._demoted: list[tuple[int, int, CompileJob]] = []  # past the first try's time: the general lanes' own
        self._order = itertools.count()
        self._ready = threading.Condition(lock)
        self._closed = False

    def put(self, job: CompileJob) -> None:
        """(With the lock held.)"""
        heapq.heappush(self._fresh, (len(job.params.spec), next(self._order), job))
        self._ready.notify_all()

    def demote(self, job: CompileJob) -> bool:
        """A compile past its first try waits for a general lane; False if nobody waits for it any more."""
        with self._ready:
            job.running = False
            if job.cancelled.is_set() or self._closed:
                return False
            heapq.heappush(self._demoted, (len(job.params.spec), next(self._order), job))
            self._ready.notify_all()
            return True

    def take(self, first_try: bool) -> CompileJob | None:
        """The next compile for a worker of the first-try lane or of a general one (compiles past their first try,
        then the others), marked running; None once the queue is closed."""
        with self._ready:
            while True:
                if self._closed:
                    return None
                for heap in (self._fresh,) if first_try else (self._demoted, self._fresh):
                    while heap and (heap[0][2].future.done() or heap[0][2].cancelled.is_set()):
                        heapq.heappop(heap)
                    if heap:
                        job = heapq.heappop(heap)[2]
                        job.running = True
                        return job
                self._ready.wait()

    def close(self) -> None:
        """Workers take nothing more; the compiles still queued are cancelled."""
        with self._ready:
            self._closed = True
            for _, _, job in self._fresh + self._demoted:
                job.future.cancel()
            self._ready.notify_all()
