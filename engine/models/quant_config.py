"""What a checkpoint's `quantization_config` says, read without torch (the model config is): the FP8 formats Kiln
serves, one-line refusals of the rest, and `--quantization fp8`. The layers that hold FP8 weights, and what each
format's tensors mean, are quantization.py's.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

WEIGHTS = ("tensor", "channel", "block")
ACTIVATIONS = ("static", "token", "group", "none")  # per tensor from the checkpoint; per token; per token and group


@dataclass(frozen=True)
class QuantConfig:
    """How a model's linear layers are quantized (FP8 e4m3 is the one method)."""

    origin: str  # "compressed-tensors", "fp8" (Hugging Face's), or "online" (quantized at load)
    weights: str  # the checkpoint's weight scales: per "tensor", per output "channel", or per "block"
    activations: str  # "static" (the checkpoint's input_scale), "token", "group" (per token and block_k columns)
    block: tuple[int, int] | None = None  # (rows, columns) of a weight block
    ignore: tuple[str, ...] = field(default=())  # Hugging Face module names (or "re:" patterns) left unquantized
    # the checkpoint ships each attention's k_scale and v_scale (compressed-tensors' kv_cache_scheme): an FP8 KV
    # cache (`--kv-cache-dtype fp8`) holds k / k_scale and v / v_scale; startup clears it for a 16-bit cache
    kv_scales: bool = False

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        kv = ", KV cache scales" if self.kv_scales else ""
        return f"fp8 ({self.origin}: weights per {self.weights}{block}, activations {self.activations}{kv})"

    def ignores(self, hf_name: str) -> bool:
        """Whether the checkpoint leaves the module `hf_name` unquantized: the list names it, or a name it ends in
        (after a dot), or a "re:" pattern matches it from its start (as compressed-tensors matches).
        NOTE: asked of every expert's projections (30,720 in Qwen3.6-35B-A3B) against lists that name each layer's
        modules (Qwen's do): a set lookup a suffix, not a scan of the list."""
        names, patterns = self._ignored
        parts = hf_name.split(".")
        if any(".".join(parts[i:]) in names for i in range(len(parts))):
            return True
        return any(pattern.match(hf_name) for pattern in patterns)

    @functools.cached_property
    def _ignored(self) -> tuple[frozenset[str], tuple[re.Pattern, ...]]:
        names = frozenset(name for name in self.ignore if not name.startswith("re:"))
        return names, tuple(re.compile(name[3:]) for name in self.ignore if name.startswith("re:"))


def online_fp8() -> QuantConfig:
    """`--quantization fp8` on a 16-bit checkpoint."""
    return QuantConfig("online", "channel", "token")


def from_dict(raw: dict[str, Any] | None) -> QuantConfig | None:
    """A QuantConfig kept as a dict (`dataclasses.asdict`, the model config's memo)."""
    if raw is None:
        return None
    block = tuple(raw["block"]) if raw.get("block") else None
    ignore = tuple(raw.get("ignore") or ())
    return QuantConfig(raw["origin"], raw["weights"], raw["activations"], block, ignore, bool(raw.get("kv_scales")))


class UnsupportedQuantization(ValueError):
    """A quantization_config Kiln cannot serve; the message is one line naming what is not supported."""


def parse_checkpoint_quantization(quantization: Any) -> QuantConfig | None:
    """The checkpoint's `quantization_config` (a dict, or transformers' config object), or None for none."""
    if not quantization:
        return None
    raw = quantization if isinstance(quantization, dict) else getattr(quantization, "to_dict", lambda: {})()
    method = quant_method(quantization)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fp8":
        return _fine_grained_fp8(raw)
    if method == "mxfp4":
        return None  # (no linear layer's: gpt-oss's experts, `quant_method` below)
    detail = f" (format {raw['format']!r})" if raw.get("format") else ""
    raise UnsupportedQuantization(
        f"quantization_config with quant_method {method!r}{detail} is not supported: Kiln loads FP8 checkpoints "
        "(compressed-tensors float-quantized, Hugging Face fp8), gpt-oss's MXFP4 experts and unquantized ones"
    )


def quant_method(quantization: Any) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (a dict's, or transformers' config object's), or None."""
    if not quantization:
        return None
    raw = quantization if isinstance(quantization, dict) else getattr(quantization, "to_dict", lambda: {})()
    method = raw.get("quant_method", getattr(quantization, "quant_method", None))
    return getattr(method, "value", method)  # (transformers' QuantizationMethod enum)


def refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config: {what} is not supported (Kiln loads FP8 e4m3 weights)")


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    fmt = raw.get("format")
    if fmt != "float-quantized":
        raise refuse(f"compressed-tensors format {fmt!r} (only 'float-quantized')")
    kv_scales = _kv_cache_scheme(raw.get("kv_cache_scheme"))
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise refuse(f"{len(groups)} compressed-tensors config groups (one, targeting Linear)")
    group = groups[0]
    if list(group.get("targets") or []) != ["Linear"]:
        raise refuse(f"compressed-tensors targets {group.get('targets')!r} (only ['Linear'])")
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8 or weights.get("dynamic"):
        raise refuse(
            f"compressed-tensors weights of type {weights.get('type')!r}, {weights.get('num_bits')} bits"
            + (", dynamic" if weights.get("dynamic") else "")
        )
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block = tuple(weights.get("block_structure") or ())
        if len(block) != 2:
            raise refuse(f"compressed-tensors block_structure {weights.get('block_structure')!r}")
    elif strategy not in ("tensor", "channel"):
        raise refuse(f"compressed-tensors weight strategy {strategy!r} (tensor, channel or block)")
    activations = _activations(group.get("input_activations"), block)
    return QuantConfig("compressed-tensors", strategy, activations, block, _ignore(raw), kv_scales)


def _kv_cache_scheme(spec: dict[str, Any] | None) -> bool:
    """Whether the checkpoint ships KV cache scales: a static e4m3 scale per tensor for each layer's K and V."""
    if not spec:
        return False
    if spec.get("type") != "float" or spec.get("num_bits") != 8 or spec.get("dynamic"):
        raise refuse(f"compressed-tensors kv_cache_scheme of type {spec.get('type')!r}, {spec.get('num_bits')} bits")
    if spec.get("strategy") != "tensor":
        raise refuse(f"compressed-tensors kv_cache_scheme strategy {spec.get('strategy')!r} (only 'tensor')")
    return True


def _activations(spec: dict[str, Any] | None, block: tuple[int, int] | None) -> str:
    if not spec:
        return "none"  # weights only: the activations stay in the model's dtype
    if spec.get("type") != "float" or spec.get("num_bits") != 8:
        raise refuse(f"input activations of type {spec.get('type')!r}, {spec.get('num_bits')} bits")
    strategy, dynamic = spec.get("strategy"), bool(spec.get("dynamic"))
    if not dynamic and strategy == "tensor":
        return "static"
    if dynamic and strategy == "token":
        return "token"
    if dynamic and strategy == "group" and block and spec.get("group_size") == block[1]:
        return "group"
    raise refuse(f"input activations with strategy {strategy!r}{' (dynamic)' if dynamic else ' (static)'}")


def _fine_grained_fp8(raw: dict[str, Any]) -> QuantConfig:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"fp8 fmt {raw.get('fmt')!r} (only e4m3)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"fp8 activation_scheme {raw.get('activation_scheme')!r} (only dynamic)")
    if raw.get("scale_fmt", "float") != "float":
        raise refuse(f"fp8 scale_fmt {raw.get('scale_fmt')!r} (only float)")
    block = raw.get("weight_block_size")
    if not block or len(block) != 2:
        raise refuse(f"fp8 weight_block_size {block!r} (a [rows, columns] block)")
    # (transformers never converts the output embeddings: the LM head stays unquantized whatever the list says)
    ignore = ("lm_head", *_ignore(raw, "modules_to_not_convert"))
    return QuantConfig("fp8", "block", "group", tuple(block), ignore)


def _ignore(raw: dict[str, Any], key: str = "ignore") -> tuple[str, ...]:
    return tuple(_language_model_name(name) for name in raw.get(key) or ())


# A multimodal checkpoint's list names its language model's modules as its module tree does (Qwen3.5's FP8 checkpoints:
# "model.language_model.layers.0.linear_attn.in_proj_a"); Kiln serves that language model alone, its modules named as
# the loader renames the tensors ("model.layers.0.linear_attn.in_proj_a")
_LANGUAGE_MODEL = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.": ""}


def _language_model_name(name: str) -> str:
    for prefix, kiln in _LANGUAGE_MODEL.items():
        if name.startswith(prefix):
            return kiln + name.removeprefix(prefix)
    return name


def resolve(flag: str | None, checkpoint: QuantConfig | None) -> QuantConfig | None:
    """The quantization to run: the checkpoint's; or `--quantization fp8` of a 16-bit one."""
    if flag not in (None, "fp8"):
        raise ValueError(f"unknown quantization {flag!r}; Kiln supports fp8")
    if checkpoint is not None or flag is None:
        return checkpoint
    return online_fp8()
