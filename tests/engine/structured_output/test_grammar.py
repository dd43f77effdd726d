"""Structured output's parts on their own: params and OpenAI parsing, the grammar cache and its time limit, and the
token bitmask against a plain-Python reference. (Tiny models under constraints, offline and over HTTP:
test_structured_output.py.)"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time

import pytest
import torch

from kiln.engine.sampling_params import SamplingParams, StructuredOutputParams
from kiln.engine.serving.openai_requests import APIError, parse_chat, parse_completion
from kiln.engine.structured_output.grammar import GrammarBitmask, GrammarCache, GrammarError, check_grammar
from kiln.engine.text.tokenizer import builtin_tokenizer

TOKENIZER_VOCAB = 512
MODEL_VOCAB = 600  # wider than the tokenizer, as padded embeddings are: ids 512..599 are never allowed
EOS = 511


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer(TOKENIZER_VOCAB)


@pytest.fixture(scope="module")
def cache(tokenizer):
    grammars = GrammarCache(lambda: tokenizer, MODEL_VOCAB, [EOS])
    yield grammars
    grammars.shutdown()


def ready(cache: GrammarCache, params: StructuredOutputParams):
    grammar = cache.request_grammar(params)
    grammar.compiled.result(timeout=30)
    assert grammar.poll()
    return grammar


def allowed(row: torch.Tensor, vocab_size: int = MODEL_VOCAB) -> set[int]:
    bits = (row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def token_texts(tokenizer) -> dict[int, str]:
    """Each token's own text, for tokens that are whole UTF-8 (byte pieces decode to U+FFFD)."""
    texts = {t: tokenizer.decode([t]) for t in range(TOKENIZER_VOCAB) if t not in tokenizer.all_special_ids}
    return {t: s for t, s in texts.items() if s and "\ufffd" not in s}


# ---- params and parsing --------------------------------------------------------------------------------


def test_params_normalise_and_travel_as_dicts():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    params = SamplingParams(structured_output=StructuredOutputParams(json=schema))
    so = params.structured_output
    assert so.kind == "json"
    assert so.spec == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
    assert StructuredOutputParams(json=so.spec) == so  # text or dict: one cache key, key order kept
    wire = dataclasses.asdict(params)  # what the API server sends (msgpack takes only plain data)
    assert wire["structured_output"] == {"json": so.spec, "json_object": False, "regex": None, "grammar": None}
    assert SamplingParams(**wire) == params
    assert (StructuredOutputParams(json_object=True).kind, StructuredOutputParams(json_object=True).spec) == (
        "json_object",
        "",
    )
    assert StructuredOutputParams(regex="[0-9]+").spec == "[0-9]+"


@pytest.mark.parametrize(
    "value,match",
    [
        ({}, "exactly one of json, json_object, regex, grammar; got none"),
        ({"regex": "a", "grammar": 'root ::= "a"'}, "got regex, grammar"),
        ({"regex": ""}, "structured_output.regex must be a non-empty string"),
        ({"grammar": 5}, "structured_output.grammar must be a non-empty string"),
        ({"json": "[1, 2]"}, "structured_output.json must be a JSON schema object"),
        ({"json": "{not json"}, "structured_output.json is not valid JSON"),
        ({"json": {"x": float("nan")}}, "structured_output.json cannot be written as JSON"),
        ({"json_object": 1}, "structured_output.json_object must be a bool"),
        ({"choice": ["a"]}, "structured_output must be a dict with keys among"),
        ({"regex": "a" * (256 * 1024 + 1)}, "at most 262144 characters"),
    ],
)
def test_bad_params_name_the_problem(value, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        SamplingParams(structured_output=value)
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output="{}")


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputParams(json=SCHEMA),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_regex": "[a-z]+"}, StructuredOutputParams(regex="[a-z]+")),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, StructuredOutputParams(grammar='root ::= "yes" | "no"')),
        ({}, None),
    ],
)
def test_openai_bodies_parse_to_a_constraint(extra, expected):
    completion = parse_completion({"prompt": "hi", **extra}).params.structured_output
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], **extra}).params.structured_output
    assert completion == chat == expected


@pytest.mark.parametrize(
    "extra,param,match",
    [
        ({"response_format": "json"}, "response_format", "'response_format' must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format", "'response_format.type' must be one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'response_format.json_schema.schema'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format",
            "must be a JSON schema object",
        ),
        ({"guided_regex": 5}, "guided_regex", "'guided_regex' must be a string"),
        ({"guided_regex": ""}, "guided_regex", "must be a non-empty string"),
        ({"guided_grammar": ["a"]}, "guided_grammar", "'guided_grammar' must be a string"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "at most one of response_format (json_object or json_schema), guided_json, guided_choice, guided_regex",
        ),
    ],
)
def test_bad_openai_bodies_get_400_naming_the_parameter(extra, param, match):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for parse, body in ((parse_completion, {"prompt": "hi"}), (parse_chat, chat)):
        with pytest.raises(APIError) as excinfo:
            parse({**body, **extra})
        assert excinfo.value.status == 400 and excinfo.value.param == param
        assert match in excinfo.value.message


# ---- compiling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,match",
    [
        (StructuredOutputParams(json={"type": "bogus"}), 'invalid JSON schema: Unsupported type "bogus"'),
        (StructuredOutputParams(json={"$ref": "#/$defs/missing"}), "invalid JSON schema"),
        (
            StructuredOutputParams(regex="([a-z]"),
            "invalid regex: Regex parsing error at position 7: The parenthesis is not closed",
        ),
        (
            StructuredOutputParams(grammar="root ::= item"),
            'invalid EBNF grammar: EBNF parser error at line 1, column 10: Rule "item" is not defined',
        ),
    ],
)
def test_bad_constraints_fail_with_a_clean_message(cache, params, match):
    for error in (_raised(check_grammar, params), _raised(lambda p: ready(cache, p), params)):
        message = str(error)
        assert isinstance(error, GrammarError) and message.startswith(match), message
        assert "/project" not in message and "Check failed" not in message and not message.startswith("[")


def _raised(fn, *args) -> BaseException:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError(f"{fn} raised nothing")


def test_cache_compiles_once_per_constraint_and_keeps_the_newest(tokenizer):
    grammars = GrammarCache(lambda: tokenizer, MODEL_VOCAB, [EOS], max_entries=2)
    try:
        a, b, c = (StructuredOutputParams(regex=r) for r in ("a+", "b+", "c+"))
        first = grammars.get(a)
        assert grammars.get(StructuredOutputParams(regex="a+")) is first and grammars.num_compiles == 1
        assert grammars.get(StructuredOutputParams(json_object=True)) is not grammars.get(b)
        assert grammars.num_compiles == 3 and list(grammars.entries) == [("json_object", ""), ("regex", "b+")]
        grammars.get(StructuredOutputParams(json_object=True))  # used: now the newest
        grammars.get(c)
        assert list(grammars.entries) == [("json_object", ""), ("regex", "c+")]
        assert grammars.get(a) is not first and grammars.num_compiles == 5
        bad = StructuredOutputParams(regex="(")
        failed = grammars.get(bad)
        assert isinstance(failed.exception(timeout=30), GrammarError)
        assert grammars.get(bad) is failed  # a bad schema sent again fails at once
    finally:
        grammars.shutdown()


def test_a_slow_compile_fails_its_request_at_the_time_limit_without_blocking(tokenizer):
    release = threading.Event()

    def stuck_tokenizer():  # stands in for a pathological schema: the worker is busy for as long as it likes
        release.wait(30)
        return tokenizer

    grammars = GrammarCache(stuck_tokenizer, MODEL_VOCAB, [EOS], timeout_s=0.2)
    try:
        grammar = grammars.request_grammar(StructuredOutputParams(regex="[0-9]+"))
        start = time.monotonic()
        assert not grammar.poll()
        assert time.monotonic() - start < 0.05  # polling never waits for the compile
        time.sleep(0.25)
        with pytest.raises(GrammarError, match=r"compiling the regex took longer than 0.2 s"):
            grammar.poll()
        release.set()
        # The compile finishes on its own and is cached for the next request.
        assert grammars.get(StructuredOutputParams(regex="[0-9]+")).result(timeout=30) is not None
        assert grammars.request_grammar(StructuredOutputParams(regex="[0-9]+")).poll()
    finally:
        release.set()
        grammars.shutdown()


def _slow_schema() -> dict:
    """A JSON schema inside every size and depth limit whose compile takes about a second or more (anyOf nested 12
    deep: xgrammar's compile grows with the alternatives)."""
    schema: dict = {"type": "string"}
    for _ in range(12):
        schema = {"anyOf": [schema, {"type": "array", "items": schema}]}
    return schema


def test_a_compile_past_its_time_limit_is_killed_and_its_capacity_comes_back(tokenizer):
    grammars = GrammarCache(lambda: tokenizer, MODEL_VOCAB, [EOS], num_workers=1, timeout_s=3)
    try:
        # both lanes' processes (first try, general) are started and warm before the slow compile is timed
        warm = [grammars.get(StructuredOutputParams(regex=r)) for r in ("a+", "b+")]
        assert all(future.result(timeout=60) is not None for future in warm)
        grammars.timeout_s = 0.2
        slow = StructuredOutputParams(json=_slow_schema())
        start = time.monotonic()
        with pytest.raises(GrammarError, match=r"compiling the JSON schema took longer than 0.2 s"):
            grammars.get(slow).result(timeout=30)
        assert time.monotonic() - start < 0.2 + 1.0  # failed at its limit, not when xgrammar would have finished
        grammars.timeout_s = 30
        # the one worker is free for the next constraint (in a new process)
        assert grammars.request_grammar(StructuredOutputParams(regex="[0-9]+")).compiled.result(timeout=60)
        # the slow schema sent again fails at once, costing no compile
        compiles = grammars.num_compiles
        assert isinstance(grammars.get(slow).exception(timeout=0), GrammarError)
        assert grammars.num_compiles == compiles
    finally:
        grammars.shutdown()


def test_compile_worker_processes_end_with_the_cache(tokenizer):
    others = _children()  # other caches' (this module's fixture's)
    grammars = GrammarCache(lambda: tokenizer, MODEL_VOCAB, [EOS], num_workers=2)
    assert grammars.get(StructuredOutputParams(regex="x+")).result(timeout=60) is not None
    children = _children() - others
    assert children, "the compile ran in a process of its own"
    grammars.shutdown()
    deadline = time.monotonic() + 30
    while _children() & children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _children() & children


def _children() -> set[int]:
    """This process's live children that run the compile worker."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"compile_worker" in cmdline:
            found.add(int(entry.name))
    return found


# ---- the mask against a reference -----------------------------------------------------------------------


def test_mask_allows_exactly_the_tokens_a_reference_allows(cache, tokenizer):
    """A regex's mask, step by step, is the set of tokens that keep the text a prefix of a match
    (checked with Python's `re` on each token's text); EOS only once the text matches whole."""
    digits = re.compile(r"[0-9]{1,3}-[a-z]{2}")
    prefixes = {s[:i] for s in ("123-ab",) for i in range(len(s) + 1)}
    texts = token_texts(tokenizer)

    def is_prefix(text: str) -> bool:  # a prefix of some match of [0-9]{1,3}-[a-z]{2}
        return bool(re.fullmatch(r"[0-9]{0,3}|[0-9]{1,3}-[a-z]{0,2}", text))

    grammar = ready(cache, StructuredOutputParams(regex=digits.pattern))
    mask = GrammarBitmask(2, MODEL_VOCAB, torch.device("cpu"))
    text = ""
    for token in tokenizer.encode("123-ab"):
        mask.fill([grammar], [1])
        got = allowed(mask.host[1])
        expected = {t for t, s in texts.items() if is_prefix(text + s)} | ({EOS} if digits.fullmatch(text) else set())
        # Tokens with no text of their own (byte pieces) may be allowed too; nothing else.
        assert expected <= got and got - expected <= set(range(TOKENIZER_VOCAB)) - set(texts) - {EOS}
        assert not got & set(range(TOKENIZER_VOCAB, MODEL_VOCAB))
        assert grammar.accept_token(token)
        text += tokenizer.decode([token])
        assert text in prefixes
    mask.fill([grammar], [0])
    assert allowed(mask.host[0]) == {EOS}  # the match is complete: only the stop token is left
    assert not grammar.accept_token(tokenizer.encode("7")[0])  # rejected, state unchanged
    assert grammar.accept_token(EOS) and grammar.is_terminated


def test_apply_masks_constrained_rows_only(cache, tokenizer):
    """Rows with a grammar keep exactly the logits of tokens that can start a match (a reference from each
    token's text), -inf elsewhere, padding ids included; rows without one are untouched."""
    logits = torch.randn(4, MODEL_VOCAB, generator=torch.Generator().manual_seed(0))
    yes_no = ready(cache, StructuredOutputParams(grammar='root ::= "yes" | "no"'))
    number = ready(cache, StructuredOutputParams(regex="[0-9]+"))
    texts = token_texts(tokenizer)
    starts = {
        1: {t for t, s in texts.items() if "yes".startswith(s) or "no".startswith(s)},
        3: {t for t, s in texts.items() if s.isascii() and s.isdigit()},
    }
    expected = logits.clone()
    for row, keep in starts.items():
        barred = torch.ones(MODEL_VOCAB, dtype=torch.bool)
        barred[sorted(keep)] = False
        expected[row, barred] = float("-inf")
    mask = GrammarBitmask(2, MODEL_VOCAB, torch.device("cpu"))  # grows to the batch
    assert mask.apply(logits, [None, yes_no, None, number]) == [1, 3]
    assert torch.equal(logits, expected)
    assert mask.apply(logits, [None] * 4) == [] and torch.equal(logits, expected)  # nothing constrained


def test_length_limited_strings_hold_no_raw_control_characters(cache):
    """xgrammar's own length-limited strings would take a raw tab (invalid JSON); Kiln hands the limits
    over as a pattern, which does not."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}},
        "required": ["s"],
    }
    for text, valid in (
        ('{"s": "a\tb"}', False),
        ('{"s": "abcd"}', True),
        ('{"s": "abcde"}', False),
        ('{"s": ""}', False),
        ('{"s": "été"}', True),
    ):
        matcher = ready(cache, StructuredOutputParams(json=schema)).matcher
        assert (matcher.accept_string(text) and matcher.is_completed()) == valid, text


def test_batch_fill_equals_one_by_one(cache, tokenizer):
    specs = [
        StructuredOutputParams(regex="[a-z]+ [0-9]+"),
        StructuredOutputParams(json=SCHEMA),
        StructuredOutputParams(json_object=True),
        StructuredOutputParams(grammar='root ::= "a" root | "b"'),
    ]
    grammars = [ready(cache, p) for p in specs]
    for g, prefix in zip(grammars, ("abc 1", '{"ok": ', "{", "aa")):
        for token in tokenizer.encode(prefix):
            assert g.accept_token(token)
    together = GrammarBitmask(8, MODEL_VOCAB, torch.device("cpu"))
    together.fill(grammars, [7, 0, 3, 5])
    alone = GrammarBitmask(1, MODEL_VOCAB, torch.device("cpu"))
    for g, row in zip(grammars, (7, 0, 3, 5)):
        alone.fill([g], [0])
        assert torch.equal(together.host[row], alone.host[0])


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


REFUSED = [
    ({"type": "integer", "not": {"const": 3}}, "'not' (at #)"),
    (
        {"type": "object", "properties": {"x": {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}}},
        "#/properties/x",
    ),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "'contains'"),
    ({"anyOf": [{"type": "object", "dependentRequired": {"a": ["b"]}}]}, "#/anyOf/0"),
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "'allOf' with several schemas"),
    (_nested(40), "deeper than 32 levels"),
]


@pytest.mark.parametrize("schema,match", REFUSED, ids=range(len(REFUSED)))
def test_keywords_xgrammar_would_pass_over_are_refused(schema, match):
    """xgrammar 0.2.9 accepts output that breaks these (its own parse goes through): a 400 says so instead."""
    with pytest.raises(GrammarError, match=re.escape(match)):
        check_grammar(StructuredOutputParams(json=schema))


def test_what_xgrammar_holds_output_to_is_let_through():
    # names are not keywords (a property called "not"), a false uniqueItems asks nothing, allOf of one is one
    for schema in (
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        {"allOf": [{"type": "integer", "minimum": 3}]},
        _nested(30),
    ):
        check_grammar(StructuredOutputParams(json=schema))


SLOW_TO_PARSE = {"type": "object", "properties": {"p": {"type": "string", "maxLength": 8000}}}  # ~20 s to parse


def test_a_check_past_its_time_limit_kills_its_worker_and_frees_the_slot():
    """The worker processes' mechanism: an answer that does not come in time kills the process (a thread could
    not be stopped), the next check starts another; a full pool is ChecksBusy, not a wait without end; a check whose
    request is gone is stopped; with the general workers busy, a quick check gets a first try of its own."""
    import asyncio
    import multiprocessing

    from kiln.engine.serving.grammar_checks import ChecksBusy, GrammarChecks, OwnerBusy

    def workers() -> list:
        return [p for p in multiprocessing.active_children() if p.name == "kiln-grammar-check"]

    async def run() -> None:
        checks = GrammarChecks(workers=2, timeout=60)
        assert await checks.problem(StructuredOutputParams(regex="a+")) is None  # (a worker started, not timed)
        checks.timeout = 0.5
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await checks.problem(StructuredOutputParams(json=SLOW_TO_PARSE))
        assert time.monotonic() - start < 0.5 + 1.0
        assert not workers()  # the one worker started (and timed out) was killed and reaped
        checks.timeout = 60
        problem = await checks.problem(StructuredOutputParams(json={"type": "integer", "not": {"const": 3}}))
        assert "'not' (at #) is not supported" in problem
        assert "invalid regex" in await checks.problem(StructuredOutputParams(regex="(["))
        assert await checks.problem(StructuredOutputParams(regex="a+")) is None  # remembered: no worker asked
        # both general workers busy with slow checks: a quick one is answered in the first-try lane (all started first:
        # on two busy cores a start takes several seconds)
        await asyncio.gather(*(checks.problem(StructuredOutputParams(regex=f"w{i}+")) for i in range(3)))
        slow = [
            asyncio.ensure_future(checks.problem(StructuredOutputParams(json={**SLOW_TO_PARSE, "title": str(i)})))
            for i in range(3)
        ]
        await asyncio.sleep(0.5)
        start = time.monotonic()
        assert await checks.problem(StructuredOutputParams(regex="b+")) is None
        assert time.monotonic() - start < 5
        # requests gone: their checks are stopped, their workers killed
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        await asyncio.sleep(1)
        assert checks._general.free == [None, None] and len(checks._first_try.free) == 1
        assert len(workers()) == 2  # the first-try lane's and its spare: the slow checks' were killed
        held = [await checks._general.acquire(0, 0) for _ in range(2)] + [await checks._first_try.acquire(0, 0)]
        checks.timeout = 0.2
        with pytest.raises(ChecksBusy):
            await checks.problem(StructuredOutputParams(regex="c+"))
        checks._first_try.release(held.pop())
        for worker in held:
            checks._general.release(worker)
        # one check in flight per owner (an API key): its second is refused while the first runs, others go on
        checks.timeout = 60
        first = asyncio.ensure_future(checks.problem(StructuredOutputParams(regex="d+"), owner="alice"))
        await asyncio.sleep(0)
        with pytest.raises(OwnerBusy):
            await checks.problem(StructuredOutputParams(regex="e+"), owner="alice")
        assert await checks.problem(StructuredOutputParams(regex="f+"), owner="bob") is None
        assert await first is None
        assert await checks.problem(StructuredOutputParams(regex="g+"), owner="alice") is None
        checks.close()
        assert not workers()

    asyncio.run(run())
