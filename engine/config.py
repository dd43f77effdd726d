"""Engine configuration: one frozen dataclass, validated when made, with vLLM's names.

It imports no torch: the API-server process and `kiln --help` read it too. The engine core turns its names into
devices and dtypes (`kiln.engine.core.startup`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import MISSING, dataclass, fields

from kiln.engine.kv_events_config import KVEventsConfig
from kiln.engine.models.default_model import DEFAULT_MODEL
from kiln.engine.spec_decode.config import SpeculativeConfig

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")  # auto: what the model holds (presets: dummy)
QUANTIZATIONS = ("fp8",)  # --quantization: a 16-bit checkpoint's linear layers quantized at load
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8 = fp8_e4m3 (scaled as the checkpoint says)
ATTENTION_BACKENDS = ("torch", "triton")  # kiln.backends.attention's registry (a test holds the two together)
CUDAGRAPH_MODES = ("full_and_piecewise", "piecewise", "none")
EXECUTOR_BACKENDS = ("mp", "ray")  # where tensor-parallel ranks 1..N-1 run (--distributed-executor-backend)


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # a preset, a directory, a GGUF file or a Hub id (kiln.engine.models.model_dir)
    tokenizer: str | None = None  # a directory or Hub id; default: the model's (or the built-in one for presets)
    revision: str | None = None  # a Hub model's branch, tag or commit (default: main)
    download_dir: str | None = None  # where Hub models are kept (default: the Hugging Face cache)
    gguf_file: str | None = None  # the GGUF file to read in a model directory or Hub repo that holds several
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    load_format: str = "auto"  # auto: dummy for presets, else the checkpoint's (safetensors, pt or gguf)
    quantization: str | None = None  # fp8: quantize the linear layers at load (an FP8 checkpoint is read as it is)
    seed: int = 0
    max_model_len: int | None = None  # default: the positions (a window, on a backend without windows)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # fp8 / fp8_e4m3: K and V stored as e4m3 (about twice the blocks)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; on CPU the default is 1 GiB
    num_kv_blocks: int | None = None  # override the sizing (tests use it to force preemption)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no Dynamo, no Inductor, no CUDA graphs
    attention_backend: str | None = None  # default: per device
    compile_cache_dir: str | None = None  # default: ~/.cache/kiln/compile
    cudagraph_mode: str = "full_and_piecewise"  # or "piecewise", "none"
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # default: a vLLM-like list up to 2 * max_num_seqs
    async_scheduling: bool = True  # schedule step N+1 while the GPU runs step N
    tensor_parallel_size: int = 1  # ranks (GPUs) each layer is split across; ranks 1..N-1 are worker processes
    data_parallel_size: int = 1  # `kiln serve`: engine cores behind the API server, each a whole copy of the model
    # Where the tensor-parallel ranks run (vLLM's names): "mp", processes on this node and, with nnodes > 1, on
    # nodes that join through torch.distributed's store at master_addr:master_port (`kiln serve --headless` there);
    # "ray", actors in a placement group over the Ray cluster Kiln joins (RAY_ADDRESS, else the local one)
    distributed_executor_backend: str = "mp"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    generation_config: str = "auto"  # auto: generation_config.json's sampling fields are the defaults; vllm: not
    cpu_threads: int | None = None  # threads a rank computes with on the CPU (default: the free cores less one)
    # compiled grammars the engine keeps for reuse, in MiB (vLLM's VLLM_XGRAMMAR_CACHE_MB); one may take a quarter
    xgrammar_cache_mb: int = 512
    # speculative decoding (vLLM's keys): {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b}; a dict or its JSON text, read into a SpeculativeConfig
    speculative_config: SpeculativeConfig | None = None
    # KV-cache events for a KV-aware router (vLLM's keys): {"enable_kv_cache_events": true, "publisher": "zmq",
    # "endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ..., "buffer_steps": ...}; a dict or its JSON text
    kv_events_config: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        for f in fields(self):  # None where a field has a value by default: that value (vLLM reads None so)
            if getattr(self, f.name) is None and f.default is not None and f.default is not MISSING:
                object.__setattr__(self, f.name, f.default)

        def positive(name: str, value: int | None) -> None:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_memory_bytes",
            "tensor_parallel_size",
            "data_parallel_size",
            "nnodes",
            "cpu_threads",
            "xgrammar_cache_mb",
        ):
            positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto or one of {sorted(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of {list(LOAD_FORMATS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {list(QUANTIZATIONS)}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; choose one of {list(ATTENTION_BACKENDS)}"
            )
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"unknown cudagraph_mode {self.cudagraph_mode!r}; choose one of {list(CUDAGRAPH_MODES)}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(s, int) or s < 1 for s in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {self.cudagraph_capture_sizes!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"unknown generation_config {self.generation_config!r}; choose auto or vllm")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        self._check_nodes()
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"unknown device {self.device!r}; choose auto, cpu or cuda[:N]")

    def _check_nodes(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"unknown distributed_executor_backend {self.distributed_executor_backend!r}; "
                f"choose one of {list(EXECUTOR_BACKENDS)}"
            )
        if self.nnodes > 1 and self.distributed_executor_backend == "ray":
            raise ValueError("with the ray backend, Ray places the ranks: leave out nnodes")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} is not a whole number of ranks on each of "
                f"{self.nnodes} nodes"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a port number, got {self.master_port!r}")


# The formats `kiln serve --tool-call-parser` reads tool calls in (kiln.engine.serving.tool_parsers), vLLM's names:
# hermes (Qwen2.5/3, Hermes: <tool_call>{...}</tool_call>), llama3_json (Llama 3.1-3.3's JSON calls), mistral
# ([TOOL_CALLS]), pythonic (Llama 4's [f(a=1)]), qwen3_coder (Qwen3-Coder, Qwen3.5/3.6: <function=f><parameter=p>),
# gemma4 (Gemma 4: <|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>), openai (gpt-oss's harmony: to=functions.f).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "gemma4", "openai")
# `--reasoning-parser` (kiln.engine.serving.reasoning): qwen3 (a reply that opens with <think>), deepseek_r1 (the
# template opened <think>: the reply thinks until </think>), openai_gptoss (gpt-oss's harmony: the analysis channel)
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")


@dataclass(frozen=True)
class ServerConfig:
    """`kiln serve`'s own settings, beside the engine's (vLLM's names)."""

    host: str = "127.0.0.1"  # loopback only unless asked
    port: int = 8000
    api_key: str | None = None  # require 'Authorization: Bearer KEY'
    api_keys_file: str | None = None  # keys with names and limits (kiln.engine.serving.api_keys); not with api_key
    served_model_name: str | None = None  # the model name clients use (default: the model argument)
    shutdown_timeout: float = 30.0  # seconds to drain in-flight requests after SIGTERM
    max_num_queued_requests: int | None = None  # requests admitted beyond max_num_seqs; more get 503 (None: no limit)
    max_sequences_per_request: int = 256  # prompts x n in one request; more is a 400 before any work
    # prompt tokens whose log-probabilities one request may ask for (prompt_logprobs, or echo with logprobs), each
    # sequence's counted: past it, a 400 (255 prompts x 511 tokens at k=20 once made 64 MB of JSON)
    max_prompt_logprob_rows: int = 32768
    engine_timeout: float = 60.0  # seconds without a word from the engine core before it is declared stuck and killed
    stream_idle_timeout: float = 30.0  # seconds a stream may sit unread before its request is aborted
    # connections: an idle one (before its first request, or between requests) and one whose request head has not
    # come whole are closed after timeout_keep_alive; a body must arrive whole in timeout_request_body; past
    # limit_concurrency open connections, a new one gets a 503 (uvicorn's names)
    timeout_keep_alive: float = 5.0
    timeout_request_body: float = 30.0
    limit_concurrency: int = 1024
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (and tools without a tool_choice): needs a parser
    tool_call_parser: str | None = None  # how tool calls are read from the model's text: one of TOOL_CALL_PARSERS
    reasoning_parser: str | None = None  # chat replies' <think> part as reasoning_content: one of REASONING_PARSERS
    # a special token's text in a chat message (`<|im_end|>`) is the token itself, not its characters
    parse_special_tokens_in_messages: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be a port number, 0 to 65535, not {self.port!r}")
        if self.api_key and self.api_keys_file:
            raise ValueError("give --api-key (or KILN_API_KEY) or --api-keys-file, not both")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown --tool-call-parser {self.tool_call_parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown --reasoning-parser {self.reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        for name in ("timeout_keep_alive", "timeout_request_body", "stream_idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")
        if not isinstance(self.limit_concurrency, int) or self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be at least 1, got {self.limit_concurrency}")
        if not isinstance(self.max_sequences_per_request, int) or self.max_sequences_per_request < 1:
            raise ValueError(f"--max-sequences-per-request must be at least 1, got {self.max_sequences_per_request}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def kiln_version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
