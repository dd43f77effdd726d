"""One completion request, from token ids to the response: the server's state, tokenization off the event
loop, the checks a request passes before the engine sees it, and `run_request`, which adds one engine request
per choice and hands their outputs to `responses` (SSE stream or JSON body)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kiln.engine.messages import RequestFailed
from kiln.engine.sampling_params import StructuredOutputParams
from kiln.engine.serving import api_errors
from kiln.engine.serving.api_keys import RateLimited
from kiln.engine.serving.body_parsers import BodyParsers
from kiln.engine.serving.engine_client import AsyncEngineClient, Inbox
from kiln.engine.serving.grammar_checks import ChecksBusy, GrammarChecks, OwnerBusy
from kiln.engine.serving.metrics import ServerMetrics
from kiln.engine.serving.openai_requests import APIError, ParsedRequest
from kiln.engine.serving.reasoning import ChatReply
from kiln.engine.serving.responses import Choice, collect, final_body, stream_response
from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.text.detokenizer import TextStream
from kiln.engine.text.special_text import PromptTooLong, SpecialText

if TYPE_CHECKING:
    from kiln.engine.serving.api_keys import KeyState
    from kiln.engine.serving.data_parallel import DataParallelClient
    from kiln.engine.serving.reasoning import ReasoningParser
    from kiln.engine.serving.responses_api import ResponseShape
    from kiln.engine.serving.tool_parsers import ToolParser

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class ServerState:
    client: AsyncEngineClient | DataParallelClient
    tokenizer: Any
    served_model_name: str
    api_key: str | None
    max_model_len: int
    metrics: ServerMetrics
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="tokenize"))
    grammar_checks: GrammarChecks = field(default_factory=GrammarChecks)  # processes of their own, not `pool`
    body_parsers: BodyParsers = field(default_factory=BodyParsers)  # large bodies' parse, in processes too
    max_num_seqs: int = 256
    max_num_queued_requests: int | None = None  # admission limit beyond the running batch; None = no limit
    max_sequences_per_request: int = 256  # prompts x n
    max_prompt_logprob_rows: int = 32768  # prompt tokens with log-probabilities a request, each sequence's counted
    draining: bool = False
    in_flight: int = 0  # HTTP requests being served
    engine_requests: int = 0  # requests (choices) they have in the engine
    write_timeout: float = 30.0  # seconds a stream may sit unread before it is aborted
    body_timeout: float = 30.0  # seconds a request body may take to arrive
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # generation_config.json's (model_source)
    auto_tool_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser
    parse_special_tokens: bool = False  # --parse-special-tokens-in-messages: a message's `<|im_end|>` is the token
    # each token id's text alone, as logprobs list it: decoded once (a scored 4k-token prompt lists ~12k of them)
    token_texts: dict[int, str] = field(default_factory=dict)

    @functools.cached_property
    def special_text(self) -> SpecialText:
        return SpecialText(self.tokenizer)


# ---- tokenization (off the event loop) -----------------------------------------------------------------


async def encode_prompt(state: ServerState, text: str) -> list[int]:
    """A prompt string's token ids, or a 400 when its head alone overflows the context (`encode_within`)."""
    return await asyncio.get_running_loop().run_in_executor(state.pool, encode_within, state, text, "prompt", True)


def encode_within(state: ServerState, text: str, param: str, special_tokens: bool) -> list[int]:
    """`text`'s token ids (on a pool thread). NOTE: tokenizing megabytes costs seconds of CPU and hundreds of MiB,
    and the pool's few threads serve every request: a text whose head alone overflows the context is refused after
    tokenizing just the head."""
    head_chars = 32 * state.max_model_len
    if len(text) > head_chars:
        head = state.tokenizer.encode(text[:head_chars], add_special_tokens=special_tokens)
        if len(head) > state.max_model_len + 16:  # merges across the cut change a few tokens at most
            raise context_overflow(state, param, f"more than {len(head) - 16}")
    return state.tokenizer.encode(text, add_special_tokens=special_tokens)


def context_overflow(
    state: ServerState, where: str, prompt_tokens: int | str, completion_tokens: int | None = None, param: str = ""
) -> APIError:
    """`api_errors.context_overflow` at this server's --max-model-len."""
    return api_errors.context_overflow(state.max_model_len, where, prompt_tokens, completion_tokens, param)


async def encode_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A chat's prompt token ids, rendered by the model's chat template (on a pool thread), with `template_kwargs`
    as the template's variables. Unless --parse-special-tokens-in-messages, a special token's text anywhere in the
    request is its characters (`special_text`): only the template's own special tokens are tokens."""

    def render() -> list[int]:
        template = None if getattr(state.tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
        variables = template_variables(state.tokenizer, template_kwargs)
        nonce = None
        if not state.parse_special_tokens:
            try:
                (hidden_messages, hidden_tools, hidden_variables), nonce = state.special_text.hide(
                    (messages, tools, variables)
                )
            except RecursionError:
                raise APIError(400, "the messages or tools nest too deeply", "messages") from None
        try:
            text = state.tokenizer.apply_chat_template(
                hidden_messages if nonce else messages,
                tools=hidden_tools if nonce else tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
                **(hidden_variables if nonce else variables),
            )
        except Exception as e:  # a template may reject roles or orderings
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        if nonce is None:
            return encode_within(state, text, "messages", False)
        try:
            return state.special_text.encode(text, nonce, 32 * state.max_model_len, state.max_model_len + 16)
        except PromptTooLong as e:
            raise context_overflow(state, "messages", f"more than {e.num_tokens - 16}") from None

    return await asyncio.get_running_loop().run_in_executor(state.pool, render)


def template_variables(tokenizer: Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs less those that would set `apply_chat_template`'s own arguments (the
    template itself, tokenizing): those are dropped, as vLLM drops them."""
    if not kwargs:
        return {}
    own = inspect.signature(type(tokenizer).apply_chat_template).parameters
    return {k: v for k, v in kwargs.items() if k not in own}


async def check_structured_output(
    state: ServerState, constraint: StructuredOutputParams, param: str, key: KeyState | None = None
) -> None:
    """A schema, regex or grammar that does not parse, or that xgrammar would not hold output to, is a 400 before
    the engine sees it, streaming or not (`param`: the request's parameter it came from); its check runs in a worker
    process (`grammar_checks`), killed if it takes too long, one at a time per API key. The engine's compile, with
    its time limit, is the backstop."""
    try:
        problem = await state.grammar_checks.problem(constraint, None if key is None else key.name)
    except TimeoutError:
        raise APIError(400, f"the {param} constraint took too long to parse", param) from None
    except ChecksBusy:  # (other clients' constraints hold the shared workers: the server itself is fine)
        raise RateLimited("constraint checks are busy; retry later", "rate_limit_exceeded", 2) from None
    except OwnerBusy:
        key.reject("constraint_checks")
        message = "this API key has a constraint being checked already; wait for it"
        raise RateLimited(message, "constraint_checks", 1) from None
    if problem is not None:
        raise APIError(400, problem, param)


async def _first_word(queue: Inbox, param: str) -> None:
    """A constrained request is answered once the engine has said something of it: its grammar compiled (a token
    came) or not (it failed, or took too long), which is then a 400 naming `param` (rather than an error event midway
    through a stream)."""
    items = await queue.take_all()
    queue.items[:0] = items  # (back in order, for the stream)
    for item in items:
        if isinstance(item, RequestFailed) and not item.message.startswith("internal error"):
            raise APIError(400, item.message, param)


def check_sequences(state: ServerState, parsed: ParsedRequest) -> None:
    """A 400 for a request of more sequences (prompts x n) than the server allows, before any work is done."""
    limit, n = state.max_sequences_per_request, parsed.params.n
    count = (1 if parsed.prompts is None else len(parsed.prompts)) * n
    if count > limit:
        param = "n" if n > limit else "prompt"
        raise APIError(
            400, f"this request asks for {count} sequences (prompts x n); at most {limit} are allowed", param
        )


def check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.served_model_name:
        # NOTE: the served name defaults to the model's directory: an error message never shows it (see /v1/models)
        message = f"the model {str(model)[:100]!r} does not exist; GET /v1/models lists the one served"
        raise APIError(404, message, "model", type_="not_found_error", code="model_not_found")


async def run_request(
    request: web.Request,
    state: ServerState,
    parsed: ParsedRequest,
    prompts: list[list[int]],
    texts: list[str | None],
    chat: bool,
    key: KeyState | None = None,
    tool_parser: ToolParser | None = None,
    reasoning_parser: ReasoningParser | None = None,
    shape: ResponseShape | None = None,
) -> web.StreamResponse:
    """Admit the request, add one engine request per choice, and answer: an SSE stream or a JSON body, in the
    completions or chat shape, or `shape`'s (the Responses API)."""
    if state.draining:
        raise APIError(503, "the server is shutting down", type_="service_unavailable")
    if not state.client.alive:
        raise APIError(503, "the engine is not running", type_="service_unavailable")
    vocab = state.client.ready.vocab_size
    params = parsed.params
    new = len(prompts) * params.n
    if (
        state.max_num_queued_requests is not None
        and state.engine_requests + new > state.max_num_seqs + state.max_num_queued_requests
    ):
        raise APIError(503, "too many requests are queued; retry later", type_="service_unavailable")
    where = "messages" if chat else "prompt"
    for ids in prompts:
        if len(ids) > state.max_model_len:  # (first: the ids' check below is as long as the list)
            raise context_overflow(state, where, len(ids))
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        if params.max_tokens is None and len(ids) == state.max_model_len:  # no room for one token
            raise context_overflow(state, where, len(ids), 1)
        if params.max_tokens is not None and len(ids) + params.max_tokens > state.max_model_len:
            raise context_overflow(state, where, len(ids), params.max_tokens, "max_tokens")
    rows = sum(len(ids) for ids in prompts) * params.n
    if params.prompt_logprobs is not None and rows > state.max_prompt_logprob_rows:
        # NOTE: each row is k+1 entries of JSON (a token's text, its logprob, its rank): unbounded, a small request
        # becomes tens of megabytes built on the event loop
        raise APIError(
            400,
            f"this request asks for the log-probabilities of {rows} prompt tokens (prompts x n); at most "
            f"{state.max_prompt_logprob_rows} are allowed (--max-prompt-logprob-rows)",
            "prompt_logprobs" if parsed.prompt_logprobs is not None else "echo",
        )
    try:
        params.verify_vocab(vocab)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    # NOTE: a tool_choice's constraint wraps the tools' schemas, each checked already (_chat_prompt): checked whole,
    # the wrapper's three levels would count against a schema's depth (31 levels alone, refused under "required")
    if params.structured_output is not None and parsed.constraint_param != "tools":
        await check_structured_output(
            state, params.structured_output, parsed.constraint_param or "response_format", key
        )

    if key is not None:
        room = state.max_model_len - max(len(ids) for ids in prompts)
        key.fit_max_tokens(parsed, sum(len(p) for p in prompts) * params.n, len(prompts) * params.n, room)
        params = parsed.params
    base = shape.id if shape is not None else ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    queue = Inbox()
    choices: dict[str, Choice] = {}
    if reasoning_parser is not None:  # (chat: one prompt) a template that opens <think> ends the prompt with it
        tail = state.tokenizer.decode(prompts[0][-8:], skip_special_tokens=False)
        reasoning_parser.read_request(tail, constrained=params.structured_output is not None)
        if reasoning_parser.needs_special_tokens:  # (harmony's channels are special tokens)
            params = parsed.params = dataclasses.replace(params, skip_special_tokens=False)
    wire = {k: v for k, v in dataclasses.asdict(params).items() if k != "n"}  # plain data, as msgpack needs
    for i, ids in enumerate(prompts):
        for j in range(params.n):
            index = i * params.n + j
            rid = f"{base}-{index}"
            text = TextStream(
                state.tokenizer,
                ids,
                params.stop,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
            reply = None
            if tool_parser is not None or reasoning_parser is not None or shape is not None:
                tools = None if tool_parser is None else ToolCallStream(tool_parser, parsed.parallel_tool_calls)
                reply = ChatReply(reasoning_parser, tools)
            choices[rid] = Choice(index, rid, ids, text, key=key, reply=reply)
    prompt_tokens = sum(len(p) for p in prompts) * params.n  # every sequence's prompt is computed (or cached) anew
    if key is not None:  # 429 here: the engine never sees a rejected request
        key.admit(prompt_tokens, len(choices) * (params.max_tokens or 0))
    state.in_flight += 1
    state.engine_requests += len(choices)
    state.metrics.request_started(prompt_tokens)
    start = time.monotonic()
    try:
        for rid, choice in choices.items():
            j = choice.index % params.n
            # each of the n choices draws its own stream; a seed's range is that of a torch.Generator
            seed = None if params.seed is None else (params.seed + j) % 2**64
            state.client.add_request(rid, choice.prompt_ids, dict(wire, seed=seed), queue)
            choice.engine = state.client.engine_index(rid)
        if params.structured_output is not None:  # (a grammar that fails is a 400 naming its parameter)
            await _first_word(queue, parsed.constraint_param or "response_format")
        if shape is not None:
            return await shape.reply(request, state, next(iter(choices.values())), queue)
        if parsed.stream:
            return await stream_response(request, state, parsed, choices, queue, base, created, chat, texts)
        await collect(state, choices, queue)
        return web.json_response(final_body(state, parsed, choices, base, created, chat, texts))
    finally:
        if key is not None:
            key.release()
        state.in_flight -= 1
        state.engine_requests -= len(choices)
        unfinished = [rid for rid, c in choices.items() if c.finish_reason is None]
        state.client.abort(unfinished)  # a disconnect, an error (even midway through adding): free the blocks
        for rid in choices:
            state.client.release(rid)
        state.metrics.request_finished(time.monotonic() - start, choices.values())
