"""How far FP8 moves a model's next-token distribution: a greedy bf16 continuation of --steps tokens, then that
whole sequence scored (prompt log-probabilities, top-1 at each position) by the bf16 model and by the same weights
quantized at load (`--quantization fp8`): the positions where the two agree on the top token, and |delta| of the
log-probability each gives the bf16 model's top token.

    python scripts/bench/bench_fp8_accuracy.py --model llama-3.1-8b --steps 1000

With --load-format dummy (a preset), the weights are random: the logits are nearly flat, so agreement on the top
token is a weak test there and |delta logprob| the telling figure. A real checkpoint directory gives both meaning.
"""

from __future__ import annotations

import argparse
import json

from kiln.engine import LLM, SamplingParams


def score(llm: LLM, tokens: list[int]) -> list[dict[int, float]]:
    """Each position's top-1 token and the scored token, {token: logprob}, past the first."""
    (out,) = llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [{t: lp.logprob for t, lp in entry.items()} for entry in out.prompt_logprobs[1:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompt = list(range(100, 132))
    engine = dict(dtype=args.dtype, max_model_len=len(prompt) + args.steps + 8, enable_prefix_caching=False)
    with LLM(args.model, **engine) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        tokens = prompt + out.outputs[0].token_ids
        want = score(llm, tokens)
    with LLM(args.model, quantization="fp8", **engine) as llm:
        got = score(llm, tokens)
    agree, deltas = 0, []
    for w, g in zip(want[len(prompt) - 1 :], got[len(prompt) - 1 :], strict=True):
        top = max(w, key=w.get)
        agree += max(g, key=g.get) == top
        if top in g:  # (FP8's entry for it: the scored token is always there, and it is bf16's greedy pick)
            deltas.append(abs(g[top] - w[top]))
    n = len(deltas)
    result = dict(
        model=args.model,
        steps=n,
        top1_agreement=agree / n,
        max_abs_delta_logprob=max(deltas),
        mean_abs_delta_logprob=sum(deltas) / n,
    )
    print(f"\nFP8 against {args.dtype}: {args.model}, {n} positions of a greedy continuation")
    print(
        f"top-1 agreement {agree / n:.1%}, |delta logprob| of {args.dtype}'s token: max {max(deltas):.4f}, mean "
        f"{sum(deltas) / n:.4f}"
    )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
