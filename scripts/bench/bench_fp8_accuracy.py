"""How far FP8 moves a model's next-token distribution: a greedy bf16 continuation of --steps tokens, then that
whole sequence scored (prompt log-probabilities: each position's top-1 token and the continuation's own token) by
the bf16 model and by the same weights quantized at load (`--quantization fp8`): the positions where the two agree on
the top token, and |delta| of the log-probability each gives the continuation's token (bf16's greedy pick).

    python scripts/bench/trained_tiny.py /tmp/trained-tiny && \
        python scripts/bench/bench_fp8_accuracy.py --model /tmp/trained-tiny --steps 1000
    python scripts/bench/bench_fp8_accuracy.py --model llama-3.1-8b --steps 1000     # dummy weights

With --load-format dummy (a preset), the weights are random: the logits are nearly flat and their top token a
near-tie, so agreement there says little. A trained model (`trained_tiny.py`'s, or a real checkpoint directory)
gives both figures meaning; its prompt is the start of this file's text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.engine import LLM, SamplingParams


def score(llm: LLM, tokens: list[int]) -> list[tuple[int, float]]:
    """Past the first position: each position's top-1 token and the log-probability of the token that follows."""
    (out,) = llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    rows = []
    for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True):
        top = min(entry, key=lambda t: entry[t].rank)
        rows.append((top, entry[token].logprob))
    return rows


def prompt_ids(model: str, length: int = 32) -> list[int]:
    """The first `length` tokens of this file's text in a model directory's tokenizer; a preset's: fixed ids."""
    if not Path(model).is_dir():
        return list(range(100, 100 + length))
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(model)(Path(__file__).read_text())["input_ids"][:length]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompt = prompt_ids(args.model)
    engine = dict(dtype=args.dtype, max_model_len=len(prompt) + args.steps + 8, enable_prefix_caching=False)
    with LLM(args.model, **engine) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        tokens = prompt + out.outputs[0].token_ids
        want = score(llm, tokens)
    with LLM(args.model, quantization="fp8", **engine) as llm:
        got = score(llm, tokens)
    agree, deltas = 0, []
    for (top, want_lp), (got_top, got_lp) in zip(want[len(prompt) - 1 :], got[len(prompt) - 1 :], strict=True):
        agree += got_top == top
        deltas.append(abs(got_lp - want_lp))
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
        f"top-1 agreement {agree / n:.1%}, |delta logprob| of the continuation's token: max {max(deltas):.4f}, mean "
        f"{sum(deltas) / n:.4f}"
    )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
