"""What clients written against OpenAI rely on, through the official client against a real server: a model's card,
OpenAI's wording of a context overflow, one choice a streamed chunk, the parameter an error names."""

from __future__ import annotations

import openai
import pytest

from helpers.server import Server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    yield s
    s.stop()


def test_a_model_card_by_its_id(server):
    client = server.client()
    card = client.models.retrieve(server.model)  # the served name holds slashes: a directory
    assert card.id == server.model and card.object == "model"
    assert client.models.list().data[0].id == card.id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("chat", [True, False])
def test_a_context_overflow_in_openai_words(server, chat):
    """LiteLLM and others tell a context-window error by "maximum context length" and the code."""
    client = server.client()
    long_text = "one two three " * 60  # past the server's 128 tokens

    def ask(text, **kw):
        if chat:
            messages = [{"role": "user", "content": text}]
            return client.chat.completions.create(model=server.model, messages=messages, **kw)
        return client.completions.create(model=server.model, prompt=text, **kw)

    where = "messages" if chat else "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        ask(long_text)
    error = e.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == where
    assert error["message"].startswith("This model's maximum context length is 128 tokens. However, your ")
    with pytest.raises(openai.BadRequestError) as e:
        ask("hi", max_tokens=500)  # the prompt fits; with the completion it does not
    error = e.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    prompt_tokens = int(error["message"].split("(")[1].split()[0])
    assert (
        f"you requested {prompt_tokens + 500} tokens ({prompt_tokens} in the {where}, 500 in the completion)"
        in (error["message"])
    )


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_of_n_choices_sends_one_choice_a_chunk(server, chat):
    """Each chunk holds one choice, and each choice's pieces join into the text the same request gives unstreamed."""
    client = server.client()
    kw = dict(model=server.model, n=3, temperature=1.0, seed=7, max_tokens=12)
    if chat:
        whole = client.chat.completions.create(messages=HI, **kw)
        chunks = list(client.chat.completions.create(messages=HI, stream=True, **kw))
    else:
        whole = client.completions.create(prompt="hi", **kw)
        chunks = list(client.completions.create(prompt="hi", stream=True, **kw))
    assert chunks and all(len(c.choices) == 1 for c in chunks)
    texts, reasons = ["", "", ""], [None, None, None]
    for c in chunks:
        choice = c.choices[0]
        texts[choice.index] += (choice.delta.content or "") if chat else choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    expected = sorted(whole.choices, key=lambda c: c.index)
    assert texts == [c.message.content if chat else c.text for c in expected]
    assert reasons == [c.finish_reason for c in expected]


def test_top_logprobs_out_of_range_names_top_logprobs(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=HI, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
