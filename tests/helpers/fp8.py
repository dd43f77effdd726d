"""What an FP8 matmul computes, on a Hugging Face model: each FP8 layer's input rounded through e4m3 as the checkpoint's
format says, before the layer's (dequantized) weights take it. The FP8 tests' references."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def round_input(x: torch.Tensor, activations: str, input_scale: float, group: int) -> torch.Tensor:
    """x through e4m3: by a static `input_scale`, or a scale a token ("token") or a token and `group` columns
    ("group"), its largest |x| / 448."""
    if activations == "static":
        units = (x.float() * (1 / input_scale)).clamp(-FP8_MAX, FP8_MAX)
        return (units.to(FP8_DTYPE).float() * input_scale).to(x.dtype)
    groups = x.float().unflatten(-1, (-1, group)) if activations == "group" else x.float().unsqueeze(-2)
    scale = groups.abs().amax(dim=-1, keepdim=True) * (1 / FP8_MAX)  # (products, as the engine's scales and x / scale)
    return ((groups * (1 / scale)).to(FP8_DTYPE).float() * scale).reshape(x.shape).to(x.dtype)


class RoundsItsInputs(torch.Tensor):
    """Hugging Face's stack of every expert's weights ([E, rows, columns]) whose matmuls round their input through
    e4m3 first, as an FP8 expert's do: `F.linear(x, stack[e])` in HF's expert loop is `F.linear(rounded x, stack[e])`.
    A subclass rather than a copy of HF's loop, so that the loop is transformers' own."""

    activations, group = "token", 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is not F.linear:
            return super().__torch_function__(func, types, args, kwargs)
        x = round_input(args[0], cls.activations, 0.0, cls.group)
        with torch._C.DisableTorchFunctionSubclass():
            return F.linear(x, *args[1:], **(kwargs or {}))


def round_fp8_inputs(
    hf: torch.nn.Module, linears: dict[str, float], experts: Iterable[str], activations: str, group: int
) -> None:
    """Round the inputs of `hf`'s FP8 linear layers (name: static input scale) and FP8 experts (HF's fused `experts`
    modules, loaded with `experts_implementation="eager"`: the loop of F.linear calls) as `activations` says."""
    rounding = type("Rounds", (RoundsItsInputs,), {"activations": activations, "group": group})
    experts = set(experts)
    missing = (set(linears) | experts) - {name for name, _ in hf.named_modules()}
    assert not missing, f"no such modules in {type(hf).__name__}: {sorted(missing)[:3]}"
    for name, module in hf.named_modules():
        if name in linears:
            module.register_forward_pre_hook(
                lambda m, args, s=linears[name]: (round_input(args[0], activations, s, group), *args[1:])
            )
        elif name in experts:
            for param_name in ("gate_up_proj", "down_proj"):  # (parameters; buffers of the subclass in their place)
                stack = getattr(module, param_name).data.as_subclass(rounding)
                delattr(module, param_name)
                module.register_buffer(param_name, stack, persistent=False)
