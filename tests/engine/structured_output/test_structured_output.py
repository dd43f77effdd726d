"""Structured output end to end: tiny models whose outputs must parse and validate, offline and over HTTP.
(Params, parsing, the grammar cache and the bitmask on their own: test_structured_output_grammar.py.)"""

from __future__ import annotations

import ast
import json
import re
import shutil

import jsonschema
import pytest
from transformers import AutoTokenizer

from kiln.engine import LLM
from kiln.engine.messages import RequestFailed
from kiln.engine.sampling_params import SamplingParams, StructuredOutputParams
from kiln.engine.structured_output.grammar import GrammarBitmask

from helpers.server import Server

# ---- a tiny model under constraints ---------------------------------------------------------------------
# Its weights are random, so at temperature 1 its choices are noise: whatever structure the outputs have,
# the grammar made. Schemas bound every string and number, so outputs end well within max_tokens; an
# output cut by the length limit would prove nothing, and fails the test.

# NOTE: strings are bounded by ASCII patterns, not maxLength: xgrammar 0.2.9 takes overlong UTF-8 (F0 8C ..)
# for one character, which random byte tokens produce and which decodes to several U+FFFD.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9]{1,5}$"}, "maxItems": 3},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                "city": {"enum": ["Paris", "Lyon"]},
            },
            "required": ["zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "active"],
}
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "*") term){0,3}
term ::= [1-9] [0-9]? | "(" expr ")"
"""


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama, its EOS made the tokenizer's end-of-text token (a special token, as in a real model):
    an output's text is then exactly what the grammar let through."""
    path = tmp_path_factory.mktemp("llama-eos")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = 0
            (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), enforce_eager=True, max_model_len=512)


def sample(llm, structured_output, n=32, **kwargs):
    params = SamplingParams(
        n=n, temperature=1.0, seed=1234, max_tokens=300, structured_output=structured_output, **kwargs
    )
    outputs = llm.generate([llm.tokenizer.encode("Answer: ")], params, use_tqdm=False)[0].outputs
    assert all(c.finish_reason == "stop" for c in outputs), [(c.finish_reason, c.text) for c in outputs]
    assert len({c.text for c in outputs}) > n // 2  # the seeds differ: so do the outputs
    return [c.text for c in outputs]


def test_json_schema_outputs_parse_and_validate(llm):
    for text in sample(llm, StructuredOutputParams(json=PERSON), n=64):
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_outputs_are_objects(llm):
    # Any object may hold strings of any length: a bias towards closing quotes and braces keeps the
    # noise short (it picks among what the grammar allows; it does not make anything valid).
    close = {llm.tokenizer.encode(c)[0]: 4.0 for c in ('"', "}")}
    for text in sample(llm, StructuredOutputParams(json_object=True), logit_bias=close):
        assert isinstance(json.loads(text), dict), text


def test_regex_outputs_match(llm):
    pattern = r"(yes|no), [0-9]{2,4} [a-z]{1,8}!"
    for text in sample(llm, StructuredOutputParams(regex=pattern)):
        assert re.fullmatch(pattern, text), text


def test_ebnf_outputs_are_in_the_language(llm):
    texts = sample(llm, StructuredOutputParams(grammar=ARITHMETIC))
    for text in texts:
        # Python's own parser is the reference: an arithmetic expression of +, *, parentheses and numbers.
        assert re.fullmatch(r"[0-9+*()]+", text), text
        tree = ast.parse(text, mode="eval")
        assert all(
            isinstance(node, ast.Expression | ast.BinOp | ast.Constant | ast.Add | ast.Mult) for node in ast.walk(tree)
        ), text
    assert any("(" in text for text in texts) and any(not text.isdigit() for text in texts)


def test_unconstrained_requests_keep_their_outputs(llm):
    prompts = [[5, 6, 7], [40, 41], [300, 200, 100, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    constrained = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=200, structured_output=StructuredOutputParams(json=PERSON)
    )
    mixed = llm.generate(
        [prompts[0], [9, 9], prompts[1], prompts[2]], [greedy, constrained, greedy, greedy], use_tqdm=False
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3)] == alone
    for choice in mixed[1].outputs:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_greedy_follows_the_grammar_and_unconstrained_batches_pay_nothing(llm, monkeypatch):
    calls = []
    original = GrammarBitmask.apply
    monkeypatch.setattr(GrammarBitmask, "apply", lambda self, *args: calls.append(1) or original(self, *args))
    llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert not calls  # no constrained request in the batch: no mask work at all
    three_digits = SamplingParams(temperature=0, max_tokens=50, structured_output={"regex": "[0-9]{3}"})
    out = llm.generate([[1, 2, 3]], three_digits, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "stop"
    assert len(calls) == len(out.token_ids)  # one mask per sampled token (the last allowed EOS alone)


def test_preempted_requests_keep_their_grammar(model_dir):
    """A KV cache too small for the batch preempts constrained requests mid-output; each recomputes its
    prompt and output and resumes sampling where its matcher stands (it has seen every output token,
    and only those), so every output still validates."""
    llm = LLM(str(model_dir), enforce_eager=True, max_model_len=256, num_kv_blocks=20, block_size=16)
    params = SamplingParams(n=8, temperature=1.0, seed=99, max_tokens=200, structured_output={"json": PERSON})
    outputs = llm.generate([llm.tokenizer.encode("Answer: ")], params, use_tqdm=False)[0].outputs
    assert llm.engine.scheduler.num_preemptions > 0
    for choice in outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_bad_constraints_fail_offline(llm):
    with pytest.raises(ValueError, match='invalid JSON schema: Unsupported type "bogus"'):
        llm.generate([[1, 2]], SamplingParams(structured_output=StructuredOutputParams(json={"type": "bogus"})))
    # Past the offline check (a client of the engine core directly): the compile fails that request alone.
    engine = llm.engine
    params = SamplingParams(structured_output={"regex": "(unclosed"})
    finished, failed = finish_beside_a_good_request(engine, "bad", params)
    message = "invalid regex: Regex parsing error at position 10: The parenthesis is not closed."
    assert failed == [RequestFailed("bad", message)]
    assert finished == {"good"}


def finish_beside_a_good_request(engine, request_id: str, params: SamplingParams) -> tuple[set[str], list]:
    """Run one request beside an unconstrained one until both are done; the ids that finished, and the failures."""
    engine.add_request(request_id, [1, 2], params)
    engine.add_request("good", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    finished, failed = set(), []
    while engine.has_unfinished_requests():
        step = engine.step()
        finished.update(o.request_id for o in step.outputs if o.finish_reason is not None)
        failed += step.failed
    return finished, failed


def test_a_grammar_that_cannot_be_set_up_fails_its_request_alone(llm, monkeypatch):
    """A matcher that cannot be made (an xgrammar bug, say) fails its request with an internal error; the
    request does not stay waiting, raising at every step, and the others run on."""

    def broken_matcher(*args, **kwargs):
        raise RuntimeError("no matcher today")

    monkeypatch.setattr("xgrammar.GrammarMatcher", broken_matcher)
    engine = llm.engine
    params = SamplingParams(structured_output={"regex": "[0-9]{2}"})
    finished, failed = finish_beside_a_good_request(engine, "broken", params)
    assert failed == [RequestFailed("broken", "internal error while setting up the grammar")]
    assert finished == {"good"} and not engine.grammar_admission.waiting


def test_abort_while_compiling(llm):
    engine = llm.engine
    engine.add_request("slow", [1, 2], SamplingParams(structured_output={"regex": "[a-f]{1,9}z"}))
    assert engine.grammar_admission.waiting and engine.has_unfinished_requests()
    engine.abort_requests(["slow"])
    assert not engine.grammar_admission.waiting and not engine.has_unfinished_requests()


def test_a_token_the_grammar_rejects_fails_its_request_alone(tiny_llama_dir, tmp_path):
    """min_tokens holds back EOS, the one token the finished grammar allows: every logit is -inf, and the
    token drawn (greedy: id 0) is one the grammar rejects. The request fails with the reason; the engine
    goes on. (The model's tokenizer names its config's EOS, 511, so that id 0 is no stop token.)"""
    model = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    eos = AutoTokenizer.from_pretrained(model).convert_ids_to_tokens(511)
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": eos}))
    llm = LLM(str(model), enforce_eager=True, max_model_len=128)
    assert llm.engine.model_config.eos_token_ids == (511,)
    conflict = SamplingParams(temperature=0, min_tokens=4, max_tokens=8, structured_output={"regex": "a"})
    with pytest.raises(ValueError, match="the grammar does not allow the sampled token 0"):
        llm.generate([[1, 2]], conflict, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].finished


# ---- over HTTP ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--max-model-len", "512")
    yield s
    s.stop()


def test_server_constrains_chat_and_completions(server):
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Who?"}],
        response_format=response_format,
        n=4,
        seed=3,
        max_tokens=300,
    )
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    pattern = r"(yes|no), [0-9]{2,4} [a-z]{1,8}!"
    stream = client.completions.create(
        model=server.model, prompt="Say", max_tokens=100, seed=5, stream=True, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, "".join(c.choices[0].text for c in stream if c.choices))
    grammar = client.completions.create(
        model=server.model, prompt="Sum", max_tokens=100, seed=6, extra_body={"guided_grammar": ARITHMETIC}
    )
    ast.parse(grammar.choices[0].text, mode="eval")


def test_server_takes_vllms_guided_json_and_guided_choice(server):
    client = server.client()
    for schema in (PERSON, json.dumps(PERSON)):  # an object, or its JSON text
        out = client.completions.create(
            model=server.model, prompt="Who?", max_tokens=300, seed=7, extra_body={"guided_json": schema}
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    choices = ["yes", 'no "way"', "back\\slash", "two\nlines", "café", "tag\U000e0001"]
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Pick"}],
        n=16,
        seed=8,
        max_tokens=20,
        extra_body={"guided_choice": choices},
    )
    picked = {c.message.content for c in chat.choices}
    assert picked <= set(choices) and len(picked) > 1, picked


def strict_json(raw: bytes):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(raw, parse_constant=refuse)


def test_logprobs_of_tokens_a_grammar_rules_out_are_valid_json(server):
    """A token the mask rules out has log-probability -inf, which JSON cannot hold: sent as -9999.0 (as OpenAI
    and vLLM do), streamed or not, chat and completions."""
    for path, body in (
        ("/v1/completions", {"prompt": "Pick", "logprobs": 5}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Pick"}], "logprobs": True, "top_logprobs": 5},
        ),
    ):
        body = {**body, "max_tokens": 5, "guided_choice": ["yes", "no"], "seed": 1}
        code, raw = server.post(path, body)
        assert code == 200, raw
        lp = strict_json(raw)["choices"][0]["logprobs"]
        values = (
            lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()]
            if "tokens" in lp
            else [t["logprob"] for t in lp["content"]]
            + [v["logprob"] for t in lp["content"] for v in t["top_logprobs"]]
        )
        assert -9999.0 in values and all(v >= -9999.0 for v in values)
        code, raw = server.post(path, {**body, "stream": True})
        lines = raw.decode().splitlines()
        events = [line[6:] for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        assert code == 200 and [strict_json(e.encode()) for e in events]


BAD_CONSTRAINTS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
        "response_format",
        'invalid JSON schema: Unsupported type "bogus"',
    ),
    ({"response_format": {"type": "xml"}}, "response_format", "'response_format.type' must be one of"),
    ({"guided_regex": "[0-9"}, "guided_regex", "invalid regex: Regex parsing error"),
    ({"guided_grammar": "root ::= item"}, "guided_grammar", 'Rule "item" is not defined'),
    ({"guided_json": {"type": "bogus"}}, "guided_json", 'invalid JSON schema: Unsupported type "bogus"'),
    ({"guided_json": "[1, 2]"}, "guided_json", "'guided_json' must be a JSON schema"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "'guided_choice' must be a non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "give at most one of"),
    ({"response_format": {"type": "text"}, "guided_regex": "[0-9"}, "guided_regex", "invalid regex"),
]


@pytest.mark.parametrize("extra,param,message", BAD_CONSTRAINTS, ids=[p for _, p, _ in BAD_CONSTRAINTS])
def test_server_bad_constraint_gets_400_and_the_engine_stays_healthy(server, extra, param, message):
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        for stream in (False, True):
            code, raw = server.post(path, {**body, **extra, "stream": stream, "max_tokens": 5})
            assert code == 400, raw
            error = json.loads(raw)["error"]
            assert error["param"] == param and message in error["message"], error
            assert "/project" not in error["message"]
    assert server.get("/health")[0] == 200
    code, raw = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 20, "guided_regex": "[a-z]{3}"})
    assert code == 200 and re.fullmatch("[a-z]{3}", json.loads(raw)["choices"][0]["text"])
