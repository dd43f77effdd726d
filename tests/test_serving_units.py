"""The API server's per-request plumbing without processes: the inbox the engine's outputs land in, the
merging of outputs that queued up behind a slow reader, and the JSON of the streamed chunks."""

from __future__ import annotations

import asyncio
import json

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


def test_stream_chunks_are_valid_json_with_any_text():
    """The SSE chunks are assembled from text templates: each must parse, with the delta text intact (quotes,
    backslashes, newlines, control characters, non-ASCII) and every field of OpenAI's chunk shape."""
    from types import SimpleNamespace

    from kiln.engine.responses import Choice, _events

    pieces = ['say "hi"\\n', "back\\slash\nnew line\t", "\x00\x1f ctrl", "naïve — 漢字 🙂", ""]

    class Text:  # stands in for the detokenizing TextStream: token i decodes to pieces[i]
        def update(self, token_ids, finished):
            return "".join(pieces[t] for t in token_ids), None

    state = SimpleNamespace(served_model_name='m "quoted"', metrics=SimpleNamespace(inter_token=lambda *a: None),
                            client=SimpleNamespace(abort=lambda ids: None))  # fmt: skip
    for chat in (False, True):
        choices = {"r": Choice(0, "r", [1, 2], Text())}
        parsed = SimpleNamespace(include_usage=True, echo=False, logprobs=None, params=SimpleNamespace(n=1))

        async def scenario(parsed=parsed, choices=choices, chat=chat):
            inbox = Inbox()
            for i in range(len(pieces)):
                inbox.put(protocol.RequestOutput("r", [i], None, "length" if i == len(pieces) - 1 else None))
            return [c async for c in _events(state, parsed, choices, inbox, "cmpl-1", 1700000000, chat, [None])]

        chunks = [json.loads(c) for c in asyncio.run(scenario())]
        for c in chunks:
            assert (c["id"], c["created"], c["model"]) == ("cmpl-1", 1700000000, 'm "quoted"')
            assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        if chat:
            assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]  # fmt: skip
            body = chunks[1:-1]
            text = "".join(ch["delta"].get("content", "") for c in body for ch in c["choices"])
        else:
            body = chunks[:-1]
            text = "".join(ch["text"] for c in body for ch in c["choices"])
        assert text == "".join(pieces)
        assert body[-1]["choices"][0]["finish_reason"] == "length" and body[-1]["usage"] is None
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 2, "completion_tokens": len(pieces), "total_tokens": 2 + len(pieces)}
