"""`kiln` command line: `kiln generate` (prompts in, completions and tokens/s out), `kiln serve` (the OpenAI API) and
`kiln precompile` (fill the compile cache). It imports no torch until a command runs: `kiln --help` is quick."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from kiln.backends import environment
from kiln.engine.config import (
    ATTENTION_BACKENDS,
    CUDAGRAPH_MODES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ServerConfig,
)
from kiln.engine.models.default_model import DEFAULT_MODEL
from kiln.engine.models.presets import PRESETS

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about a kiln:",
    "def fibonacci(n):",
    "Three facts about the moon:",
]
DEFAULT_QUESTIONS = ["What is the capital of France?", "Write a haiku about a kiln.", "What is 12 times 7?"]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand; names follow vLLM's."""
    d = EngineConfig()
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"a Hugging Face Hub id (ORG/NAME), a local model directory, a GGUF file, or a preset of a real shape "
        f"with random weights, for benchmarks ({', '.join(PRESETS)}); default {DEFAULT_MODEL}, fetched on first use",
    )
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory or Hub id (default: the model's)")
    parser.add_argument("--revision", default=None, help="a Hub model's branch, tag or commit (default: main)")
    parser.add_argument(
        "--download-dir", default=None, help="where Hub models are downloaded (default: the Hugging Face cache)"
    )
    parser.add_argument(
        "--gguf-file", default=None, help="the GGUF file to read from a model directory or Hub repo (e.g. a Q4_K_M)"
    )
    parser.add_argument("--dtype", default=d.dtype, help="auto, bfloat16, float16 or float32")
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    parser.add_argument(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="auto: what the model holds; dummy: random weights of its shape (presets always use them)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: quantize a 16-bit checkpoint's linear layers to FP8 at load (FP8 checkpoints need no flag)",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; fp8 (= fp8_e4m3): K and V stored as e4m3, about twice the blocks",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="override KV cache sizing")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    parser.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS)
    parser.add_argument(
        "--compile-cache-dir",
        default=None,
        help="default ~/.cache/kiln/compile (set KILN_DISABLE_COMPILE_CACHE=1 to disable the cache)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="wait for each step's tokens before scheduling the next",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split each layer across N GPUs (ranks 1..N-1 run in worker processes)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=d.data_parallel_size,
        help="(kiln serve) N engine cores behind the one API server, each a whole copy of the model on GPUs of its "
        "own (N x --tensor-parallel-size in all); requests go where their prefix is cached, else to the least loaded",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        default=d.distributed_executor_backend,
        choices=EXECUTOR_BACKENDS,
        help="where tensor-parallel ranks 1..N-1 run: mp (processes here, and on --nnodes' other nodes) or ray "
        "(actors in a placement group over the Ray cluster this node belongs to; Kiln starts none)",
    )
    parser.add_argument("--nnodes", type=int, default=d.nnodes, help="nodes the tensor-parallel ranks are spread over")
    parser.add_argument("--node-rank", type=int, default=d.node_rank, help="this node's index among --nnodes")
    parser.add_argument(
        "--master-addr", default=d.master_addr, help="node 0's address, where the ranks of every node meet"
    )
    parser.add_argument("--master-port", type=int, default=d.master_port, help="node 0's port for the rendezvous")
    parser.add_argument(
        "--generation-config",
        default=d.generation_config,
        choices=("auto", "vllm"),
        help="auto: the model's generation_config.json sets the default temperature, top_p, top_k, "
        "min_p and repetition_penalty; vllm: the built-in defaults",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="threads the engine computes with on the CPU (default: OMP_NUM_THREADS, else the cores less one, so the "
        "API server and other processes are not fought for the cores)",
    )
    parser.add_argument(
        "--xgrammar-cache-mb",
        type=int,
        default=d.xgrammar_cache_mb,
        help="MiB of compiled grammars (structured output) the engine keeps for reuse, least recently used dropped "
        "first; one grammar may take a quarter of it, a larger one fails its request (vLLM: VLLM_XGRAMMAR_CACHE_MB)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON with vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4} (drafts from the request\'s own text, verified exactly; '
        'looked up on the device on a GPU, "ngram_gpu" anywhere)',
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="publish the prefix cache's KV-cache events for a KV-aware router, as JSON with vLLM's keys: "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000}',
    )
    parser.add_argument("--cudagraph-mode", default=d.cudagraph_mode, choices=CUDAGRAPH_MODES)
    parser.add_argument(
        "--cudagraph-capture-sizes",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="comma-separated token counts (default: 1,2,4,8,...)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.engine import LLM, SamplingParams  # noqa: PLC0415  (keeps `kiln --help` fast)

    prompts = args.prompt or (DEFAULT_QUESTIONS if args.chat else DEFAULT_PROMPTS)
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    if llm.uses_dummy_weights:
        print(f"NOTE: {args.model} runs with DUMMY (random) weights: the text below is noise, the speed is real.")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    inputs = prompts
    if args.chat:  # each prompt a user's message, rendered by the model's chat template
        if getattr(llm.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{args.model} has no chat template: leave out --chat")
        inputs = [_chat_ids(llm.tokenizer, prompt) for prompt in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for shown_prompt, output in zip(prompts, outputs):
        prompt = shown_prompt if isinstance(shown_prompt, str) else output.prompt_token_ids
        completion = output.outputs[0]
        # NOTE: a preset's built-in tokenizer knows few of the model's ids; unknown ones decode to nothing.
        shown = repr(completion.text) if completion.text.strip() else f"(token ids) {completion.token_ids}"
        print(f"\n>>> {prompt!r}\n{shown}")
    print(
        f"\n{len(outputs)} prompts, {num_tokens} tokens in {elapsed:.2f}s: {num_tokens / elapsed:.1f} tokens/s "
        f"({llm.engine.device}, {str(llm.engine.dtype).removeprefix('torch.')})"
    )
    return 0


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(rendered["input_ids"])


def cmd_precompile(args: argparse.Namespace) -> int:
    """Fill the compile cache for this model and these flags, then exit: a deployment's warm-up job."""
    from kiln.engine.core.startup import build_executor, model_memo  # noqa: PLC0415
    from kiln.engine.models.source import resolve_tokenizer_class  # noqa: PLC0415
    from kiln.engine.text.tokenizer import tokenizer_dir_of  # noqa: PLC0415

    config = engine_config_from_args(args)
    if config.enforce_eager:
        print("kiln: error: precompile with --enforce-eager has nothing to compile", file=sys.stderr)
        return 2
    # what a warm start reads of the tokenizer too (its class, without transformers' auto classes)
    tokenizers = tokenizer_dir_of(config)
    if tokenizers is not None:
        resolve_tokenizer_class(tokenizers, model_memo(config))
    # Weights do not change what is compiled: random ones skip reading the checkpoint (and a draft model's: its
    # chain runs uncompiled).
    executor = build_executor(dataclasses.replace(config, load_format="dummy"), with_draft=False)
    stats = executor.startup_stats
    executor.close()
    print(f"compile cache: {stats['compile_cache_dir']}")
    for key, value in stats.items():
        print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    if args.headless:  # tensor-parallel ranks of node --node-rank only: no engine core, no API server
        from kiln.engine.core.headless import run_headless  # noqa: PLC0415

        return run_headless(engine_config_from_args(args))
    from kiln.engine.serving.api_server import serve  # noqa: PLC0415

    names = {f.name for f in dataclasses.fields(ServerConfig)} - {"api_key"}
    settings = {k: v for k, v in vars(args).items() if k in names}
    # an empty key is most often a variable that was never set (`--api-key "$KEY"`): serving with no auth then would
    # be a surprise, so it is refused
    given, source = (
        (args.api_key, "--api-key") if args.api_key is not None else (environment.ENV.api_key, "KILN_API_KEY")
    )
    if given is not None and not given.strip():
        raise ValueError(
            f"{source} is empty (an unset variable?): give the key, or leave {source} out to serve with no auth"
        )
    server = ServerConfig(api_key=given, **settings)
    config = engine_config_from_args(args)
    return asyncio.run(serve(config, server))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: an LLM engine built on torch.compile.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and report tokens/s")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four sample prompts")
    gen.add_argument(
        "--chat", action="store_true", help="each prompt is a user's message, rendered by the model's chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    gen.set_defaults(func=cmd_generate)
    pre = sub.add_parser("precompile", help="fill the compile cache for a model and flags, then exit")
    add_engine_args(pre)
    pre.set_defaults(func=cmd_precompile)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(srv)
    d = ServerConfig()
    srv.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=d.port)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set KILN_API_KEY)")
    srv.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="TOML (or .json) file of API keys, stored as SHA-256 hashes, each with a name and optional "
        "limits; SIGHUP reloads it (see README)",
    )
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    srv.add_argument(
        "--headless",
        action="store_true",
        help="run this node's tensor-parallel ranks only (node --node-rank of --nnodes; node 0 serves)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="seconds to drain in-flight requests after SIGTERM",
    )
    srv.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="requests admitted beyond --max-num-seqs; more get 503 at once (default: no limit)",
    )
    srv.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=d.max_sequences_per_request,
        help="the most sequences (prompts x n) one request may ask for; more is a 400",
    )
    srv.add_argument(
        "--max-prompt-logprob-rows",
        type=int,
        default=d.max_prompt_logprob_rows,
        help="the most prompt tokens (each sequence's) one request may ask log-probabilities of; more is a 400",
    )
    srv.add_argument(
        "--engine-timeout",
        type=float,
        default=d.engine_timeout,
        help="seconds without a word from the engine core before it is declared stuck and killed",
    )
    srv.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=d.stream_idle_timeout,
        help="seconds a streaming client may leave its stream unread before the request is aborted",
    )
    srv.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=d.timeout_keep_alive,
        help="seconds an idle connection stays open, and the most a request's head may take to arrive",
    )
    srv.add_argument(
        "--timeout-request-body",
        type=float,
        default=d.timeout_request_body,
        help="seconds a request's body may take to arrive whole; slower is a 408",
    )
    srv.add_argument(
        "--limit-concurrency",
        type=int,
        default=d.limit_concurrency,
        help="open connections at most; a new one past it gets a 503 and is closed",
    )
    srv.add_argument(
        "--parse-special-tokens-in-messages",
        action="store_true",
        help="read a special token's text in a chat message (e.g. <|im_end|>) as the token; by default it stays "
        "plain text, so a user cannot open or close turns",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide when to call tools (tool_choice 'auto', the default with tools); needs "
        "--tool-call-parser",
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="the format the model writes tool calls in, read from its output",
    )
    srv.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="send a chat reply's thinking (<think>...</think>) as reasoning_content, apart from its content",
    )
    srv.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, TypeError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
