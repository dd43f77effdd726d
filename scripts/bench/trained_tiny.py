"""A small Llama trained in minutes on this repository's own text, saved as a Hugging Face directory (weights,
config, tokenizer): a model whose next-token distributions are peaked as a trained model's are, for checks that
random weights cannot make (an FP8 model's top-1 agreement with bf16's). Deterministic for a given commit, seed and
device: the corpus is the repository's tracked .py and .md files, in path order.

    python scripts/bench/trained_tiny.py /tmp/trained-tiny --steps 400       # a few seconds on a GPU
"""

from __future__ import annotations

import argparse
import math
import subprocess
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kiln.engine.text.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"


def corpus() -> list[str]:
    """The repository's tracked .py and .md files' text, in path order (every file of the tree where git is not)."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.suffix in (".py", ".md"))
    return [(ROOT / name).read_text(errors="replace") for name in sorted(names) if (ROOT / name).is_file()]


def make_trained_tiny(
    path: Path, steps: int = 400, hidden: int = 256, layers: int = 4, vocab_size: int = 4096, seed: int = 0
) -> Path:
    """Train and save the model at `path`; returns `path`. Held-out loss is printed at the end (the last 5% of the
    corpus is never trained on)."""
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    texts = corpus()
    tokenizer = train_bpe(texts, vocab_size, EOS)
    ids = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
    split = int(len(ids) * 0.95)
    train, held_out = ids[:split], ids[split:]
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    seq, batch = 256, 16
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(train) - seq - 1, (batch,), generator=generator)
        x = torch.stack([train[o : o + seq] for o in offsets.tolist()]).to(device)
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        chunks = held_out[: len(held_out) // seq * seq].view(-1, seq)[:32].to(device)
        print(f"held-out loss {model(input_ids=chunks, labels=chunks).loss.item():.3f}", flush=True)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    make_trained_tiny(args.path, args.steps, args.hidden, args.layers)


if __name__ == "__main__":
    main()
