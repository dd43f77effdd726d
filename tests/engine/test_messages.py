"""Wire messages round-trip through msgpack; anything else on a socket is rejected, never run."""

from __future__ import annotations

import pickle

import msgpack
import pytest

from kiln.engine import messages
from kiln.engine.text.detokenizer import TextStream
from kiln.engine.text.tokenizer import builtin_tokenizer


def test_round_trip():
    sent = [
        messages.AddRequest("r1", [1, 2, 3], {"temperature": 0.5, "logit_bias": {7: 1.5}, "stop": ["x"]}),
        messages.AbortRequests(["r1", "r2"]),
        messages.Shutdown(),
        messages.Ready(128, 512, 64, "TokenizersBackend", {"mode": "eager"}),
        messages.EngineOutputs(
            [messages.EngineCoreOutput("r1", [5], [[[5, -0.1, 1]]], "stop", 5, 3)],
            [messages.RequestFailed("r2", "bad")],
            {"running": 1},
        ),
    ]
    for message in sent:
        assert messages.decode(messages.encode(message)) == message


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle ran')",))


FOREIGN = [
    pickle.dumps(Boom()),  # a pickle that would run code if anything unpickled it
    b"",
    b"\x93\x01\x02\x03",  # msgpack, but not [name, body]
    b"\x92\xa4Evil\x80",  # an unknown message type
    b"\x92\xaaAddRequest\x81\xa3bad\x01",  # a known type with a field it does not have
    msgpack.packb(
        ["EngineOutputs", {"outputs": [["r1", [5], None, None, None, 0, None, "extra"]]}]
    ),  # an item too long
    msgpack.packb(["EngineOutputs", {"outputs": [{"request_id": "r1"}]}]),  # an item that is not a list
    # what the engine core's input takes, in the wrong shapes: each would have raised inside the engine's loop
    msgpack.packb(["AbortRequests", {"request_ids": 5}]),
    msgpack.packb(["AbortRequests", {"request_ids": [["r1"]]}]),
    msgpack.packb(["AddRequest", {"request_id": 7, "prompt_token_ids": [1], "params": {}}]),
    msgpack.packb(["AddRequest", {"request_id": "r", "prompt_token_ids": "abc", "params": {}}]),
    msgpack.packb(["AddRequest", {"request_id": "r", "prompt_token_ids": [1, True], "params": {}}]),
    msgpack.packb(["AddRequest", {"request_id": "r", "prompt_token_ids": [1], "params": [1]}]),
    msgpack.packb(["AddRequest", {"request_id": "r", "prompt_token_ids": [1]}]),  # a field missing
]


@pytest.mark.parametrize("frame", FOREIGN)
def test_foreign_frames_are_rejected(frame):
    with pytest.raises(messages.ProtocolError):
        messages.decode(frame)


def test_stop_string_split_across_tokens_is_never_sent():
    tokenizer = builtin_tokenizer(512)
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, [], ["brown fox"], True, False)
    sent = ""
    for i, token in enumerate(ids):
        delta, stop = stream.update([token], finished=i == len(ids) - 1)
        sent += delta
        assert "brown" not in sent  # held back until it is known not to start the stop string
        if stop:
            break
    assert stop == "brown fox" and sent == "The quick "


def test_engine_outputs_travel_as_field_lists():
    """A step's outputs go on the wire as lists of their fields (no names) and come back as the same dataclasses."""
    logprobs = [[[5, -0.5, 1]], [[6, -1.5, 2], [9, -1.0, 1]]]
    out = messages.EngineCoreOutput("r1", [5, 6], logprobs, "length", None, 4, [None, [[5, -0.25, 1]]])
    sent = messages.EngineOutputs([out], [messages.RequestFailed("r2", "bad")], {"running": 0})
    frame = messages.encode(sent)
    assert msgpack.unpackb(frame)[1]["outputs"] == [
        ["r1", [5, 6], logprobs, "length", None, 4, [None, [[5, -0.25, 1]]]]
    ]
    assert messages.decode(frame) == sent
