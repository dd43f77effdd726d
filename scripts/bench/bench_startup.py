"""Cold and warm start, split by stage: a fresh compile cache, then the same start again.

Each start is its own process (as a deployment's would be), so Inductor's in-process state cannot
help the warm one; Inductor's and Triton's own on-disk caches are pointed into the same fresh folder, so
the cold start is cold for them too. Python's bytecode cache is not part of a start: it is filled once
before the first (PYTHONPYCACHEPREFIX), as an installed deployment has its packages' .pyc files (the
device's torch environment has none and sets PYTHONDONTWRITEBYTECODE: without this, every process compiles
the source of ~2,300 modules, ~9 s of its imports).

    python scripts/bench/bench_startup.py --models llama-3.2-1b,llama-3.1-8b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# (warm_up: the dummy steps before capture, the Dynamo trace and Inductor among them on a cold start)
STAGES = [
    "load_seconds",
    "dynamo_seconds",
    "inductor_seconds",
    "cache_load_seconds",
    "kv_sizing_seconds",
    "warm_up_seconds",
    "capture_seconds",
]


PYCACHE = os.path.join(tempfile.gettempdir(), "kiln-bench-pycache")


def fill_bytecode_cache() -> None:
    env = {**os.environ, "PYTHONPYCACHEPREFIX": PYCACHE}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import kiln.engine.core.engine_core, kiln.compile.saved_graph, torch._inductor.standalone_compile",
        ],
        env=env,
        check=True,
    )


# A profiled start also lists every Triton kernel it compiles (not found in Triton's cache), with its seconds and
# the kiln / Inductor frames that asked for it.
LOG_TRITON_COMPILES = """
import time, traceback
COMPILED = []
try:
    from triton.backends.nvidia.compiler import CUDABackend
    _make_cubin = CUDABackend.make_cubin
    def _logged(self, src, metadata, *rest):
        t = time.perf_counter()
        cubin = _make_cubin(self, src, metadata, *rest)
        frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                  if "kiln" in f.filename or "_inductor" in f.filename or "saved_graph" in f.filename]
        seconds = time.perf_counter() - t
        COMPILED.append(f"make_cubin {metadata.get('name')} {seconds:.2f}s < {' < '.join(frames[-6:])}\\n")
        return cubin
    CUDABackend.make_cubin = _logged
except ImportError:
    pass
""".strip()


def start_once(model: str, cache_dir: str, extra: dict, profile: str | None = None, py_spy: str | None = None) -> dict:
    """One start in a fresh process; with `profile`, under cProfile, its busiest calls written there as text; with
    `py_spy`, sampled by py-spy (native frames and waits too) into that file as collapsed stacks."""
    code = (
        "import json, time; t = time.perf_counter(); from kiln.engine.core.engine_core import EngineCore; "
        "from kiln.engine.core.startup import freeze_startup_objects; "
        "from kiln.engine.config import EngineConfig; i = time.perf_counter() - t; "
        f"core = EngineCore(EngineConfig(model={model!r}, compile_cache_dir={cache_dir!r}, **{extra!r})); "
        # (the freeze that an LLM and the engine-core process do after the engine: part of every start)
        "f = time.perf_counter(); freeze_startup_objects(); f = time.perf_counter() - f; "
        "s = {**core.startup_stats, 'total_seconds': core.startup_stats['total_seconds'] + f, 'freeze_seconds': f}; "
        "print(json.dumps({**s, 'import_seconds': i, 'process_seconds': time.perf_counter() - t}), flush=True)"
    )
    if profile:
        code = (
            f"{LOG_TRITON_COMPILES}\nimport cProfile, pstats; p = cProfile.Profile(); p.enable(); exec({code!r}); "
            f"p.disable(); f = open({profile!r}, 'w'); f.writelines(COMPILED); s = pstats.Stats(p, stream=f); "
            "s.sort_stats('cumulative').print_stats(80); s.sort_stats('tottime').print_stats(40); "
            "s.print_callers('make_cubin'); f.close()"
        )
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
        "PYTHONPYCACHEPREFIX": PYCACHE,
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        command = [sys.executable, "-c", code]
        if py_spy:
            command = [
                "py-spy",
                "record",
                "--native",
                "--idle",
                "--threads",
                "--rate",
                "250",
                "--format",
                "raw",
                "--output",
                py_spy,
                "--",
                *command,
            ]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        line = process.stdout.readline()  # the stats, printed once the engine is ready
        while line and not line.startswith("{"):  # (py-spy's own lines)
            line = process.stdout.readline()
        ready = time.perf_counter() - start
        try:
            process.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        exited = time.perf_counter() - start
        if process.returncode != 0 or not line:
            stderr.seek(0)
            raise RuntimeError(stderr.read()[-3000:])
    # wall: from exec to ready (interpreter start and imports included; what a deployment waits for);
    # the process's exit (CUDA and compile-worker teardown) is reported apart
    return {**json.loads(line), "wall_seconds": ready, "exit_seconds": exited - ready}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-3.2-1b")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json")
    p.add_argument("--profile-warm", metavar="PREFIX", help="profile each warm start (cProfile), to PREFIX_MODEL.txt")
    p.add_argument(
        "--prime",
        action="store_true",
        help="one unmeasured start of the first model first (in a cache of its own), so no measured "
        "cold start also pays for the machine's cold OS caches (6-8 s of the first start on the H200)",
    )
    p.add_argument(
        "--py-spy",
        metavar="PREFIX",
        help="then one more warm start (not measured) sampled by py-spy, its "
        "collapsed stacks to PREFIX_MODEL.txt (py-spy on PATH; `scripts/dev/pyspy_summary.py` reads them)",
    )
    args = p.parse_args()
    fill_bytecode_cache()
    if args.prime:
        with tempfile.TemporaryDirectory(prefix="kiln-startup-prime-") as cache_dir:
            primed = start_once(args.models.split(",")[0], cache_dir, {"max_model_len": args.max_model_len})
            print(f"prime (not measured): {primed['wall_seconds']:.1f} s", flush=True)
    rows = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="kiln-startup-") as cache_dir:
            extra = {"max_model_len": args.max_model_len}
            cold = start_once(model, cache_dir, extra)
            print(f"{model} cold: {json.dumps(cold)}", flush=True)  # as it comes: a time limit may stop the rest
            warm = start_once(model, cache_dir, extra, args.profile_warm and f"{args.profile_warm}_{model}.txt")
            print(f"{model} warm: {json.dumps(warm)}", flush=True)
            if args.py_spy:
                try:
                    sampled = start_once(model, cache_dir, extra, py_spy=f"{args.py_spy}_{model}.txt")
                    print(f"{model} warm under py-spy: {sampled['wall_seconds']:.1f} s", flush=True)
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    print(f"{model}: no py-spy profile ({type(e).__name__}: {str(e)[-500:]})", flush=True)
        rows += [{"model": model, "start": "cold", **cold}, {"model": model, "start": "warm", **warm}]
    print(
        f"\n{'model':<14} {'start':<5} {'wall s':>7} {'imports':>8} {'engine':>7} "
        + " ".join(f"{s.removesuffix('_seconds'):>10}" for s in STAGES)
        + f" {'compiles':>9} {'hits':>5} {'graphs':>7} {'triton':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<14} {r['start']:<5} {r['wall_seconds']:>7.1f} {r['import_seconds']:>8.1f} "
            f"{r['total_seconds']:>7.1f} "
            + " ".join(f"{r[s]:>10.1f}" for s in STAGES)
            + f" {r['inductor_compiles']:>9} {r['cache_hits']:>5} {r['cudagraphs_captured']:>7}"
            f" {r.get('triton_compiles', -1):>7}"
        )
    for model in dict.fromkeys(r["model"] for r in rows):
        cold, warm = (r["wall_seconds"] for r in rows if r["model"] == model)
        print(f"{model}: warm / cold = {warm / cold:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
