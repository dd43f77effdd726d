"""The API server's per-request plumbing without processes: the inbox the engine's outputs land in, the
merging of outputs that queued up behind a slow reader, the JSON of the streamed chunks, and chat messages
through the tokenizer's template."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from transformers import AutoTokenizer

from kiln.engine import messages
from kiln.engine.serving.completion import ServerState, encode_chat
from kiln.engine.serving.engine_client import EngineDeadError, Inbox
from kiln.engine.serving.openai_requests import APIError, parse_chat
from kiln.engine.serving.responses import next_items


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
        return messages.EngineCoreOutput(rid, ids, lp, finish, stop)

    async def scenario():
        inbox = Inbox()
        items = [
            out("a", [1], [[[1, -0.5, 1]]]),
            out("b", [7]),
            out("a", [2], [[[2, -1.0, 1]]]),
            out("a", [3], [[[3, -0.1, 1]]], "stop", 3),
            out("b", [8]),
        ]
        for item in items:
            inbox.put(item)
        merged = await next_items(inbox)
        assert merged == [
            out("a", [1, 2, 3], [[[1, -0.5, 1]], [[2, -1.0, 1]], [[3, -0.1, 1]]], "stop", 3),
            out("b", [7, 8]),
        ]
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

    from kiln.engine.serving.responses import Choice, _events

    pieces = ['say "hi"\\n', "back\\slash\nnew line\t", "\x00\x1f ctrl", "naïve — 漢字 🙂", ""]

    class Text:  # stands in for the detokenizing TextStream: token i decodes to pieces[i]
        def update(self, token_ids, finished, stop_token=False):
            return "".join(pieces[t] for t in token_ids), None

    state = SimpleNamespace(
        served_model_name='m "quoted"',
        metrics=SimpleNamespace(inter_token=lambda *a: None),
        client=SimpleNamespace(abort=lambda ids: None),
    )
    for chat in (False, True):
        choices = {"r": Choice(0, "r", [1, 2], Text())}
        parsed = SimpleNamespace(
            include_usage=True, echo=False, logprobs=None, prompt_only=False, params=SimpleNamespace(n=1)
        )

        async def scenario(parsed=parsed, choices=choices, chat=chat):
            inbox = Inbox()
            for i in range(len(pieces)):
                inbox.put(messages.EngineCoreOutput("r", [i], None, "length" if i == len(pieces) - 1 else None))
            return [c async for c in _events(state, parsed, choices, inbox, "cmpl-1", 1700000000, chat, [None])]

        chunks = [json.loads(c) for c in asyncio.run(scenario())]
        for c in chunks:
            assert (c["id"], c["created"], c["model"]) == ("cmpl-1", 1700000000, 'm "quoted"')
            assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        if chat:
            assert chunks[0]["choices"] == [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ]
            body = chunks[1:-1]
            text = "".join(ch["delta"].get("content", "") for c in body for ch in c["choices"])
        else:
            body = chunks[:-1]
            text = "".join(ch["text"] for c in body for ch in c["choices"])
        assert text == "".join(pieces)
        assert body[-1]["choices"][0]["finish_reason"] == "length" and body[-1]["usage"] is None
        assert body[-1]["choices"][0]["stop_reason"] is None
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": len(pieces),
            "total_tokens": 2 + len(pieces),
        }


def _state(tokenizer, max_model_len: int = 128) -> ServerState:
    return ServerState(
        client=None, tokenizer=tokenizer, served_model_name="m", api_key=None, max_model_len=max_model_len, metrics=None
    )


def test_chat_parts_tool_calls_and_tools_reach_the_template(tiny_llama_dir):
    """Text parts joined by newlines, an assistant's tool calls with their arguments as an object (as templates
    index them), the tool's answer and the request's tools, rendered by the tokenizer's own template."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}>"
        "{{ m.reasoning_content or '' }}{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    parsed = parse_chat(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hmm "},
                {"role": "tool", "tool_call_id": "c1", "content": "cold"},
            ],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}],
            "tool_choice": "none",
        }
    )
    ids = asyncio.run(encode_chat(_state(tokenizer), parsed.messages, parsed.tools))
    assert tokenizer.decode(ids) == "[tool weather]<user>a\nb<assistant>hmm weather(Oslo)<tool>cold"


def test_a_chat_longer_than_the_context_is_refused_after_its_head(tiny_llama_dir):
    """A rendered chat past 32 characters a token of context is refused once its head overflows, before the
    whole text is tokenized (the tokenizer's pool threads serve every request)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
    parsed = parse_chat({"messages": [{"role": "user", "content": "word " * 20_000}]})
    with pytest.raises(APIError) as e:
        asyncio.run(encode_chat(_state(tokenizer), parsed.messages))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert calls == [32 * 128]  # the head only


def test_a_constrained_stream_opens_only_after_the_engines_first_word():
    """The engine's compile of a constraint can fail after the API's check passed: for a stream, its failure is
    then a 400 before the stream opens, and a first token leaves the queue as it was for the stream to read."""
    from kiln.engine.serving.completion import _first_word

    async def run() -> None:
        failed = Inbox()
        failed.put(messages.RequestFailed("r-0", "compiling the JSON schema took longer than 30 s"))
        with pytest.raises(APIError) as e:
            await _first_word(failed, "response_format")
        assert e.value.status == 400 and e.value.param == "response_format" and "longer than" in e.value.message
        ok = Inbox()
        first, second = (messages.EngineCoreOutput("r-0", [t]) for t in (5, 6))
        ok.put(first)
        ok.put(second)
        await _first_word(ok, "response_format")
        assert await ok.take_all() == [first, second]
        internal = Inbox()  # a fault of the engine's own stays the stream's error event (a 500 there)
        internal.put(messages.RequestFailed("r-0", "internal error while setting up the grammar"))
        await _first_word(internal, "response_format")
        assert len(await internal.take_all()) == 1

    asyncio.run(run())


def test_the_watchdog_counts_an_engines_silence_only_while_the_loop_runs():
    """A stall of the API server's own event loop (here 1.5 s against a 0.4 s engine timeout, with no word from the
    engine) is not the engine's silence: the watchdog forgives it; silence in a running loop past the timeout
    still kills the engine."""
    from kiln.engine.serving.engine_client import AsyncEngineClient

    class Process:
        killed_at: float | None = None

        def kill(self) -> None:
            self.killed_at = time.monotonic()

    async def scenario() -> tuple[float, float | None]:
        client = AsyncEngineClient.__new__(AsyncEngineClient)
        client.engine_timeout, client.alive, client.death, client.process = 0.4, True, None, Process()
        client.last_heard = asyncio.get_running_loop().time()
        watchdog = asyncio.create_task(client._watchdog())
        await asyncio.sleep(0.05)
        time.sleep(1.5)  # NOTE: blocks the loop, as a handler doing heavy work on it would
        stalled_until = time.monotonic()
        await asyncio.sleep(0.2)
        assert client.process.killed_at is None  # the stall was forgiven
        await asyncio.wait_for(watchdog, 5)  # the engine stays silent: it is killed, a timeout later
        return stalled_until, client.process.killed_at

    stalled_until, killed_at = asyncio.run(scenario())
    # the silence before the stall (0.05 s) counts, the stall does not
    assert killed_at is not None and killed_at - stalled_until >= 0.3
