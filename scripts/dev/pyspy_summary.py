"""Summarise py-spy's collapsed stacks (`--format raw --threads`, as `bench_startup.py --py-spy` writes them).

Each line of the file is one stack, outermost frame first, and how many samples it had. This counts, for the main
thread, the samples whose stack holds a frame (inclusive: a frame and everything it called), as shares:

    python scripts/dev/pyspy_summary.py pyspy_llama-3.1-8b.txt --frames resolve_model,warm_up,capture_cudagraphs
    python scripts/dev/pyspy_summary.py pyspy_llama-3.1-8b.txt --within capture_cudagraphs --top 40

`--within F` lists the frames called under F by their share of F's samples (native frames without a symbol are
grouped by library). Under py-spy's sampler with native frames the process runs many times slower, and parts with
deep native stacks slow the most: read shares, not seconds.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter


def main_thread_stacks(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        match = re.match(r"(.*) (\d+)$", line)
        if match is None:
            continue
        frames = match.group(1).split(";")
        if frames[0].startswith("thread (") and "MainThread" in frames[0]:
            stacks.append((frames[1:], int(match.group(2))))
    return stacks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--frames", default="", help="comma-separated substrings of frames to count")
    p.add_argument("--within", help="a substring of one frame: list what runs under it")
    p.add_argument("--top", type=int, default=50)
    args = p.parse_args()
    stacks = main_thread_stacks(args.path)
    total = sum(n for _, n in stacks)
    print(f"main thread: {total} samples")
    for name in filter(None, args.frames.split(",")):
        count = sum(n for frames, n in stacks if any(name in f for f in frames))
        print(f"{count:8d} {count / max(total, 1):6.1%}  {name}")
    if args.within:
        under = Counter()
        inside = 0
        for frames, n in stacks:
            at = next((i for i, f in enumerate(frames) if args.within in f), None)
            if at is None:
                continue
            inside += n
            for frame in {re.sub(r"^0x[0-9a-f]+ ", "", f) for f in frames[at + 1 :]}:
                under[frame] += n
        print(f"\nunder {args.within}: {inside} samples")
        for frame, count in under.most_common(args.top):
            print(f"{count:8d} {count / max(inside, 1):6.1%}  {frame[:150]}")


if __name__ == "__main__":
    main()
