"""The API server's per-request plumbing without processes: the inbox the engine's outputs land in, and the
merging of outputs that queued up behind a slow reader."""

from __future__ import annotations

import asyncio

from kiln.engine import protocol
from kiln.engine.async_client import EngineDeadError, Inbox
from kiln.engine.responses import next_items


def test_inbox_hands_over_everything_waiting_in_order():
    async def scenario():
        inbox = Inbox()
        taker = asyncio.create_task(inbox.take_all())
        await asyncio.sleep(0)
        assert not taker.done()  # nothing yet: it waits
        inbox.put(1)
        inbox.put(2)
        assert await taker == [1, 2]
        inbox.put(3)
        assert await inbox.take_all() == [3]  # already there: no wait
        cancelled = asyncio.create_task(inbox.take_all())
        await asyncio.sleep(0)
        cancelled.cancel()  # a handler that goes away while waiting
        await asyncio.gather(cancelled, return_exceptions=True)
        assert inbox.waiter is None
        inbox.put(4)
        assert await inbox.take_all() == [4]

    asyncio.run(scenario())


def test_outputs_queued_behind_a_slow_reader_are_joined():
    def out(rid, ids, lp=None, finish=None, stop=None):
        return protocol.RequestOutput(rid, ids, lp, finish, stop)

    async def scenario():
        inbox = Inbox()
        items = [out("a", [1], [[[1, -0.5, 1]]]), out("b", [7]), out("a", [2], [[[2, -1.0, 1]]]),
                 out("a", [3], [[[3, -0.1, 1]]], "stop", 3), out("b", [8])]  # fmt: skip
        for item in items:
            inbox.put(item)
        merged = await next_items(inbox)
        assert merged == [out("a", [1, 2, 3], [[[1, -0.5, 1]], [[2, -1.0, 1]], [[3, -0.1, 1]]], "stop", 3),
                          out("b", [7, 8])]  # fmt: skip
        # an error is a barrier: what came before it is applied first, nothing is joined across it
        error = EngineDeadError("gone")
        for item in (out("a", [4]), error, out("a", [5])):
            inbox.put(item)
        assert await next_items(inbox) == [out("a", [4]), error, out("a", [5])]

    asyncio.run(scenario())
