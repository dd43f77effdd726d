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

A mixture's experts (moe.py `Experts`: every expert's gate/up and down stacked) take the same formats, a scale (or
a block of scales) an expert and projection, the checkpoint's `experts.N.gate_proj.weight_scale_inv` and the like,
and the `kiln::fused_moe_fp8` op; their activations are rounded per token or per group (not from a static scale).
Gemma 4's experts (gemma4.py `Gemma4Experts`, stacked as its checkpoints ship them) take `--quantization fp8`'s.

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
    """Turn every linear layer and every mixture's experts the checkpoint quantizes into FP8 ones (weights not yet
    filled). `hf_names`: the Hugging Face modules each Kiln layer holds (qkv_proj: q_proj, k_proj, v_proj)."""
    from kiln.engine.models.gemma4 import Gemma4Experts  # noqa: PLC0415 (a cycle)
    from kiln.engine.models.moe import Experts  # noqa: PLC0415
    from kiln.engine.models.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415

    if quant.origin != "online" and not quant.ignores("lm_head"):
        raise refuse("an FP8 lm_head (a checkpoint whose ignore list leaves lm_head quantized)")
    for name, module in model.named_modules():
        experts = isinstance(module, Experts | Gemma4Experts)
        if experts:
            parts = tuple(f"{name}.{e}.{proj}" for e in range(module.num_experts) for proj in _EXPERT_PROJECTIONS)
        elif isinstance(module, ColumnParallelLinear | RowParallelLinear):
            if quant.origin == "online" and not getattr(module, "quantize_online", True):
                continue
            parts = module.hf_modules(name) if hasattr(module, "hf_modules") else hf_names.get(name, (name,))
        else:
            continue
        ignored = [quant.ignores(part) for part in parts]
        if all(ignored):
            continue
        if any(ignored):
            what = f"{name}'s experts" if experts else ", ".join(parts)
            raise refuse(f"ignoring only some of {what} (they are one fused layer)")
        if isinstance(module, Gemma4Experts) and quant.origin != "online":
            raise refuse(
                f"an FP8 checkpoint's Gemma 4 experts ({name}: --quantization fp8 of the 16-bit one quantizes them)"
            )
        if experts:
            _make_fp8_experts(module, quant, name)
        else:
            _make_fp8(module, quant, name)


# Hugging Face's modules of one expert (`model.layers.N.mlp.experts.E.gate_proj`), which an ignore list would name
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


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


def _make_fp8_experts(experts: nn.Module, quant: QuantConfig, name: str) -> None:
    """Every expert's e4m3 gate/up [E, 2I, H] and down [E, H, I] (this rank's I columns), and their scales beside
    them (`w13_scale`, `w2_scale`; Gemma 4's `gate_up_proj_scale`, `down_proj_scale`): [E, rows] a scale a row (per
    tensor or channel), or [E, rows / block rows, columns / block columns] a scale a block."""
    if quant.activations not in ("token", "group"):
        raise refuse(f"{name}: FP8 experts whose activations are {quant.activations!r} (Kiln's: per token or group)")
    num_experts, inter, hidden = experts.num_experts, experts.intermediate, experts.hidden_size
    gate_up, down = experts.weight_names
    device = getattr(experts, gate_up).device
    experts.quant = quant
    for param_name, shape in ((gate_up, (num_experts, 2 * inter, hidden)), (down, (num_experts, hidden, inter))):
        weight = torch.empty(shape, dtype=FP8_DTYPE, device=device)
        setattr(experts, param_name, nn.Parameter(weight, requires_grad=False))
    if quant.weights == "block":
        rows, columns = quant.block
        # (whole blocks: gate's and up's scales stay apart in w13's, and each rank's columns start a block; activations
        # are rounded a group of `columns` at a time, a power of two in the kernels)
        if inter % rows or inter % columns or hidden % columns or columns & (columns - 1):
            raise refuse(f"{name}: experts of {inter} columns (this rank's) over {hidden}, not {rows}x{columns} blocks")
        w13_blocks, w2_blocks = (2 * inter // rows, hidden // columns), (-(-hidden // rows), inter // columns)
        shapes = ((num_experts, *w13_blocks), (num_experts, *w2_blocks))
    else:
        shapes = ((num_experts, 2 * inter), (num_experts, hidden))
    for param_name, shape in zip((f"{gate_up}_scale", f"{down}_scale"), shapes):
        scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
        setattr(experts, param_name, scale)


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


def rows_of(module: nn.Module, param_name: str) -> int | None:
    """The weight rows that one row of the checkpoint's `param_name` stands for: 1 (the weight; a scale a row), a
    block's rows (a scale a block), or None (one value for the whole tensor: a scale a tensor, a static input scale)."""
    if param_name == "weight":
        return 1
    quant = module.quant
    if param_name == "input_scale" or quant.weights == "tensor":
        return None
    return quant.block[0] if quant.weights == "block" else 1


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
    rows = slice(offset, offset + source.shape[0])
    quantize_into(module.weight[rows], module.weight_scale[rows], source)


def quantize_into(weight: torch.Tensor, weight_scale: torch.Tensor, source: torch.Tensor) -> None:
    """16-bit weight rows into e4m3 `weight` rows and their scales (a row's largest |w| / 448)."""
    w = source.to(weight.device, torch.float32)
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    weight.copy_((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    weight_scale.copy_(scale)


def expert_block(experts: nn.Module) -> tuple[int, int]:
    """(block_n, block_k) of FP8 experts' scales as `kiln::fused_moe_fp8` takes them: (0, 0) a scale a row."""
    return experts.quant.block if experts.quant.weights == "block" else (0, 0)


def expert_scale_parts(experts: nn.Module, param_name: str) -> list[tuple[Any, tuple]]:
    """The checkpoint tensors of FP8 experts' `w13_scale` (each expert's gate's and up's) or `w2_scale` (each
    expert's down's), shaped as the format ships them; none when the experts are quantized at load."""
    quant = experts.quant
    if quant.origin == "online":
        return []
    full_inter, hidden = experts.full_intermediate, experts.hidden_size

    def shape(rows: int, columns: int) -> tuple:
        if quant.weights == "tensor":
            return ()
        if quant.weights == "channel":
            return (rows, 1)
        return (-(-rows // quant.block[0]), -(-columns // quant.block[1]))

    if param_name == "w13_scale":
        return [((e, part), shape(full_inter, hidden)) for e in range(experts.num_experts) for part in (0, 1)]
    return [((e, None), shape(hidden, full_inter)) for e in range(experts.num_experts)]


def load_expert_scale(experts: nn.Module, param_name: str, source: Any, shard: tuple[int, int | None]) -> None:
    """Copy one expert's gate, up (`w13_scale`, shard (e, 0) and (e, 1)) or down (`w2_scale`) scales in: this rank's
    rows of gate's and up's (I of them from `experts.start`), its columns of down's."""
    (expert, part), quant = shard, experts.quant
    size, start = experts.intermediate, experts.start
    scale = getattr(experts, param_name)[expert]
    if quant.weights == "tensor":
        rows = slice(part * size, (part + 1) * size) if param_name == "w13_scale" else slice(None)
        scale[rows].fill_(float(source[...].reshape(-1)[0]))
    elif quant.weights == "channel" and param_name == "w13_scale":
        scale[part * size : (part + 1) * size].copy_(source[start : start + size].reshape(-1))
    elif quant.weights == "channel":
        scale.copy_(source[...].reshape(-1))
    elif param_name == "w13_scale":
        rows = quant.block[0]
        scale[part * size // rows : (part + 1) * size // rows].copy_(source[start // rows : (start + size) // rows])
    else:
        columns = quant.block[1]
        scale.copy_(source[:, start // columns : (start + size) // columns])
