"""The OpenAI-compatible HTTP server (aiohttp) in front of the engine-core process.

It owns HTTP, auth, tokenization (off the event loop), chat templates, detokenization and stop
strings, SSE streaming and metrics; the engine core owns everything that touches the GPU.
Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/messages (and
/v1/messages/count_tokens: Anthropic's Messages API), GET /v1/models (and /v1/models/{id}), POST /tokenize,
POST /detokenize, GET /v1/usage, GET /version (all under the API key when one is set, given as
`Authorization: Bearer KEY` or `x-api-key: KEY`), GET /health and GET /metrics (always open). With `--api-keys-file`
the keys and their limits come from `api_keys.KeyStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import posixpath
import signal
from typing import Any

from aiohttp import web

from kiln.engine.config import EngineConfig, ServerConfig, kiln_version
from kiln.engine.models.model_dir import generation_defaults, model_dir_of
from kiln.engine.serving.anthropic_api import MessageShape, anthropic_error, is_anthropic_path
from kiln.engine.serving.anthropic_requests import (
    context_error,
    in_anthropic_terms,
    parse_count_tokens,
    parse_messages,
)
from kiln.engine.serving.api_keys import KeyState, KeyStore, invalid_key_error
from kiln.engine.serving.completion import (
    ServerState,
    check_model,
    check_sequences,
    check_structured_output,
    encode_chat,
    encode_prompt,
    run_request,
)
from kiln.engine.serving.data_parallel import engine_client
from kiln.engine.serving.http_server import Runner, check_port_free, error_response, raise_open_files_limit
from kiln.engine.serving.metrics import KeyMetrics, ServerMetrics
from kiln.engine.serving.openai_requests import APIError, parse_chat, parse_completion
from kiln.engine.serving.reasoning import REASONING_PARSERS
from kiln.engine.serving.request_body import MAX_BODY_BYTES, checked, read_json
from kiln.engine.serving.responses import STREAM, ServerShutdown
from kiln.engine.serving.responses_api import ResponseShape
from kiln.engine.serving.responses_requests import in_responses_terms, parse_responses
from kiln.engine.serving.tool_calls import tool_parser, tool_schema_checks
from kiln.engine.text.tokenizer import load_tokenizer, tokenizer_dir_of

logger = logging.getLogger("kiln")

OPEN_PATHS = ("/health", "/metrics")
KEY = "kiln.api_key"  # the caller's api_keys.KeyState on a request, with --api-keys-file


def build_app(state: ServerState, keys: KeyStore | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors_middleware, auth_middleware])
    app["state"] = state
    app["keys"] = keys
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses_create)
    app.router.add_post("/v1/messages", messages_create)
    app.router.add_post("/v1/messages/count_tokens", messages_count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_card)  # a served name may hold slashes (org/model)
    app.router.add_get("/v1/usage", usage)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


# ---- middlewares ---------------------------------------------------------------------------------------


def _path(request: web.Request) -> str:
    return posixpath.normpath("/" + request.path.lstrip("/"))  # `//v1/x` and `/v1/../v1/x` are `/v1/x`


def _error_response(request: web.Request, error: APIError) -> web.Response:
    """`error` in the shape of the API its path belongs to: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if is_anthropic_path(_path(request)):
        return error_response(error, *anthropic_error(error))
    return error_response(error)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Errors as OpenAI error objects (Anthropic's under its paths). NOTE: once a stream has begun
    (`responses.sse_response`, which ends it with an error event itself) an error after it is only logged: a second
    response would land inside the stream."""
    try:
        return await handler(request)
    except APIError as e:
        if (stream := request.get(STREAM)) is not None:
            return stream
        return _error_response(request, e)
    except web.HTTPRequestEntityTooLarge:
        return _error_response(request, APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes"))
    except web.HTTPException as e:
        if e.status >= 400:
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return _error_response(request, APIError(e.status, e.reason, type_=kind))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        if (stream := request.get(STREAM)) is not None:
            return stream
        return _error_response(request, APIError(500, "internal server error", type_="internal_error"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    state: ServerState = request.app["state"]
    keys: KeyStore | None = request.app["keys"]
    if _path(request) in OPEN_PATHS:
        return await handler(request)
    given = _authorization(request)
    if keys is not None:
        request[KEY] = keys.authenticate(given)
        valid = request[KEY] is not None
    else:
        expected = f"Bearer {state.api_key}".encode()
        # a header's non-UTF-8 bytes come as lone surrogates (aiohttp decodes it with surrogateescape)
        valid = not state.api_key or hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected)
    if not valid:
        return _error_response(request, invalid_key_error())
    return await handler(request)


def _authorization(request: web.Request) -> str:
    """The request's `Authorization` header, or `Bearer KEY` for an `x-api-key: KEY` header (Anthropic's clients)."""
    # NOTE: with two keys given, which one a proxy in front checked is not known
    given = request.headers.getall("Authorization", [])
    api_key = request.headers.getall("x-api-key", [])
    for name, values in (("Authorization", given), ("x-api-key", api_key)):
        if len(values) > 1:
            raise APIError(400, f"the request has more than one {name} header")
    if api_key:
        if given and given[0] != f"Bearer {api_key[0]}":
            raise APIError(400, "the request has both Authorization and x-api-key headers, with different keys")
        return f"Bearer {api_key[0]}"
    return given[0] if given else ""


# ---- simple routes -------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    if not state.client.alive or state.client.death is not None:  # (a data-parallel core's death too)
        return web.json_response({"status": "engine dead", "reason": state.client.death}, status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    """vLLM's route: a router (SMG) that finds it takes the server for a vLLM worker and reads its vllm:* metrics."""
    return web.json_response({"version": kiln_version()})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body, content_type = state.metrics.render(state.client.stats, state.client.alive, state.client.engine_stats)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def usage(request: web.Request) -> web.Response:
    key: KeyState | None = request.get(KEY)
    if key is None:
        raise APIError(404, "usage is kept per API key: start the server with --api-keys-file", type_="not_found_error")
    return web.json_response(key.usage_body())


def _card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kiln",
        "max_model_len": state.max_model_len,
    }


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request.app["state"])]})


async def model_card(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    check_model(state, {"model": request.match_info["model"]})
    return web.json_response(_card(state))


@contextlib.contextmanager
def _key_seat(request: web.Request):
    """The caller's key's request limits (requests per minute, requests in flight) held for a tokenizer route: it
    drives the tokenizer pool every request shares."""
    key: KeyState | None = request.get(KEY)
    if key is None:
        yield
        return
    key.admit(0)
    try:
        yield
    finally:
        key.release()


async def tokenize(request: web.Request) -> web.Response:
    with _key_seat(request):
        return await _tokenize(request)


async def _tokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_json(request)
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        ids = await encode_prompt(state, body["prompt"])
    elif isinstance(body, dict) and isinstance(body.get("messages"), list):
        parsed = await checked(request, parse_chat, {**body, "max_tokens": 1}, state.sampling_defaults)
        ids = await encode_chat(state, parsed.messages, parsed.tools, parsed.chat_template_kwargs)
    else:
        raise APIError(400, "give 'prompt' (a string) or 'messages'", "prompt")
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    with _key_seat(request):
        return await _detokenize(request)


async def _detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = state.client.ready.vocab_size
    if isinstance(tokens, list) and len(tokens) > state.max_model_len:  # (no prompt and completion is longer)
        raise APIError(400, f"at most {state.max_model_len} token ids (--max-model-len) are detokenized", "tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "'tokens' must be a list of token ids", "tokens")
    if any(not 0 <= t < vocab for t in tokens):
        raise APIError(400, f"token ids must lie in [0, {vocab})", "tokens")
    text = await asyncio.get_running_loop().run_in_executor(state.pool, state.tokenizer.decode, tokens)
    return web.json_response({"prompt": text})


# ---- completions ---------------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    body = await read_json(request)
    parsed = await checked(request, parse_completion, body, state.sampling_defaults)
    check_model(state, body)
    check_sequences(state, parsed)
    if key := request.get(KEY):
        key.apply_max_tokens(parsed, body)
        key.check_seat()  # (before tokenizing)
    prompts = [await encode_prompt(state, p) if isinstance(p, str) else p for p in parsed.prompts]
    texts = [p if isinstance(p, str) else None for p in parsed.prompts]
    return await run_request(request, state, parsed, prompts, texts, chat=False, key=key)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    body = await read_json(request)
    parsed = await checked(request, parse_chat, body, state.sampling_defaults)
    asked = body.get("max_tokens") if body.get("max_tokens") is not None else body.get("max_completion_tokens")
    prompt, key, parsers = await _chat_prompt(request, state, parsed, body, asked)
    return await run_request(request, state, parsed, [prompt], [None], True, key, **parsers)


async def responses_create(request: web.Request) -> web.StreamResponse:
    """The Responses API: a chat request underneath (`responses_requests`), answered as a response object."""
    state: ServerState = request.app["state"]
    body = await read_json(request)
    parsed, body = await checked(request, parse_responses, body, state.sampling_defaults)
    try:
        prompt, key, parsers = await _chat_prompt(request, state, parsed, body, body.get("max_output_tokens"))
        shape = ResponseShape(body, parsed)
        return await run_request(request, state, parsed, [prompt], [None], True, key, shape=shape, **parsers)
    except APIError as e:
        raise in_responses_terms(e) from None


async def _chat_prompt(request: web.Request, state: ServerState, parsed, body: dict[str, Any], max_tokens: Any):
    """A chat request's checks (model, tools, the key's seat and caps) and its rendered prompt's token ids; with the
    key and the parsers its reply is read with. `max_tokens`: what the body asked for, as the key's cap sees it."""
    check_model(state, body)
    check_sequences(state, parsed)
    key = request.get(KEY)
    if key:
        key.check_seat()  # (limits first: a key at its limits costs no schema check and no tokenizing)
    parser = tool_parser(parsed, state.auto_tool_parser)  # (sets the constraint of a required or named choice)
    for schema in tool_schema_checks(parsed):
        await check_structured_output(state, schema, "tools", key)
    prompt = await encode_chat(state, parsed.messages, parsed.tools, parsed.chat_template_kwargs)
    if key:
        key.apply_max_tokens(parsed, {"max_tokens": max_tokens}, room=state.max_model_len - len(prompt))
    reasoning = REASONING_PARSERS[state.reasoning_parser]() if state.reasoning_parser else None
    return prompt, key, {"tool_parser": parser, "reasoning_parser": reasoning}


# ---- Anthropic's Messages API ----------------------------------------------------------------------------


async def messages_create(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API: a chat request underneath (`anthropic_requests`), answered as a message."""
    state: ServerState = request.app["state"]
    body = await read_json(request)
    try:
        parsed = await checked(request, parse_messages, body, state.sampling_defaults)
        prompt, key, parsers = await _chat_prompt(request, state, parsed, body, body.get("max_tokens"))
        if error := context_error(len(prompt), parsed.params.max_tokens, state.max_model_len):
            raise error
        shape = MessageShape(parsed)
        return await run_request(request, state, parsed, [prompt], [None], True, key, shape=shape, **parsers)
    except APIError as e:
        raise in_anthropic_terms(e) from None


async def messages_count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a Messages request would take (its `usage.input_tokens`)."""
    with _key_seat(request):
        state: ServerState = request.app["state"]
        body = await read_json(request)
        try:
            parsed = await checked(request, parse_count_tokens, body, state.sampling_defaults)
            check_model(state, body)
            ids = await encode_chat(state, parsed.messages, parsed.tools)
        except APIError as e:
            raise in_anthropic_terms(e) from None
    return web.json_response({"input_tokens": len(ids)})


# ---- process lifecycle ---------------------------------------------------------------------------------


async def serve(config: EngineConfig, server: ServerConfig) -> int:
    """Start the engine core, serve until SIGTERM/SIGINT, drain, stop the engine, return 0.
    SIGHUP reloads `server.api_keys_file`. A stream left unread for `server.stream_idle_timeout` seconds is aborted."""
    name = server.served_model_name or config.model
    server_metrics = ServerMetrics(name, config.data_parallel_size)
    # A bad key file, tokenizer folder or generation_config.json fails here, before the engine spends minutes starting.
    keys = None
    if server.api_keys_file is not None:
        keys = KeyStore(server.api_keys_file, KeyMetrics(server_metrics.registry))
    loop = asyncio.get_running_loop()
    if keys is not None:  # NOTE: before the socket opens: SIGHUP's default action would kill the server
        loop.add_signal_handler(signal.SIGHUP, keys.reload_or_keep)
        logger.info("API keys: %d loaded from %s", len(keys), server.api_keys_file)
    tokenizer_path = tokenizer_dir_of(config)
    defaults = generation_defaults(model_dir_of(config)) if config.generation_config == "auto" else {}
    check_port_free(server.host, server.port)  # (a port in use is said now, not after minutes of start-up)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = engine_client(config, server.engine_timeout)
    starting, stopping = asyncio.ensure_future(client.start()), asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # SIGTERM while the engine starts: it is stopped too (`start` kills it when cancelled)
        logger.info("stopped during the engine's start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    stopping.cancel()
    ready = starting.result()
    try:
        return await _serve_ready(config, server, client, ready, keys, server_metrics, tokenizer_path, defaults, stop)
    finally:
        await client.shutdown()


async def _serve_ready(config, server, client, ready, keys, server_metrics, tokenizer_path, defaults, stop) -> int:
    """Serve with the engine up until `stop`, then drain; the caller stops the engine after."""
    name = server.served_model_name or config.model
    loop = asyncio.get_running_loop()
    # with the class the engine core resolved it to (as transformers' AutoTokenizer would, which imports torch)
    tokenizer = load_tokenizer(tokenizer_path, ready.tokenizer_class)
    if defaults:
        logger.info(
            "sampling defaults from the model's generation_config.json (--generation-config vllm: none): %s", defaults
        )
    state = ServerState(
        client,
        tokenizer,
        name,
        server.api_key,
        ready.max_model_len,
        server_metrics,
        max_num_seqs=config.max_num_seqs * config.data_parallel_size,
        max_num_queued_requests=server.max_num_queued_requests,
        max_sequences_per_request=server.max_sequences_per_request,
        max_prompt_logprob_rows=server.max_prompt_logprob_rows,
        write_timeout=server.stream_idle_timeout,
        body_timeout=server.timeout_request_body,
        sampling_defaults=defaults,
        auto_tool_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
        reasoning_parser=server.reasoning_parser,
        parse_special_tokens=server.parse_special_tokens_in_messages,
    )
    state.special_text  # noqa: B018 (built now, not by the first chat request's thread: it copies the tokenizer)
    raise_open_files_limit(server.limit_concurrency)
    runner = Runner(
        build_app(state, keys),
        server.limit_concurrency,
        handler_cancellation=True,
        access_log=None,
        auto_decompress=False,
        keepalive_timeout=server.timeout_keep_alive,
        lingering_time=server.timeout_keep_alive,  # (how long the rest of a body refused early is read and dropped)
    )
    await runner.setup()
    site = web.TCPSite(runner, server.host, server.port)
    try:
        await site.start()
    except OSError as e:  # taken while the engine started
        await runner.cleanup()
        raise ValueError(f"cannot listen on {server.host}:{server.port} ({e.strerror or e}); choose --port") from None
    server_metrics.engine_started(ready, config)
    logger.info("serving %s on http://%s:%d (engine ready: %s)", name, server.host, server.port, ready.startup_stats)
    print(f"kiln: serving {name} on http://{server.host}:{server.port}", flush=True)
    if str(ready.startup_stats.get("model_source", "")).startswith("preset"):
        print(f"NOTE: {config.model} runs with DUMMY (random) weights: its text is noise.", flush=True)

    await stop.wait()  # NOTE: a dead engine does not stop the server: /health says 503 and requests fail fast
    state.draining = True  # new requests get 503 from here on
    deadline = loop.time() + server.shutdown_timeout
    while state.in_flight and loop.time() < deadline and client.alive:
        await asyncio.sleep(0.05)
    if state.in_flight:  # drain time is up: what is left ends with a 503 (streams: an error event, then [DONE])
        logger.warning("shutting down with %d requests unfinished", state.in_flight)
        client.fail_all(ServerShutdown("the server is shutting down"))
        grace = loop.time() + 2.0  # for the handlers to write their error responses
        while state.in_flight and loop.time() < grace:
            await asyncio.sleep(0.02)
    await runner.cleanup()
    state.pool.shutdown(wait=False)
    state.grammar_checks.close()
    state.body_parsers.close()
    logger.info("server stopped")
    return 0
