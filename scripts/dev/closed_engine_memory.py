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


def describe(obj) -> str:
    name = type(obj).__name__
    if isinstance(obj, dict):
        return f"{name}({len(obj)} keys: {list(obj)[:4]})"[:160]
    if isinstance(obj, (list, tuple)):
        return f"{name}(len {len(obj)}: {[type(x).__name__ for x in obj[:4]]})"
    if isinstance(obj, types.FunctionType):
        return f"{name}({obj.__qualname__})"
    if isinstance(obj, types.CellType):
        return "cell"
    return name


def holders(obj, ignore: set[int], depth: int = 7, width: int = 3) -> str:
    """Who refers to `obj`, breadth-first: up to `width` referrers of each object, `depth` levels up."""
    lines, seen, level = [], {id(obj), *ignore}, [obj]
    seen.update((id(lines), id(seen), id(globals())))
    for d in range(depth):
        nxt = []
        seen.update((id(level), id(nxt)))
        for o in level:
            refs = [
                r
                for r in gc.get_referrers(o)
                if id(r) not in seen
                and not isinstance(r, types.FrameType)
                and not type(r).__name__.endswith("iterator")
                and not (isinstance(r, list) and len(r) > 1000)
            ]
            seen.add(id(refs))
            for r in refs[:width]:
                seen.add(id(r))
                lines.append("      " + "  " * d + describe(r))
                if not isinstance(r, (types.ModuleType, type)):
                    nxt.append(r)
        level = nxt
    return "\n" + "\n".join(lines)


def survivors(top: int) -> None:
    fake = torch._subclasses.FakeTensor
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, fake) and o.is_cuda]
    graphs = [o for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)]
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    print(f"  alive: {len(tensors)} CUDA tensors ({total / 2**20:.1f} MiB of storage), {len(graphs)} CUDA graphs")
    ranked = sorted(tensors, key=lambda t: -t.untyped_storage().nbytes())[:top]
    ignore = {id(tensors), id(graphs), id(ranked)}
    for t in ranked:
        size = t.untyped_storage().nbytes() / 2**20
        print(f"  {size:9.1f} MiB {tuple(t.shape)} {t.dtype}, held by: {holders(t, ignore)}")
    for g in graphs[:top]:
        print(f"  CUDA graph, held by: {holders(g, ignore)}")


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
