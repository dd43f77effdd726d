"""Where the sliding-window GPU tests' float32 runs part from Hugging Face: the windowed tiny Mistral and the tiny
Gemma 3, each attention backend, with and without async scheduling, and the same engine on the CPU; the first token
that differs from HF's and the largest |logprob - HF's| (a diagnostic, not a test)."""

import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from kiln.engine import LLM, SamplingParams  # noqa: E402

from helpers.models import make_tiny_model_dir  # noqa: E402

PROMPTS = [list(range(3, 60)), [(7 * i) % 500 + 1 for i in range(70)], list(range(100, 151))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def models(root: Path) -> dict[str, Path]:
    mistral = make_tiny_model_dir(root / "mistral", "mistral")
    windowed = root / "windowed"
    shutil.copytree(mistral, windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    return {"mistral-w8": windowed, "gemma3": make_tiny_model_dir(root / "gemma3", "gemma3")}


def report(name: str, hf, outputs) -> None:
    for prompt, out in zip(PROMPTS, outputs):
        got = out.outputs[0]
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
            logits = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.double(), -1)
        errs = [abs(lp[t].logprob - ref[i, t].item()) for i, (t, lp) in enumerate(zip(got.token_ids, got.logprobs))]
        first = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b), None)
        print(f"{name:40} prompt {len(prompt):3}: first token off {first}, max err {max(errs):.2e}", flush=True)


root = Path(tempfile.mkdtemp())
for model, path in models(root).items():
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runs = [("cpu", "torch", True)]
    if torch.cuda.is_available():
        runs += [("cuda", b, a) for b in ("torch", "triton") for a in (True, False)]
    for device, backend, async_scheduling in runs:
        name = f"{model} {device} {backend} async={async_scheduling}"
        engine = dict(max_model_len=256, attention_backend=backend, device=device, async_scheduling=async_scheduling)
        try:
            with LLM(str(path), enforce_eager=True, dtype="float32", **engine) as llm:
                report(name, hf, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        except Exception:
            print(f"{name}: raised", flush=True)
            traceback.print_exc()
