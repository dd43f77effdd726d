"""FP8 weights: the checkpoint formats Kiln reads, quantization at load, and the linear layers that hold them.

    compressed-tensors, format "float-quantized" (llm-compressor):
        FP8          weights per tensor (`weight_scale` [1]), activations per tensor, static (`input_scale` [1])
        FP8_DYNAMIC  weights per output channel (`weight_scale` [N, 1]), activations per token at run time
        FP8_BLOCK    weights per 128 x 128 block (`weight_scale` [N/128, K/128]), activations per token and group
    Hugging Face's fine-grained FP8 (quant_method "fp8", as Qwen3-*-FP8 and DeepSeek ship):
        weights per 128 x 128 block (`weight_scale_inv` [N/128, K/128], multiplied despite its name), activations
        per token and 128 columns at run time
    `--quantization fp8` on a 16-bit checkpoint: weights per output channel, quantized as they load; activations
        per token

A weight is stored as e4m3 values q and float32 scales s, w = q * s. A fused projection (qkv, gate_up) keeps each
part's scales: a per-tensor scale becomes a per-channel one over its part's rows, so no weight is requantized.
A fused layer's static input scale is the largest of its parts' (the parts quantize the same input, and
llm-compressor calibrates them from the same activations, so they are equal in practice). The LM head, the
embedding and the norms stay in the model's dtype; a checkpoint that quantizes the LM head is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.engine.models.quant_config import QuantConfig, refuse

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize_layers(model: nn.Module, quant: QuantConfig, hf_names: dict[str, tuple[str, ...]]) -> None:
    """Turn every linear layer the checkpoint quantizes into an FP8 one (weights not yet filled). `hf_names`: the
    Hugging Face modules each Kiln layer holds (qkv_proj: q_proj, k_proj, v_proj)."""
    from kiln.engine.models.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415 (a cycle)

    if quant.origin != "online" and not quant.ignores("lm_head"):
        raise refuse("an FP8 lm_head (a checkpoint whose ignore list leaves lm_head quantized)")
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        parts = hf_names.get(name, (name,))
        ignored = [quant.ignores(part) for part in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise refuse(f"ignoring only some of {', '.join(parts)} (they are one fused layer)")
        _make_fp8(module, quant, name)


def _make_fp8(module: nn.Module, quant: QuantConfig, name: str) -> None:
    rows, columns = module.weight.shape
    device = module.weight.device
    module.quant = quant
    module.weight = nn.Parameter(torch.empty(rows, columns, dtype=FP8_DTYPE, device=device), requires_grad=False)
    if quant.weights == "block":
        block_rows, block_columns = quant.block
        for _, start, size in getattr(module, "parts", {None: (rows, 0, rows)}).values():
            if start % block_rows or size % block_rows:
                raise refuse(f"{name}: a part of {size} rows from row {start}, not whole {block_rows}-row blocks")
        split = getattr(module, "full_in_features", columns) != columns  # (a row-parallel layer's columns)
        if split and (module.start % block_columns or columns % block_columns):
            raise refuse(f"{name}: this rank's {columns} columns are not whole {block_columns}-column blocks")
        shape = (-(-rows // block_rows), -(-columns // block_columns))
    else:
        shape = (rows,)
    module.weight_scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
    if quant.activations == "static":
        module.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False)


def is_fp8(module: nn.Module) -> bool:
    return getattr(module, "quant", None) is not None


def quantized_at_load(module: nn.Module) -> bool:
    """An FP8 layer whose 16-bit checkpoint weights are quantized as they load (`--quantization fp8`)."""
    return is_fp8(module) and module.quant.origin == "online"


def scale_parts(module: nn.Module, param_name: str, parts: list[tuple[Any, int]]) -> list[tuple[Any, tuple]]:
    """The checkpoint tensors of an FP8 layer's `weight_scale` or `input_scale`: one per part (shard id, rows of the
    full part), shaped as the format ships them; none when the layer is quantized at load."""
    quant, columns = module.quant, module.in_features
    if quant.origin == "online":
        return []
    if param_name == "input_scale":
        return [(shard, ()) for shard, _ in parts]
    if quant.weights == "tensor":
        return [(shard, ()) for shard, _ in parts]
    if quant.weights == "channel":
        return [(shard, (rows, 1)) for shard, rows in parts]
    block_rows, block_columns = quant.block
    full_columns = getattr(module, "full_in_features", columns)
    return [(shard, (-(-rows // block_rows), -(-full_columns // block_columns))) for shard, rows in parts]


def load_scale(module: nn.Module, param_name: str, source: Any, offset: int, start: int, size: int) -> None:
    """Copy a part's scale into the layer's: the part's rows [start, start + size) of the checkpoint tensor go to
    the layer's rows from `offset` (column-parallel; a row-parallel layer: its columns from `module.start`)."""
    quant = module.quant
    if param_name == "input_scale":
        value = source[...].reshape(-1)[0].to(torch.float32)  # ([...]: a scalar shipped as [] too)
        module.input_scale.copy_(torch.maximum(module.input_scale, value.to(module.input_scale.device)))
        return
    scale = module.weight_scale
    if quant.weights == "tensor":
        scale[offset : offset + size].fill_(float(source[...].reshape(-1)[0]))
    elif quant.weights == "channel":
        scale[offset : offset + size].copy_(source[start : start + size].reshape(-1))
    else:
        block_rows, block_columns = quant.block
        first, count = start // block_rows, -(-size // block_rows)
        blocks = source[first : first + count]
        column = getattr(module, "start", 0) // block_columns
        scale[offset // block_rows : offset // block_rows + count].copy_(blocks[:, column : column + scale.shape[1]])


def quantize_rows(module: nn.Module, source: torch.Tensor, offset: int) -> None:
    """`--quantization fp8`: these 16-bit weight rows into the layer's e4m3 rows from `offset`, a scale a row."""
    w = source.to(module.weight.device, torch.float32)
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    module.weight[offset : offset + w.shape[0]].copy_((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    module.weight_scale[offset : offset + w.shape[0]].copy_(scale)
