"""A GGUF file's tensors under their Hugging Face names, one at a time, dequantized to float32 by the `gguf` package
(host memory holds about one tensor, not the file).

llama.cpp's conversion is undone as transformers undoes it: its names (`blk.N.attn_q.weight`) mapped back, the
query and key rows of Llama-family files un-permuted (llama.cpp interleaves each head's rotary halves), Gemma's norms
stored as 1 + w given back as w (Kiln's loader adds its offset to every norm), stacked experts split per expert.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from kiln.engine.models.config import ModelConfig

T = gguf.MODEL_TENSOR
# Each GGUF tensor kind Kiln reads, with its Hugging Face name ("{i}": the layer); `None`: not read (llama.cpp's
# precomputed RoPE factors, which Kiln computes from the config).
_GLOBAL = {T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head", T.ROPE_FREQS: None}
_LAYER = {
    T.ATTN_NORM: "input_layernorm",
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_Q_NORM: "self_attn.q_norm",
    T.ATTN_K_NORM: "self_attn.k_norm",
    T.ATTN_POST_NORM: "post_attention_layernorm",
    T.FFN_NORM: "post_attention_layernorm",
    T.FFN_POST_NORM: "post_feedforward_layernorm",
    T.FFN_GATE: "mlp.gate_proj",
    T.FFN_UP: "mlp.up_proj",
    T.FFN_DOWN: "mlp.down_proj",
    T.FFN_GATE_INP: "mlp.gate",
    T.FFN_GATE_SHEXP: "mlp.shared_expert.gate_proj",
    T.FFN_UP_SHEXP: "mlp.shared_expert.up_proj",
    T.FFN_DOWN_SHEXP: "mlp.shared_expert.down_proj",
    T.FFN_GATE_INP_SHEXP: "mlp.shared_expert_gate",
}
# Gemma's four norms a layer: the one GGUF calls ffn_norm comes before the MLP, after the attention's own
_GEMMA_LAYER = {**_LAYER, T.FFN_NORM: "pre_feedforward_layernorm"}
# stacked experts [num_experts, out, in], split into the per-expert tensors Kiln's loader takes
_EXPERTS = {T.FFN_GATE_EXP: "gate_proj", T.FFN_UP_EXP: "up_proj", T.FFN_DOWN_EXP: "down_proj"}
_PERMUTED = ("llama",)
_CHUNK_ROWS = 1024  # rows dequantized at once  # the architectures whose q and k rows llama.cpp permutes


def hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF base name (no .weight / .bias) -> Hugging Face base name; a stacked experts tensor maps to
    "...mlp.experts.*.PROJ", "*" standing for each expert."""
    layer_names = _GEMMA_LAYER if arch.startswith("gemma") else _LAYER
    names = {gguf.TENSOR_NAMES[kind]: hf for kind, hf in _GLOBAL.items()}
    for i in range(num_layers):
        for kind, hf in layer_names.items():
            names[gguf.TENSOR_NAMES[kind].format(bid=i)] = f"model.layers.{i}.{hf}"
        for kind, proj in _EXPERTS.items():
            names[gguf.TENSOR_NAMES[kind].format(bid=i)] = f"model.layers.{i}.mlp.experts.*.{proj}"
    return names


def gguf_tensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file Kiln reads; an unknown name is an error."""
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    names = hf_names(arch, config.num_layers)
    for tensor in reader.tensors:
        base, dot, suffix = tensor.name.rpartition(".")
        if not dot or base not in names:
            raise ValueError(f"{path.name}: tensor {tensor.name!r} has no place in a {arch} model")
        hf = names[base]
        if hf is None:
            continue
        weights = _dequantize(tensor)
        if arch in _PERMUTED and hf.endswith(("q_proj", "k_proj")):
            heads = config.num_heads if hf.endswith("q_proj") else config.num_kv_heads
            weights = _unpermute(weights, heads)
        if arch.startswith("gemma") and hf.endswith("norm"):
            weights = weights - 1.0
        if hf.endswith("shared_expert_gate") and weights.ndim == 1:
            weights = weights[None, :]  # (GGUF drops the one output row)
        data = torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))  # (a copy if read-only: the file's map)
        if "*" in hf:
            for expert, part in enumerate(data):
                yield f"{hf.replace('*', str(expert))}.{suffix}", part
        else:
            yield f"{hf}.{suffix}", data
        del weights, data  # NOTE: before the next tensor is made, so that one tensor is held at a time


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """The tensor as float32, a few rows at a time into one array (the dequantizer's temporaries are several times
    what they dequantize: a whole embedding, or a layer's stacked experts, at once would hold several copies)."""
    data, kind = tensor.data, tensor.tensor_type
    if data.ndim < 2 or kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return gguf.quants.dequantize(data, kind)
    rows = data.reshape(-1, data.shape[-1])
    out = None
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        chunk = gguf.quants.dequantize(rows[start : start + _CHUNK_ROWS], kind)
        if out is None:
            out = np.empty((rows.shape[0], chunk.shape[-1]), np.float32)
        out[start : start + len(chunk)] = chunk
    return out.reshape(*data.shape[:-1], out.shape[-1])


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of each head's rows (its rotary pairs interleaved; Hugging Face's in halves)."""
    rows = weights.shape[0]
    w = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)
