"""Incremental detokenization equals a one-shot decode, and never emits half a character."""

from __future__ import annotations

import pytest

from kiln.engine.text.detokenizer import IncrementalDetokenizer, TextStream, find_stop_string
from kiln.engine.text.tokenizer import builtin_tokenizer

TEXTS = [
    "Hello world, the quick brown fox.",
    "héllo wörld — ünïcödé",
    "emoji 🔥🚀 mixed 漢字かな text 👩‍👩‍👧",
    "   spaces   and\nnewlines\t\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(text):
    tokenizer = builtin_tokenizer(512)
    ids = tokenizer.encode(text)
    split = 2
    while "\ufffd" in tokenizer.decode(ids[:split]):  # keep the prompt/output boundary between characters
        split += 1
    prompt, output = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add_tokens([t]) for t in output]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(output)
    assert all("\ufffd" not in p for p in pieces)
    # byte-level BPE splits multi-byte characters across tokens: some steps must have held text back
    if any(ord(c) > 127 for c in text):
        assert "" in pieces[:-1]


def test_find_stop_string_only_in_new_tail():
    assert find_stop_string("abc STOP def", 4, ["STOP"]) is None  # wholly before the new text
    assert find_stop_string("abc STOP", 2, ["STOP"]) == ("STOP", 4)  # straddles the boundary
    assert find_stop_string("xx AB CD", 5, ["CD", "AB"]) == ("AB", 3)  # the earliest wins


def test_tokens_that_add_nothing_do_not_grow_the_window():
    # A preset's dummy weights mostly sample ids its small tokenizer does not know; real models emit
    # special tokens that are skipped. Either way the text must equal a one-shot decode, and the decode
    # window must not grow with them (each later token would decode it all again).
    tokenizer = builtin_tokenizer(512)
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    text_ids = tokenizer.encode("héllo wörld, the quick brown fox 🔥 jumps")
    output, unknown = [], iter(range(512, 100_000, 7))
    for i, t in enumerate(text_ids):
        output.append(t)
        output += [next(unknown) for _ in range(200 if i == 5 else i % 5)] + ([special] if i % 3 == 0 else [])
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    widest = 0
    pieces = []
    for t in output:
        pieces.append(detok.add_tokens([t]))
        widest = max(widest, len(detok.token_ids) - detok.prefix_offset)
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True) == tokenizer.decode(text_ids)
    assert widest <= 12  # a split character and what came between its parts, never all the skipped ones


def _stream_pieces(tokenizer, text: str):
    """A prompt's ids and the output ids of `text`, split where no character straddles."""
    prompt = tokenizer.encode("Say:")
    return prompt, tokenizer.encode(text)


@pytest.mark.parametrize("min_tokens", [0, 6, 7, 40])
def test_a_stop_string_counts_only_past_min_tokens(min_tokens):
    """As vLLM: a stop string must end in the text of a token past the first min_tokens; the text is then cut
    where the first such occurrence starts (against a plain decode of the same ids)."""
    tokenizer = builtin_tokenizer(512)
    prompt, ids = _stream_pieces(tokenizer, "one STOP two STOP three four five six seven eight nine")
    stream = TextStream(tokenizer, prompt, ["STOP"], True, False, min_tokens)
    sent, stop = "", None
    for i, t in enumerate(ids):
        delta, stop = stream.update([t], finished=i == len(ids) - 1)
        sent += delta
        if stop is not None:
            break
    # the reference: the first "STOP" that ends within the text of tokens min_tokens+1, ...
    full = tokenizer.decode(ids)
    floor = len(tokenizer.decode(ids[:min_tokens])) if min_tokens else 0
    starts = [i for i in range(len(full)) if full.startswith("STOP", i) and i + 4 > floor]
    if starts:
        assert stop == "STOP" and sent == full[: starts[0]]
    else:
        assert stop is None and sent == full


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_tokens_text_is_left_out(include):
    tokenizer = builtin_tokenizer(512)
    prompt, ids = _stream_pieces(tokenizer, "alpha beta gamma")
    stream = TextStream(tokenizer, prompt, [], True, include)
    sent = stream.update(ids[:2], finished=False)[0] + stream.update(ids[2:], finished=True, stop_token=True)[0]
    assert sent == stream.text == tokenizer.decode(ids if include else ids[:-1])
