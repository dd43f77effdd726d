#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks; logs under $OUT, a short table last.
# Usage (on the device): bash scripts/bench/gpu_check.sh STEP ...   (keep one call under 10 minutes: split steps)
#   install (first: the wheels carried in .whl — pyzmq, xgrammar, gguf... the device lacks — and this checkout,
#   editable, with the device's own python3 -m pip, no build isolation: the device reaches no index)
#   | tests | gpu-files (the gpu-marked tests a file at a time, each with its own limit) | kernel-tests | attention | startup | latency:MODEL | throughput:MODEL (eager, with the HF peer)
#   | throughput-compiled:MODEL (THROUGHPUT_ARGS="--max-num-seqs 64 --gpu-memory-utilization 0.95": more arguments of
#     bench_throughput.py, e.g. for a hybrid whose 256 recurrent states would not fit beside its weights) | ab-throughput:MODEL (BASE_SRC=DIR: this tree against another commit's source, cold
#     and warm starts alternating, scripts/dev/throughput_runs.py) | closed-engine (what a closed engine leaves on the GPU)
#   | serving:MODEL | soak:MODEL (SOAK_MINUTES) | gputests:FILE,FILE (GPUTESTS_ARGS="-m gpu") | breakdown:MODEL
#   | prompt-logprobs:MODEL (PROMPT_LEN=4096) | prompt-logprobs-http:MODEL (the same over HTTP, echo + logprobs) | profile:MODEL:BATCH | inductor-code:MODEL | gemv (GEMV_SWEEP=1: also a config sweep) | resources
#   | ncu (NCU_SHAPES=64x256,...: Nsight Compute on the decode kernel and the read)
#   | kv-capacity:MODEL (the KV cache's tokens against every layer global)
#   | spec:MODEL (speculative decoding, the engine's side: a step verifying 1 + k tokens a request against a plain one
#     at batch 1, 8, 64, k = 1..5, and end-to-end tok/s with oracle drafts at mean accepted lengths 1.5, 2, 3, 4;
#     SPEC_ARGS="--e2e-batches 1 --max-tokens 256" more arguments of scripts/bench/bench_spec.py)
#   | longctx:MODEL (decode at LONGCTX_PROMPTS=2048,32768 tokens of context, LONGCTX_BATCHES=1, LONGCTX_MODES=graphs;
#     the table ends with each long point's tok/s and roofline against the short one's)
#   | multiturn:MODEL (each turn's time to first token of a multi-turn chat, the prefix cache on and off, with the
#     tokens a turn hit; MULTITURN_MODES=graphs, MULTITURN_ARGS="--turns 4 --first-len 6144 --user-len 512
#     --answer-len 256" its sizes, the defaults: turn 4 follows ~8k tokens of history)
#   | moe-kernel:MODEL (the fused expert kernels alone; MOE_TOKENS=1,8,... MOE_CONFIGS=16x32x128x4x4,...: a tile sweep)
#   | gpt-oss-moe:MODEL (gpt-oss's MXFP4 and 16-bit expert kernels alone at 1-2,048 tokens, GB/s; MOE_TOKENS=1,8,...
#     MOE_CONFIGS=16x32x128x4x4,...: tiles beside the default)
#   | mxfp4-gemv:MODEL (scripts/dev/mxfp4_gemv.py: the MXFP4 experts as a GEMV a pair against the product kernel, after
#     its check; MOE_TOKENS=1,2,4,8 GEMV_CONFIGS=16x128,...: its BLOCK_NxBLOCK_K tiles)
#   | sweep (SPLIT_SWEEP=1,2,4,8 MIN_SPLIT_SWEEP=64,128 CONFIG_SWEEP=64x4x3,128x8x2: the decode kernel at other split
#     counts, smallest splits and launch configs, scripts/dev/sweep_decode.py; ATTENTION_MODEL=PRESET its shapes,
#     SWEEP_ARGS=--full-layers those of its full layers)
# STARTUP_MODELS=llama-3.1-8b only that model's starts, STARTUP_PROFILE=1 a cProfile of each warm start (and the Triton
# kernels it compiled), STARTUP_PRIME=1 an unmeasured start first (the machine's OS caches warm for every cold start),
# STARTUP_PYSPY=1 one more warm start sampled by py-spy (native frames; its wheel in .whl, /tmp/site/bin on PATH).
# LATENCY_HF=0 leaves Hugging Face out of a latency step (LATENCY_PROMPTS=32,2048,8192 its prompt lengths;
# LATENCY_HF_CACHE=dynamic times HF eager, as a mixture of experts must run there; a peer that cannot run the model
# is named in one line and Kiln's rows stand; LATENCY_ARGS="--decode-steps 8" more arguments, of longctx too).
# A Gated DeltaNet hybrid (qwen3.6-35b-a3b, qwen3.6-27b, qwen3.5-9b, qwen3-next-80b-a3b) runs the latency step as any
# model; its roofline counts each request's recurrent state read and written by every linear layer. Its bf16/FP8
# pair: latency:MODEL env:QUANT=fp8 latency:MODEL (a model Kiln does not quantize yet gets its one-line refusal where
# the table would be, and the steps after it run).
# kernel-tests runs the kernel tests (tests/backends) on the GPU, bf16 and fp16 too, each test's result on its own line
# (KERNEL_TESTS_TIMEOUT=540: their Triton compiles take most of it; give the step a call of its own),
# PROFILE_HOST=1 adds a cProfile of the host to a profile step (PROFILE_PROMPT=8192 its prompts' length, KV_DTYPE
# its cache, PROFILE_ARGS="--drafts=4" more arguments of scripts/dev/profile_step.py: a step verifying 4 drafts); ATTENTION_SHAPES=64x256,1x32768 only those points of `attention` (and `sweep`), ATTENTION_TIMEOUT=200 its limit, ATTENTION_PREFILL=1 adds the prefill points,
# ATTENTION_MODEL=qwen2.5-7b another preset's attention shapes, ATTENTION_WINDOW=1024 a sliding layer's decode beside
# each point's full one.
# Logs come back as $OUT/logs.tgz.
# env:VAR=VALUE exports VAR for the steps after it (an A/B, e.g. env:KILN_PDL=0 latency:llama-3.2-1b); their log
# names carry it. A latency or profile step run again under the same name gets a numbered log (_2, _3, ...).
# QUANT=fp8 / KV_DTYPE=fp8 run the latency, longctx and throughput-compiled steps (QUANT: the spec step too) with --quantization fp8 /
# --kv-cache-dtype fp8 (their logs' names carry them: set them with env:QUANT=fp8 between steps for a bf16/FP8 pair in
# one call, env:QUANT= to go back to bf16).
# TP=2 runs the latency, longctx, multiturn, throughput-compiled and profile steps with tensor parallelism over 2 GPUs
# (e.g. on nvidia-h200-x2: TP=2 bash scripts/bench/gpu_check.sh gputests:tests/engine/core/test_gpu_tensor_parallel.py
#  latency:llama-3.1-8b throughput-compiled:llama-3.1-8b profile:llama-3.1-8b:1).
# A step past its time limit gets SIGABRT first: with PYTHONFAULTHANDLER set, its log ends with every thread's
# Python stack (where it hung), then SIGKILL 15 s later.
set -u
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=${*:-tests attention throughput:qwen3-0.6b throughput:llama-3.2-1b}
summary="$OUT/summary.txt"
{ date -u +%F; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} | tee -a "$summary"

# `kiln serve MODEL` in the background ($server, $tok), with a tokenizer whose every id decodes to text (a
# preset's built-in one knows ~1,000 of them): each token then makes a streamed event, as with a real model
start_server() {
  tok=/tmp/kiln-tokenizer-$1
  python3 -c "import sys; from kiln.engine.models.source import resolve_model as r; from kiln.engine.text.tokenizer \
import synthetic_tokenizer as t; t(r(sys.argv[1]).model_config.vocab_size).save_pretrained(sys.argv[2])" "$1" "$tok"
  kiln serve "$1" --tokenizer "$tok" --port 8000 ${2:-} > "$OUT/serve_$1.log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
}

# A log's path without its extension, numbered (_2, _3, ...) when a step of the same name already wrote one
fresh() {
  local base=$1 n=2
  while [ -e "$base.log" ]; do base="${1}_$n"; n=$((n + 1)); done
  echo "$base"
}

tag=
for step in $steps; do
  case $step in
    env:*)
      # the log names carry each setting, its first 32 characters without = and , (a long value, e.g. a config
      # sweep, once made a name past the 255 a file may have); a name taken twice is numbered by `fresh`
      # the tag keeps its last 96 characters: settings add up, and a name past 255 leaves a step's log unwritten
      export "${step#env:}"; short=${step#env:}; short=${short//[=,]/}; tag="${tag}_${short:0:32}"; [ ${#tag} -gt 96 ] && tag=${tag: -96}
      echo "-- from here on: ${step#env:}" >> "$summary" ;;
    install)
      # NOTE: `pip` on the device is another interpreter's; `python3 -m pip` is the one the benchmarks run
      python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v "as the 'root' user" | tail -n 3
      python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "as the 'root' user" | tail -n 3
      python3 -c "import kiln.engine, zmq, gguf" && echo "installed kiln and the carried wheels" | tee -a "$summary" ;;
    resources)
      # registers, spills and shared memory of the hot kernels, compiled with the toolchain the engine uses here
      timeout -s ABRT -k 15 300 python3 scripts/dev/kernel_resources.py --check > "$OUT/resources.txt" 2>&1
      echo "kernel_resources --check: rc $? ($(grep -c . "$OUT/resources.txt") lines)" >> "$summary"
      grep -E "ptxas|spills" "$OUT/resources.txt" >> "$summary" ;;
    tests)
      # the gpu-marked tests, then the kernel tests, which run on the GPU (bf16/fp16 too) when it is there;
      # modules that import what the device lacks (openai, jsonschema) fail to collect and are passed over
      timeout -s ABRT -k 15 ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests --durations=8 --continue-on-collection-errors -o faulthandler_timeout=120 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 12
      echo "pytest -m gpu: $(tail -n 1 "$OUT/pytest_gpu.log")" >> "$summary" ;;
    gpu-files)
      # the gpu-marked tests file by file, each under its own limit (GPU_FILE_TIMEOUT=150; GPU_FILES=a.py,b.py only
      # those): a file past its limit costs that file's result alone, and each file's line reaches the summary
      files=${GPU_FILES:-$(grep -rl "pytest.mark.gpu" tests | sort | tr '\n' ',')}
      for f in ${files//,/ }; do
        log="$OUT/gpu_$(basename "$f" .py).log"
        timeout -s ABRT -k 15 ${GPU_FILE_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
          > "$log" 2>&1
        rc=$?; result=$(tail -n 1 "$log")
        [ $rc = 124 ] && result="timed out after ${GPU_FILE_TIMEOUT:-150} s, at: $(grep -E "^tests/" "$log" | tail -n 1)"
        echo "$f: rc $rc $result" | tee -a "$summary"
      done ;;
    kernel-tests)
      # -v: a run cut off by its time limit still names every test it got through, failed or passed
      timeout -s ABRT -k 15 ${KERNEL_TESTS_TIMEOUT:-540} python3 -m pytest -v -rf -p no:cacheprovider tests/backends 2>&1 \
        | tee "$OUT/pytest_kernels.log" | grep -E "FAILED|ERROR| passed| failed" | tail -n 30
      echo "kernel tests on GPU: $(grep -cE ' PASSED' "$OUT/pytest_kernels.log") passed, $(grep -cE ' FAILED' \
"$OUT/pytest_kernels.log") failed; $(tail -n 1 "$OUT/pytest_kernels.log")" >> "$summary"
      grep -E "^FAILED|^ERROR" "$OUT/pytest_kernels.log" >> "$summary" ;;
    startup)
      timeout -s ABRT -k 15 900 python3 scripts/bench/bench_startup.py --models ${STARTUP_MODELS:-llama-3.2-1b,llama-3.1-8b} \
        ${STARTUP_PROFILE:+--profile-warm $OUT/profile_warm} ${STARTUP_PRIME:+--prime} ${STARTUP_PYSPY:+--py-spy $OUT/pyspy} --json "$OUT/startup.json" 2>&1 \
        | tee "$OUT/startup.log" | tail -n 8
      tail -n 6 "$OUT/startup.log" >> "$summary" ;;
    attention)
      base=$(fresh "$OUT/attention$tag")
      timeout -s ABRT -k 15 ${ATTENTION_TIMEOUT:-200} python3 scripts/bench/bench_attention.py \
        ${ATTENTION_SHAPES:+--shapes $ATTENTION_SHAPES} ${ATTENTION_PREFILL:+--prefill} ${ATTENTION_MODEL:+--model $ATTENTION_MODEL} \
        ${ATTENTION_WINDOW:+--window $ATTENTION_WINDOW} --json "$base.json" 2>&1 | tee "$base.log" | tail -n 30
      echo "-- attention${tag}" >> "$summary"
      grep -A90 "^decode attention" "$base.log" >> "$summary" ;;
    ncu)
      # Nsight Compute on the decode kernel and the plainest read of the same bytes (NCU_SHAPES=64x256,64x2048)
      timeout -s ABRT -k 15 ${NCU_TIMEOUT:-300} ncu --target-processes all -k regex:'_decode_split_kernel|_read_kernel' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats ${NCU_ARGS:-} \
        python3 scripts/dev/ncu_decode.py ${NCU_SHAPES:+--shapes $NCU_SHAPES} > "$OUT/ncu.txt" 2>&1
      echo "ncu: rc $? ($(grep -c . "$OUT/ncu.txt") lines)" >> "$summary" ;;
    sweep)
      base=$(fresh "$OUT/sweep$tag")
      timeout -s ABRT -k 15 ${ATTENTION_TIMEOUT:-200} python3 scripts/dev/sweep_decode.py ${SPLIT_SWEEP:+--splits $SPLIT_SWEEP} \
        ${MIN_SPLIT_SWEEP:+--min-split $MIN_SPLIT_SWEEP} ${CONFIG_SWEEP:+--configs $CONFIG_SWEEP} ${ATTENTION_SHAPES:+--shapes $ATTENTION_SHAPES} \
        ${ATTENTION_MODEL:+--model $ATTENTION_MODEL} ${KV_DTYPE:+--kv-cache-dtype $KV_DTYPE} ${SWEEP_ARGS:-} 2>&1 | tee "$base.log" | tail -n 30
      echo "-- sweep${tag}" >> "$summary"  # (the table, or the points measured before the step's limit cut it)
      grep -A60 "^decode kernel alone" "$base.log" >> "$summary" || grep -E "^[0-9]+x[0-9]+ \{" "$base.log" >> "$summary" ;;
    gemv)
      timeout -s ABRT -k 15 ${GEMV_TIMEOUT:-300} python3 scripts/bench/bench_gemv.py ${GEMV_SWEEP:+--sweep} --json "$OUT/gemv.json" \
        2>&1 | tee "$OUT/gemv.log" | tail -n 60
      grep -A20 "^one-row matmul" "$OUT/gemv.log" >> "$summary" ;;
    moe-kernel:*)
      model=${step#moe-kernel:}
      timeout -s ABRT -k 15 ${MOE_TIMEOUT:-240} python3 scripts/bench/bench_moe.py --model "$model" ${MOE_TOKENS:+--tokens $MOE_TOKENS} \
        ${MOE_CONFIGS:+--configs $MOE_CONFIGS} --json "$OUT/moe_$model.json" 2>&1 | tee "$OUT/moe_$model.log" | tail -n 40
      grep -A40 "^fused MoE" "$OUT/moe_$model.log" >> "$summary" ;;
    gpt-oss-moe:*)
      model=${step#gpt-oss-moe:}
      timeout -s ABRT -k 15 ${MOE_TIMEOUT:-300} python3 scripts/bench/bench_gpt_oss_moe.py --model "$model" \
        ${MOE_TOKENS:+--tokens $MOE_TOKENS} ${MOE_CONFIGS:+--configs $MOE_CONFIGS} --json "$OUT/gpt_oss_moe_${model##*/}.json" 2>&1 \
        | tee "$OUT/gpt_oss_moe_${model##*/}.log" | tail -n 30
      grep -A30 "^gpt-oss MoE" "$OUT/gpt_oss_moe_${model##*/}.log" >> "$summary" ;;
    mxfp4-gemv:*)
      model=${step#mxfp4-gemv:}
      timeout -s ABRT -k 15 ${MOE_TIMEOUT:-200} python3 scripts/dev/mxfp4_gemv.py --bench --model "$model" \
        ${MOE_TOKENS:+--tokens $MOE_TOKENS} ${GEMV_CONFIGS:+--configs $GEMV_CONFIGS} 2>&1 \
        | tee "$OUT/mxfp4_gemv_${model##*/}.log" | tail -n 30
      grep -A30 "MXFP4 experts" "$OUT/mxfp4_gemv_${model##*/}.log" >> "$summary" ;;
    latency:*)
      model=${step#latency:}
      hf="--hf --hf-cache ${LATENCY_HF_CACHE:-static}"; [ "${LATENCY_HF:-1}" = 0 ] && hf=
      base=$(fresh "$OUT/latency_${model##*/}_tp${TP:-1}$tag")  # (a directory or Hub id: its last part)
      timeout -s ABRT -k 15 ${LATENCY_TIMEOUT:-300} python3 scripts/bench/bench_latency.py --model "$model" -tp ${TP:-1} ${QUANT:+--quantization $QUANT} \
        ${KV_DTYPE:+--kv-cache-dtype $KV_DTYPE} --modes ${LATENCY_MODES:-eager,graphs} \
        --batches ${LATENCY_BATCHES:-1,8,64} \
        --capture-sizes 1,2,4,8,16,32,64,128 ${LATENCY_PROMPTS:+--prompt-lens $LATENCY_PROMPTS} $hf ${LATENCY_ARGS:-} \
        --json "$base.json" 2>&1 | tee "$base.log" | tail -n 12
      grep -A40 "^decode latency" "$base.log" >> "$summary" ;;
    longctx:*)
      # decode at a long context against a short one: a hybrid's linear layers cost the same at any length, its
      # attention layers read more KV (issue 62's 32k within 10% of 2k)
      model=${step#longctx:}
      base=$(fresh "$OUT/longctx_${model##*/}_tp${TP:-1}$tag")
      timeout -s ABRT -k 15 ${LONGCTX_TIMEOUT:-420} python3 scripts/bench/bench_latency.py --model "$model" -tp ${TP:-1} \
        ${QUANT:+--quantization $QUANT} ${KV_DTYPE:+--kv-cache-dtype $KV_DTYPE} --modes ${LONGCTX_MODES:-graphs} \
        --batches ${LONGCTX_BATCHES:-1} --prompt-lens ${LONGCTX_PROMPTS:-2048,32768} --capture-sizes 1,2,4,8,16,32,64,128 \
        ${LATENCY_ARGS:-} --json "$base.json" 2>&1 | tee "$base.log" | tail -n 12
      echo "-- longctx:$model$tag" >> "$summary"
      grep -A40 "^decode latency" "$base.log" >> "$summary" ;;
    multiturn:*)
      # each turn's time to first token, the prefix cache (a hybrid's state snapshots) on and off
      model=${step#multiturn:}
      base=$(fresh "$OUT/multiturn_${model##*/}_tp${TP:-1}$tag")
      timeout -s ABRT -k 15 ${MULTITURN_TIMEOUT:-420} python3 scripts/bench/bench_multiturn.py --model "$model" -tp ${TP:-1} \
        --modes ${MULTITURN_MODES:-graphs} ${MULTITURN_ARGS:-} --json "$base.json" 2>&1 | tee "$base.log" | tail -n 12
      echo "-- multiturn:$model$tag" >> "$summary"
      grep -A40 "^multi-turn time to first token" "$base.log" >> "$summary" ;;
    breakdown:*)
      model=${step#breakdown:}
      timeout -s ABRT -k 15 ${BREAKDOWN_TIMEOUT:-420} python3 scripts/bench/bench_latency.py --model "$model" --breakdown \
        --modes ${BREAKDOWN_MODES:-eager,compiled,graphs} --batches ${BREAKDOWN_BATCHES:-1,2,4,8,16,32,64,128,256} \
        --capture-sizes 1,2,4,8,16,32,64,128,256 --json "$OUT/breakdown_$model.json" --plot "$OUT/breakdown_$model.png" \
        2>&1 | tee "$OUT/breakdown_$model.log" | grep -v Warning | tail -n 60
      grep " tok/s" "$OUT/breakdown_$model.log" >> "$summary" ;;
    profile:*)
      spec=${step#profile:}
      log="$(fresh "$OUT/profile_${spec//:/_}_tp${TP:-1}$tag").log"
      timeout -s ABRT -k 15 ${PROFILE_TIMEOUT:-240} python3 scripts/dev/profile_step.py --model "${spec%%:*}" -tp ${TP:-1} --batch "${spec##*:}" \
        ${PROFILE_HOST:+--host --top 40} ${KV_DTYPE:+--kv-cache-dtype $KV_DTYPE} ${PROFILE_PROMPT:+--prompt-len $PROFILE_PROMPT} ${PROFILE_ARGS:-} 2>&1 | tee "$log" | grep -v Warning | tail -n 80
      grep -A4 " GPU time per step" "$log" >> "$summary" ;;
    inductor-code:*)
      # Inductor's generated code for every piece (which kernels it made, and what it left unfused), gzipped.
      # NOTE: fresh cache folders, not TORCHINDUCTOR_FORCE_DISABLE_CACHES (standalone_compile cannot save then)
      model=${step#inductor-code:}
      TORCH_LOGS=output_code TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout -s ABRT -k 15 240 python3 -c "import sys; from kiln.engine import LLM; \
LLM(sys.argv[1], cudagraph_mode='none', max_model_len=512, compile_cache_dir=sys.argv[2])" "$model" "$(mktemp -d)" \
        2>&1 | gzip > "$OUT/inductor_code_$model.log.gz"
      echo "inductor code of $model: $(zcat "$OUT/inductor_code_$model.log.gz" | grep -c 'async_compile.triton(') Triton kernels compiled" \
        | tee -a "$summary" ;;
    kv-capacity:*)
      # the KV cache's tokens of context against every layer global (KV_MAX_MODEL_LEN, 32768)
      timeout -s ABRT -k 15 ${KV_TIMEOUT:-300} python3 scripts/bench/bench_kv_capacity.py --model "${step#kv-capacity:}" \
        --max-model-len ${KV_MAX_MODEL_LEN:-32768} --json "$OUT/kv_capacity.jsonl" 2>&1 | tee -a "$OUT/kv_capacity.log" | tail -n 3
      grep -A1 "^KV capacity" "$OUT/kv_capacity.log" | tail -n 2 >> "$summary" ;;
    spec:*)
      # the cost of verifying drafts and what drafts of a known quality buy (bench_spec.py; random weights give no
      # real acceptance, so an oracle drafter proposes the model's own greedy continuation, a share of it corrupted)
      model=${step#spec:}
      base=$(fresh "$OUT/spec_${model##*/}$tag")
      timeout -s ABRT -k 15 ${SPEC_TIMEOUT:-540} python3 scripts/bench/bench_spec.py --model "$model" ${QUANT:+--quantization $QUANT} ${SPEC_ARGS:-} \
        --json "$base.json" 2>&1 | tee "$base.log" | grep -v -E "^(step|end to end): \{" | tail -n 50
      echo "-- spec:$model$tag" >> "$summary"
      grep -A60 "^speculative decoding, the engine's side" "$base.log" >> "$summary" ;;
    gputests:*)
      files=${step#gputests:}
      timeout -s ABRT -k 15 ${TESTS_TIMEOUT:-200} python3 -m pytest -v -rf -p no:cacheprovider ${GPUTESTS_ARGS:-} ${files//,/ } --durations=5 2>&1 | tee "$OUT/pytest_$RANDOM.log" | tail -n 15 ;;
    serving:*)
      model=${step#serving:}
      start_server "$model"
      args="--num-requests 512 --input-len 256 --output-len 256"
      # all 512 at once (as the offline run gets them), then 256 at a time (a new one as one finishes)
      timeout -s ABRT -k 15 300 python3 scripts/bench/bench_serving.py $args --concurrency 512 --server-pid $server --json "$OUT/serving.jsonl" \
        | tail -n 16
      timeout -s ABRT -k 15 300 python3 scripts/bench/bench_serving.py $args --concurrency 256 --server-pid $server --json "$OUT/serving.jsonl" \
        | tail -n 16
      timeout -s ABRT -k 15 120 python3 scripts/bench/bench_serving.py $args --concurrency 1 --num-requests 32 --rate 2 \
        --json "$OUT/serving.jsonl" | tail -n 14   # low load: TTFT
      kill -TERM $server; wait $server
      timeout -s ABRT -k 15 300 python3 scripts/bench/bench_serving.py $args --offline-only --offline-model "$model" --tokenizer "$tok" \
        --json "$OUT/serving.jsonl" | tail -n 4
      tail -n 4 "$OUT/serving.jsonl" >> "$summary" ;;
    soak:*)
      # ~80% of the seats (max_num_seqs 256) busy for SOAK_MINUTES, 10% of the streams cancelled midway
      model=${step#soak:}
      start_server "$model"
      timeout -s ABRT -k 15 $(( ${SOAK_MINUTES:-4} * 60 + 120 )) python3 scripts/bench/soak.py --minutes ${SOAK_MINUTES:-4} \
        --concurrency 200 --server-pid $server --json "$OUT/soak.json" | tail -n 12
      kill -TERM $server; wait $server
      echo "soak: $(cat "$OUT/soak.json")" >> "$summary" ;;
    throughput-compiled:*)
      model=${step#throughput-compiled:}
      timeout -s ABRT -k 15 ${THROUGHPUT_TIMEOUT:-300} python3 scripts/bench/bench_throughput.py --model "$model" -tp ${TP:-1} ${QUANT:+--quantization $QUANT} ${THROUGHPUT_ARGS:-} \
        ${KV_DTYPE:+--kv-cache-dtype $KV_DTYPE} --json "$OUT/throughput.jsonl" 2>&1 \
        | tee "$OUT/throughput_compiled_${model}_tp${TP:-1}$tag.log" | tail -n 5
      echo "-- throughput-compiled:$model$tag" >> "$summary"
      tail -n 4 "$OUT/throughput_compiled_${model}_tp${TP:-1}$tag.log" >> "$summary" ;;
    prompt-logprobs:*)
      model=${step#prompt-logprobs:}
      timeout -s ABRT -k 15 ${PROMPT_LOGPROBS_TIMEOUT:-300} python3 scripts/bench/bench_prompt_logprobs.py --model "$model" \
        --prompt-len ${PROMPT_LEN:-4096} --json "$OUT/prompt_logprobs.jsonl" 2>&1 | tee "$OUT/prompt_logprobs_$model.log" | tail -n 8
      grep -A6 "^prompt logprobs" "$OUT/prompt_logprobs_$model.log" >> "$summary" ;;
    prompt-logprobs-http:*)
      # the same prompt as an echo + logprobs completion over HTTP (the prefix cache off, as a scored prompt skips it)
      model=${step#prompt-logprobs-http:}
      start_server "$model" "--no-enable-prefix-caching --max-model-len $(( ${PROMPT_LEN:-4096} + 128 ))"
      timeout -s ABRT -k 15 ${PROMPT_LOGPROBS_TIMEOUT:-300} python3 scripts/bench/bench_prompt_logprobs.py --url http://localhost:8000 \
        --prompt-len ${PROMPT_LEN:-4096} --json "$OUT/prompt_logprobs.jsonl" 2>&1 | tee "$OUT/prompt_logprobs_http_$model.log" | tail -n 5
      kill -TERM $server; wait $server
      grep -A3 "^prompt logprobs" "$OUT/prompt_logprobs_http_$model.log" >> "$summary" ;;
    closed-engine)
      # what an engine leaves on the GPU after close(): one that traces into an empty compile cache, then a warm one
      KILN_CACHE_DIR=$(mktemp -d) timeout -s ABRT -k 15 ${CLOSED_TIMEOUT:-180} python3 scripts/dev/closed_engine_memory.py \
        --rounds 2 2>&1 | tee "$OUT/closed_engine.log" | grep -v "^   " | tail -n 6
      grep -E "^round|alive:" "$OUT/closed_engine.log" >> "$summary" ;;
    ab-throughput:*)
      # this tree against BASE_SRC (another commit's source: mkdir -p .whl/base && git archive REV | tar -x -C
      # .whl/base, carried), one process a run, builds alternating: a cold start (Kiln's, Inductor's and Triton's
      # caches of the build's own, empty) then a warm one, each the first run's tok/s, its slowest steps and the
      # Triton kernels loaded mid-run (AB_ROUNDS=1 rounds, each 4 processes; AB_ARGS more arguments of the script)
      model=${step#ab-throughput:}
      if [ ! -d "${BASE_SRC:-}/engine" ]; then echo "ab-throughput: BASE_SRC=DIR, another commit's source" | tee -a "$summary"; continue; fi
      here=$PWD; src=$(cd "$BASE_SRC" && pwd); rows="$OUT/ab_throughput_${model##*/}$tag.jsonl"; mkdir -p /tmp/ab-base/kiln
      for d in engine compile backends cache; do ln -sfn "$src/$d" /tmp/ab-base/kiln/$d; done
      for round in $(seq 1 ${AB_ROUNDS:-1}); do
        for build in head base; do
          path=; [ $build = base ] && path=/tmp/ab-base:
          cache=/tmp/ab-cache-$build; rm -rf $cache
          for start in cold warm; do
            PYTHONPATH=$path${PYTHONPATH:-} KILN_CACHE_DIR=$cache TORCHINDUCTOR_CACHE_DIR=$cache/inductor \
              TRITON_CACHE_DIR=$cache/triton timeout -s ABRT -k 15 ${AB_TIMEOUT:-150} python3 \
              "$here/scripts/dev/throughput_runs.py" --model "$model" --tag "$build-$start-$round" --repeats 1 --step-times \
              ${AB_ARGS:-} 2>&1 | tee -a "$OUT/ab_throughput.log" | grep -o '{"tag".*' >> "$rows"
            echo "$build-$start-$round: rc ${PIPESTATUS[0]}" >> "$OUT/ab_throughput.log"
          done
        done
      done
      echo "-- ab-throughput:$model$tag (head: this tree; base: $BASE_SRC)" >> "$summary"
      python3 -c "import json, sys
for line in open(sys.argv[1]):
    try: r = json.loads(line)
    except ValueError: continue
    print(r['tag'], r['tok_s'], 'tok/s, host', r['host_s'], 's, slowest ms', [s[1] for s in r.get('slowest_steps', [])[:3]],
          'loads', r.get('triton_cache_hits'), 'gc', r.get('gc'))" "$rows" | tee -a "$summary" ;;
    throughput:*)
      model=${step#throughput:}
      timeout -s ABRT -k 15 240 python3 scripts/bench/bench_throughput.py --model "$model" --enforce-eager --hf \
        --json "$OUT/throughput.jsonl" 2>&1 | tee "$OUT/throughput_$model.log" | tail -n 4
      tail -n 4 "$OUT/throughput_$model.log" >> "$summary" ;;
  esac
done
# Only a few files come back from the device: every log and json in one archive, the summary beside it
# (made outside $OUT: tar fails on an archive growing inside the folder it reads)
( cd "$OUT" && tar czf /tmp/kiln-logs.tgz --exclude=./summary.txt . && find . -type f ! -name summary.txt -delete \
  && mv /tmp/kiln-logs.tgz logs.tgz )
echo; echo "==== summary ===="; cat "$summary"
