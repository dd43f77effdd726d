"""Log-probabilities in OpenAI's shapes (and vLLM's prompt_logprobs field), from the engine's entries: per token,
[token id, logprob, rank] for the token itself first, then the top k (ranks 1..k) not already listed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.engine.serving.completion import ServerState

# What a log-probability of -inf (a token a grammar or logit_bias rules out) is sent as: JSON has no infinity,
# and OpenAI's clients take this floor (as vLLM sends it).
MIN_LOGPROB = -9999.0


def token_text(state: ServerState):
    """A function from a token id to its text alone, remembered in `state` (the tokenizer's decode of one id is
    the slow part of a long logprobs body)."""
    texts, decode = state.token_texts, state.tokenizer.decode

    def text(token) -> str:
        token = int(token)
        found = texts.get(token)
        if found is None:
            found = texts[token] = decode([token])
        return found

    return text


def logprobs_body(
    state: ServerState, token_ids: list[int], entries: list[list[list[float]]], chat: bool, k: int, text_offset: int = 0
):
    """OpenAI's logprobs shapes. Each engine entry holds [token id, logprob, rank] for the sampled
    token and the top k (ranks 1..k). `text_offset`: where the first token's text starts (completions)."""
    decode = token_text(state)
    sampled, tops = [], []
    for token, entry in zip(token_ids, entries):
        sampled.append(max(next(lp for t, lp, _ in entry if int(t) == token), MIN_LOGPROB))
        # completions (OpenAI's legacy shape): the top k and the sampled token; chat: the top k
        top = sorted(entry, key=lambda e: e[2])[:k]
        if not chat and all(int(t) != token for t, _, _ in top):
            top += [e for e in entry if int(e[0]) == token][:1]
        tops.append([(decode(t), max(lp, MIN_LOGPROB)) for t, lp, _ in top])
    texts = [decode(t) for t in token_ids]
    if chat:
        return {
            "content": [
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in top],
                }
                for text, lp, top in zip(texts, sampled, tops)
            ],
            "refusal": None,  # (a refusal's tokens: Kiln's models give none apart from the content)
        }
    tokens, token_logprobs, top = texts, sampled, [dict(t) for t in tops]
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs_body(state: ServerState, prompt_ids: list[int], entries: list, k: int) -> dict[str, Any]:
    """A completion's `echo` with `logprobs`: the prompt's tokens in the legacy shape, the first one with none."""
    first = token_text(state)(prompt_ids[0])
    body = logprobs_body(state, prompt_ids[1:], entries[1:], False, k, len(first))
    return {
        "tokens": [first] + body["tokens"],
        "token_logprobs": [None] + body["token_logprobs"],
        "top_logprobs": [None] + body["top_logprobs"],
        "text_offset": [0] + body["text_offset"],
    }


def joined(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + second[key] for key in first}


def end_offset(body: dict[str, list]) -> int:
    """Where the text after a legacy logprobs body starts."""
    return body["text_offset"][-1] + len(body["tokens"][-1]) if body["tokens"] else 0


def vllm_prompt_logprobs(state: ServerState, entries: list | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token (None for the first), {token id: {logprob, rank,
    decoded_token}} for the token and the top k."""
    if entries is None:
        return None
    decode = token_text(state)
    return [
        None
        if entry is None
        else {
            str(int(t)): {"logprob": max(lp, MIN_LOGPROB), "rank": int(rank), "decoded_token": decode(t)}
            for t, lp, rank in entry
        }
        for entry in entries
    ]
