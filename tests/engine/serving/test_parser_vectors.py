"""Kiln's tool parsers on the cases vLLM's and SGLang's own parser tests hold (`data/parser_vectors.json`: each vector
names its repository, file, commit and test, transcribed by hand with what that test expects). Each reply is read
whole and streamed at several chunkings: the count of vectors where Kiln agrees with the peer is printed (run with -s),
every vector where it does not carries Kiln's own answer and the reason (the README's list of deliberate
differences), and a stream always ends equal to the whole reading, for the vectors and for random splits of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS

VECTORS = json.loads((Path(__file__).parent / "data" / "parser_vectors.json").read_text())["vectors"]
IDS = [f"{v['parser']}:{v['test']}" for v in VECTORS]


def parser_for(vector):
    parser = PARSERS[vector["parser"]]()
    if "tools" in vector:
        parser.offer({name: {"name": name, "parameters": schema} for name, schema in vector["tools"].items()})
    return parser


def arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # (a call whose markup broke: its arguments as written)


def reading(content, calls) -> tuple[str, list]:
    """What a test compares: the content without surrounding whitespace (peers differ in it; None is empty), each
    call's name and arguments as JSON values."""
    return (content or "").strip(), [[name, args] for name, args in calls]


def whole(vector) -> tuple[str | None, list]:
    content, calls = ToolCallStream(parser_for(vector)).message(vector["text"])
    return content, [[c["function"]["name"], c["function"]["arguments"]] for c in calls]


def agrees(vector, who: str) -> bool:
    """Whether Kiln's whole reading is what the peer's test expects (`who` "peer"), or what the vector says Kiln
    gives ("kiln": the peer's expectation with the vector's deliberate difference). A test that says nothing of the
    content has its calls compared alone."""
    want = {**vector, **vector.get("kiln", {})} if who == "kiln" else vector
    content, calls = whole(vector)
    got = reading(content, [[name, arguments(args)] for name, args in calls])
    if "content" not in want:
        return got[1] == want["calls"]
    return got == reading(want["content"], want["calls"])


def test_agreement_with_the_peers_tests():
    peers = sum(agrees(v, "peer") for v in VECTORS)
    different = [v for v in VECTORS if not agrees(v, "peer")]
    print(f"\nparser vectors: Kiln agrees with the peers' tests on {peers} of {len(VECTORS)}")
    for v in different:
        print(f"  deliberate difference, {v['parser']} {v['repo']} {v['test']}: {v.get('kiln', {}).get('why')}")
    unexplained = [f"{v['parser']}:{v['test']}" for v in different if "why" not in v.get("kiln", {})]
    assert not unexplained, f"disagreements without a reason: {unexplained}"


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_kiln_reads_each_vector_as_it_says(vector):
    assert agrees(vector, "kiln"), whole(vector)


def streamed(vector, pieces: list[str]) -> tuple[str, list]:
    stream = ToolCallStream(parser_for(vector))
    content, calls, text = "", {}, ""
    for k, piece in enumerate(pieces):
        text += piece
        delta, deltas = stream.update(text, final=k == len(pieces) - 1)
        content += delta
        for d in deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert entry[0] == "", "a call's name comes once"
                entry[0] = d["function"]["name"]
            entry[1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [calls[i] for i in range(len(calls))]


def same_as_whole(vector, pieces: list[str]) -> None:
    content, calls = whole(vector)
    got_content, got_calls = streamed(vector, pieces)
    assert got_calls == calls, pieces
    # (a whole reading's content is None beside calls when only whitespace: a stream sent that whitespace)
    assert (got_content or "") == (content or "") or (calls and not (got_content or "").strip()), pieces


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_streamed_at_several_chunkings_equals_whole(vector):
    text = vector["text"]
    for size in (1, 2, 3, 5, 8, 13, 40):
        same_as_whole(vector, [text[i : i + size] for i in range(0, len(text), size)])
    for cut in range(1, len(text)):
        same_as_whole(vector, [text[:cut], text[cut:]])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_streamed_in_random_splits_equals_whole(data):
    vector = data.draw(st.sampled_from(VECTORS), label="vector")
    text = vector["text"]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12), label="cuts"))
    bounds = [0, *cuts, len(text)]
    same_as_whole(vector, [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [text])
