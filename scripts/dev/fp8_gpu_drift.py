"""Where the FP8 GPU test's float32 run parts from Hugging Face: each format with each attention backend, the first
token that differs and the largest |logprob - HF's| up to it (a diagnostic, not a test)."""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from engine.models.test_fp8 import FORMATS, GREEDY, PROMPTS, fp8_reference, write_fp8_checkpoint  # noqa: E402

from kiln.engine import LLM  # noqa: E402

from helpers.models import make_tiny_model_dir  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
BACKENDS = ["torch", "triton"] if DEVICE == "cuda" else ["torch"]
root = Path(tempfile.mkdtemp())
src = make_tiny_model_dir(root / "src", "qwen3")
for fmt in ["ct-fp8", "ct-fp8-dynamic", "hf-fp8"]:
    layers = write_fp8_checkpoint(src, root / fmt, fmt)
    hf = fp8_reference(src, layers, FORMATS[fmt][1])
    for backend in BACKENDS:
        with LLM(
            str(root / fmt),
            dtype="float32",
            enforce_eager=True,
            max_model_len=128,
            device=DEVICE,
            attention_backend=backend,
        ) as llm:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            got = out.outputs[0]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits.double(), -1)
            errs = [abs(lp[t].logprob - ref[i, t].item()) for i, (t, lp) in enumerate(zip(got.token_ids, got.logprobs))]
            print(
                f"{fmt:15} {backend:6} prompt {len(prompt):3}: max err {max(errs):.2e} first>5e-3 at "
                f"{next((i for i, e in enumerate(errs) if e > 5e-3), None)}",
                flush=True,
            )
