"""The draft chain's passes in CUDA graphs (draft_graphs.py): a pass padded to a capture size (the padded requests of
no context, their K/V to the scratch block) proposes for the real requests what the unpadded pass proposes, through
the Triton attention the GPU runs (its interpreter here); on the GPU, drafts from the graphs equal the eager chain's,
for an EAGLE-3 head and for Qwen3.5's MTP layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.backends.attention import set_forward_context
from kiln.engine import LLM, SamplingParams
from kiln.engine.spec_decode.eagle_proposer import EagleProposer
from kiln.engine.worker.inputs import GraphPlan

from helpers.eagle3 import make_eagle3_dir
from helpers.mtp import add_mtp_layer

PROMPTS = [[5, 17, 33, 2, 101, 45, 9, 5, 17, 33], [7, 7, 7], list(range(20, 61))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def target_and_spec(method: str, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path) -> tuple:
    """The tiny Llama with a tiny EAGLE-3 head, or the tiny Qwen3.5 with its MTP layer; k = 3."""
    if method == "eagle3":
        draft_dir = make_eagle3_dir(tmp_path / "draft", "eagle")
        return tiny_llama_dir, {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 3}
    return add_mtp_layer(tiny_qwen3_5_dir, tmp_path / "with-mtp"), {"method": "mtp", "num_speculative_tokens": 3}


def padded_pass(proposer: EagleProposer, ids, positions, tables, hidden, shift, size: int):
    """The chain pass as a graph of `size` requests runs it, eagerly: (draft tokens, next states) of every row."""
    ones = np.ones(len(positions), dtype=np.int64)
    metadata = proposer._write_inputs(ids, positions, ones, tables, GraphPlan("full", size, size), shift)
    inputs = proposer.runner.inputs.views(size, size)
    padding = hidden.new_zeros(size - hidden.shape[0], hidden.shape[1])
    with set_forward_context(proposer.context(metadata)):
        normed, out = proposer.draft(inputs.input_ids, inputs.positions, torch.cat([hidden, padding]))
    return proposer.draft.draft_tokens(normed), out


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_padded_chain_pass_proposes_as_the_pass(method, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path, monkeypatch):
    model_dir, spec = target_and_spec(method, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path)
    compared = []
    chain_pass = EagleProposer._chain_pass

    def checking(self, ids, positions, tables, hidden, shift):
        tokens, out = chain_pass(self, ids, positions, tables, hidden, shift)
        padded_tokens, padded_out = padded_pass(self, ids, positions, tables, hidden, shift, len(positions) + 3)
        rows = len(positions)
        compared.append(torch.equal(padded_tokens[:rows], tokens) and torch.allclose(padded_out[:rows], out, atol=1e-5))
        return tokens, out

    monkeypatch.setattr(EagleProposer, "_chain_pass", checking)
    kwargs = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=64, attention_backend="triton")
    with LLM(str(model_dir), speculative_config=spec, **kwargs) as llm:
        assert llm.engine.scheduler.drafter.graphs is None  # (no graphs on the CPU: the eager chain)
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(compared) > 4 and all(compared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_drafts_from_chain_graphs_equal_the_eager_chains(method, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path):
    model_dir, spec = target_and_spec(method, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path)
    kwargs = dict(
        dtype="float32",  # (bf16 verification rows of 1 + k tokens may tip a near-tie a one-token step does not)
        max_model_len=256,
        num_kv_blocks=64,
        enable_prefix_caching=False,
        compile_cache_dir=str(tmp_path / "cache"),
    )
    with LLM(str(model_dir), **kwargs) as llm:
        plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(model_dir), speculative_config=spec, **kwargs) as llm:
        proposer = llm.engine.scheduler.drafter
        assert proposer.graphs is not None
        drafts = {}
        propose = proposer.propose

        def recording(batch, *args):
            propose(batch, *args)
            drafts.setdefault(runs, []).append(proposer.proposals(batch))

        proposer.propose = recording
        runs = "graphs"
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert proposer.graphs.replays > 0
        graphs, proposer.graphs = proposer.graphs, None
        runs = "eager"
        eager_outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        proposer.graphs = graphs
    assert drafts["graphs"] == drafts["eager"]
    for got, again, want in zip(outputs, eager_outputs, plain, strict=True):
        assert got.outputs[0].token_ids == again.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_the_drafts_fused_kernels_propose_as_the_plain_forms(method, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path):
    """On the GPU a draft's eager passes take the fused Triton kernels (an eager target's): here under Triton's
    interpreter, every step's drafts as with the plain torch forms."""
    from kiln.engine.models.layers import use_fused_kernels

    model_dir, spec = target_and_spec(method, tiny_llama_dir, tiny_qwen3_5_dir, tmp_path)
    kwargs = dict(enforce_eager=True, max_model_len=256, num_kv_blocks=64)
    drafts = {}
    for fused in (False, True):
        with LLM(str(model_dir), speculative_config=spec, **kwargs) as llm:
            proposer = llm.engine.scheduler.drafter
            use_fused_kernels(proposer.draft, fused)
            propose = proposer.propose

            def recording(batch, *args, fused=fused, propose=propose, proposer=proposer):
                propose(batch, *args)
                drafts.setdefault(fused, []).append(proposer.proposals(batch))

            proposer.propose = recording
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any(any(step) for step in drafts[True]) and drafts[True] == drafts[False]
