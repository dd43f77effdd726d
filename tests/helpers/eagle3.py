"""A tiny random EAGLE-3 draft for the tiny Llama, written as the published checkpoints lay it out (EAGLE's own
`LlamaForCausalLMEagle3` with `midlayer.*`, or the speculators library's `Eagle3Speculator` with `layers.0.*`), and a
float64 reference of what such a draft proposes, written from the EAGLE-3 paper's architecture; and a recorder of
the drafts an engine proposes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB = 64, 128, 4, 2, 16, 512, 256
AUX = [0, 1, 1]  # (the tiny target has two layers)
ROPE_THETA = 10000.0


def make_eagle3_dir(path: Path, layout: str, seed: int = 0, norm_before_residual: bool = False) -> Path:
    """A draft in `layout` "eagle" or "speculators" at `path`; its draft vocabulary is the target's even ids."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    prefix = "midlayer." if layout == "eagle" else "layers.0."
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    weights = {
        f"{prefix}self_attn.q_proj.weight": rand(q, 2 * HIDDEN),
        f"{prefix}self_attn.k_proj.weight": rand(kv, 2 * HIDDEN),
        f"{prefix}self_attn.v_proj.weight": rand(kv, 2 * HIDDEN),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, q),
        f"{prefix}mlp.gate_proj.weight": rand(INTER, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rand(INTER, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, INTER),
        f"{prefix}input_layernorm.weight": 1 + rand(HIDDEN),
        f"{prefix}hidden_norm.weight": 1 + rand(HIDDEN),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(HIDDEN),
        "fc.weight": rand(HIDDEN, 3 * HIDDEN, scale=0.1),
        "norm.weight": 1 + rand(HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, scale=0.5),
        "d2t": torch.arange(DRAFT_VOCAB, dtype=torch.int64),  # draft id i is target id 2i: i + d2t[i]
        "t2d": torch.arange(VOCAB) % 2 == 0,
    }
    layer = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_theta=ROPE_THETA,
    )
    if layout == "eagle":
        config = dict(
            layer,
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=DRAFT_VOCAB,
            eagle_config={"eagle_aux_hidden_state_layer_ids": AUX},
        )
    else:
        config = dict(
            architectures=["Eagle3Speculator"],
            speculators_model_type="eagle3",
            transformer_layer_config=layer,
            draft_vocab_size=DRAFT_VOCAB,
            eagle_aux_hidden_state_layer_ids=AUX,
            norm_before_residual=norm_before_residual,
            speculators_config={
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]},
            },
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"))
    return path


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def reference_drafts(draft_dir: Path, hf_target, prompt: list[int], next_token: int, k: int) -> list[int]:
    """The k tokens the draft proposes after `prompt` + `next_token`, in float64: its first pass over every position
    (position p reading token p + 1 and the target's states at p), then k - 1 chained passes."""
    from safetensors.torch import load_file

    config = json.loads((draft_dir / "config.json").read_text())
    before = config.get("norm_before_residual", False)
    w = {
        k.replace("midlayer.", "").replace("layers.0.", ""): v.double()
        for k, v in load_file(draft_dir / "model.safetensors").items()
    }
    embed = hf_target.model.embed_tokens.weight.double()
    with torch.no_grad():
        states = hf_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0].double() for i in AUX], dim=-1)  # layer i's input: hidden_states[i]
    hidden = aux @ w["fc.weight"].T
    tokens = prompt[1:] + [next_token]
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    keys, values, drafts = [], [], []

    def rotate(x: torch.Tensor, position: int) -> torch.Tensor:
        freqs = position * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def step(token: int, h: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = _rms(embed[token], w["input_layernorm.weight"])
        if before:
            h = residual = _rms(h, w["hidden_norm.weight"])
        else:
            residual, h = h, _rms(h, w["hidden_norm.weight"])
        x = torch.cat([e, h])
        q = rotate((w["self_attn.q_proj.weight"] @ x).view(HEADS, HEAD_DIM), position)
        keys.append(rotate((w["self_attn.k_proj.weight"] @ x).view(KV_HEADS, HEAD_DIM), position))
        values.append((w["self_attn.v_proj.weight"] @ x).view(KV_HEADS, HEAD_DIM))
        k_all, v_all = torch.stack(keys), torch.stack(values)  # [P, KVH, D]
        group = HEADS // KV_HEADS
        out = []
        for head in range(HEADS):
            scores = k_all[:, head // group] @ q[head] / HEAD_DIM**0.5
            out.append(torch.softmax(scores, 0) @ v_all[:, head // group])
        x = w["self_attn.o_proj.weight"] @ torch.cat(out) + residual
        y = _rms(x, w["post_attention_layernorm.weight"])
        y = w["mlp.down_proj.weight"] @ (
            torch.nn.functional.silu(w["mlp.gate_proj.weight"] @ y) * (w["mlp.up_proj.weight"] @ y)
        )
        prenorm = x + y
        return _rms(prenorm, w["norm.weight"]), prenorm

    for position, token in enumerate(tokens):
        normed, prenorm = step(token, hidden[position], position)
    for j in range(k):
        best = int((w["lm_head.weight"] @ normed).argmax())
        drafts.append(best + int(w["d2t"][best]))
        if j < k - 1:
            normed, prenorm = step(drafts[-1], prenorm, len(tokens) + j)
    return drafts


def record_drafts(monkeypatch) -> list[tuple[str, int, list[int]]]:
    """Every draft an EAGLE-3 or MTP proposer leaves, as (request id, output tokens before it, drafts): read after
    each step's chain, entered once the step's tokens are in (so a step scheduled ahead of them counts alike). The
    read waits for the device: on a GPU the run it records is a synchronous one."""
    from kiln.engine.core.scheduler import Scheduler  # noqa: PLC0415
    from kiln.engine.spec_decode.eagle_proposer import EagleProposer  # noqa: PLC0415

    recorded, drafted = [], {}
    propose, update = EagleProposer.propose, Scheduler.update_from_output

    def proposing(self, batch, *args):
        propose(self, batch, *args)
        drafted[id(batch)] = self.proposals(batch)

    def updating(self, batch, *args):
        result = update(self, batch, *args)
        for request, drafts in zip(batch.requests, drafted.pop(id(batch), ())):
            if drafts:
                recorded.append((request.request_id, len(request.output_token_ids), drafts))
        return result

    monkeypatch.setattr(EagleProposer, "propose", proposing)
    monkeypatch.setattr(Scheduler, "update_from_output", updating)
    return recorded
