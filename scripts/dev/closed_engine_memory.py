"""What of an engine's GPU memory a closed `LLM` still holds, and who holds it: engines made one after another in one
process (tests, benchmarks that compare modes) each size their KV cache from the memory then free.

python scripts/dev/closed_engine_memory.py --model llama-3.2-1b --rounds 2
python scripts/dev/closed_engine_memory.py --model qwen3.6-27b --speculative-config '{"method": "ngram", ...}'

Each round prints the KV blocks its engine got and, after `close()`, the bytes PyTorch still has allocated and
reserved, the CUDA tensors still alive (largest first, each with the chain of objects that refer to it) and the
CUDA graphs still alive.
"""

from __future__ import annotations

import argparse
import gc
import json
import types

import torch

from kiln.engine import LLM, SamplingParams


def holders(obj, depth: int = 8) -> str:
    """The first chain of referrers of `obj` (type names, a dict's key), `depth` deep."""
    chain, seen = [], {id(obj)}
    for _ in range(depth):
        refs = [
            r
            for r in gc.get_referrers(obj)
            if id(r) not in seen and not isinstance(r, types.FrameType) and not type(r).__name__.endswith("iterator")
        ]
        if not refs:
            break
        obj = refs[0]
        seen.add(id(obj))
        name = type(obj).__name__
        if isinstance(obj, dict):
            keys = [k for k, v in obj.items() if id(v) in seen][:2]
            name += str(keys)
        elif isinstance(obj, types.FunctionType):
            name += f"({obj.__qualname__})"
        chain.append(name)
        if isinstance(obj, (types.ModuleType, type)):
            break
    return " <- ".join(chain)


def survivors(top: int) -> None:
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    graphs = [o for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)]
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    print(f"  alive: {len(tensors)} CUDA tensors ({total / 2**20:.1f} MiB of storage), {len(graphs)} CUDA graphs")
    for t in sorted(tensors, key=lambda t: -t.untyped_storage().nbytes())[:top]:
        size = t.untyped_storage().nbytes() / 2**20
        print(f"  {size:9.1f} MiB {tuple(t.shape)} {t.dtype}: {holders(t)}")
    for g in graphs[:top]:
        print(f"  CUDA graph: {holders(g)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    for round_ in range(args.rounds):
        llm = LLM(args.model, enforce_eager=args.enforce_eager, speculative_config=args.speculative_config)
        blocks = llm.engine.num_kv_blocks
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.generate([[1 + i, 2, 3, 4, 5] * 4 for i in range(4)], params, use_tqdm=False)
        llm.close()
        del llm
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        print(
            f"round {round_ + 1}: {blocks} KV blocks; after close {torch.cuda.memory_allocated() / 2**20:.1f} MiB "
            f"allocated, {torch.cuda.memory_reserved() / 2**20:.1f} MiB reserved, {free / 2**30:.2f} of "
            f"{total / 2**30:.2f} GiB free"
        )
        survivors(args.top)


if __name__ == "__main__":
    main()
