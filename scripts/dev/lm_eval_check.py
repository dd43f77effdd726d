"""lm-evaluation-harness against `kiln serve`, end to end: a small multiple-choice task on local data, scored through
`local-completions` (lm-eval's loglikelihood requests: `echo` + `logprobs` + `max_tokens: 1`), and each choice's
log-likelihood lm-eval got compared with Hugging Face's forward pass of the same model.

    pip install "lm-eval[api]"
    python scripts/dev/lm_eval_check.py                  # a tiny random-weight Llama (the tests' model), on the CPU
    python scripts/dev/lm_eval_check.py --model DIR      # a model directory of your own

Prints lm-eval's accuracy and the largest difference from the reference (random weights: the accuracy is chance,
the log-likelihoods still have to agree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers.models import make_tiny_model_dir  # noqa: E402
from helpers.server import Server  # noqa: E402

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Two plus two is", ["three", "four", "nine"], 1),
    ("Water is", ["dry", "wet", "square"], 1),
    ("The sun rises in the", ["east", "west", "north"], 0),
    ("Cats like to", ["bark", "moo", "purr"], 2),
]
TASK = """task: kiln_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """What lm-eval computes: the continuation's tokens' log-probabilities given the context (each tokenized on its
    own, as lm-eval does), from one forward pass."""
    head = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = head + tokenizer(continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    return sum(logprobs[p - 1, whole[p]].item() for p in range(len(head), len(whole)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: a tiny random-weight Llama)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-lm-eval-") as work:
        return check(Path(work), args.model)


def check(work: Path, model: str | None) -> int:
    model_dir = Path(model) if model else make_tiny_model_dir(work / "model", "llama")
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (work / "tasks").mkdir()
    (work / "tasks" / "kiln_mc.yaml").write_text(TASK.format(data=data))
    server = Server(model_dir, "--max-model-len", "256", auth=())
    try:
        model_args = (
            f"model={model_dir},base_url={server.url}/v1/completions,tokenizer={model_dir},"
            "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1"
        )
        cmd = ["lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks", "kiln_mc"]
        cmd += ["--include_path", str(work / "tasks"), "--output_path", str(work / "out"), "--log_samples"]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    finally:
        server.stop()
    print(done.stdout[-3000:])
    if done.returncode != 0:
        print(done.stderr[-3000:])
        return done.returncode
    samples = next((work / "out").rglob("samples_kiln_mc_*.jsonl"))
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    worst = 0.0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for arguments, resp in zip(sample["arguments"].values(), sample["resps"]):
            got = float(resp[0][0])
            want = reference_loglikelihood(reference, tokenizer, arguments["arg_0"], arguments["arg_1"])
            worst = max(worst, abs(got - want))
    print(f"{len(QUESTIONS)} questions scored; largest log-likelihood difference from Hugging Face: {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
