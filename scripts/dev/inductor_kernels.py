"""Which Triton kernels Inductor generates for each compiled piece of a model, without a GPU.

Inductor's Triton code generation runs on the CPU machine against a stand-in CUDA target (sm_90): Inductor
is told to use Triton for the CPU, a fake Triton driver reports the target, and each generated kernel is
recorded by name instead of compiled (nothing runs: the model's outputs are garbage). The fusion decisions are
the GPU's: this shows how many kernels a layer costs, and which ops Inductor left apart, before a device call.

    python scripts/dev/inductor_kernels.py --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import re
import tempfile

import torch
import torch._inductor.async_compile as async_compile
import torch._inductor.codecache as codecache
import torch._inductor.config as inductor_config
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from kiln.compile.backend import KilnBackend
from kiln.engine import LLM


class _StandInDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cpu

    def is_active(self):
        return True


class _Kernel:
    """What `async_compile.triton` would return, minus the compiled code."""

    def run(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", help="a preset or a local Hugging Face model directory")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    driver.set_active(_StandInDriver())
    pieces: list[list[str]] = []  # per piece, the kernels launched (in order, a name once per launch)
    compile_piece = KilnBackend.compile_piece
    load_module = codecache.PyCodeCache.load_by_key_path

    def record_piece(self, piece, piece_args, digest):
        pieces.append([])
        return compile_piece(self, piece, piece_args, digest)

    def record_launches(key, path, *args, **kwargs):
        with open(path) as f:  # the wrapper's `call`, not the autotuning block above it
            wrapper = f.read().split("def call(")[-1].split("def benchmark_compiled_module")[0]
        launches = re.findall(r"^\s*(triton_\w+)\.run\(|(extern_kernels\.\w+)\(", wrapper, re.M)
        pieces[-1] = [a or b for a, b in launches]
        return load_module(key, path, *args, **kwargs)

    KilnBackend.compile_piece = record_piece
    codecache.PyCodeCache.load_by_key_path = staticmethod(record_launches)
    async_compile.AsyncCompile.triton = lambda self, kernel_name, source_code, device_str="cuda": _Kernel()
    with tempfile.TemporaryDirectory() as cache_dir:
        try:
            LLM(args.model, dtype=args.dtype, max_model_len=128, compile_cache_dir=cache_dir)
        except Exception as error:  # noqa: BLE001  (nothing runs for real: only the code generation matters)
            print(f"(the engine stopped after code generation: {type(error).__name__})")
    # NOTE: one entry per unique piece (layers with the same code share one); identical kernels within a piece
    # are one definition launched more than once, so launches are what is listed.
    for i, launches in enumerate(pieces):
        triton = [name for name in launches if name.startswith("triton_")]
        print(f"unique piece {i}: {len(triton)} Triton kernel launches, {len(launches) - len(triton)} extern")
        for name in launches:
            print(f"    {name}")


if __name__ == "__main__":
    main()
