"""The draft model of EAGLE-3 or MTP speculative decoding, loaded on rank 0 beside the target's weights and before the
KV cache is sized: the draft's weights and its own KV blocks come out of the same `gpu_memory_utilization`."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from torch import nn

from kiln.engine.config import EngineConfig
from kiln.engine.models.config import ModelConfig
from kiln.engine.models.loader import checkpoint_tensors
from kiln.engine.models.parallel import TensorParallelShard
from kiln.engine.spec_decode.eagle3 import Eagle3Draft, load_eagle3
from kiln.engine.spec_decode.mtp import MtpDraft, load_mtp


def load_draft(
    config: EngineConfig,
    model: nn.Module,
    model_dir: Path | None,
    load_format: str,
    draft_dir: Path | None,
    max_model_len: int,
    shard: TensorParallelShard,
    dtype: torch.dtype,
    device: torch.device,
) -> Eagle3Draft | MtpDraft | None:
    """The draft model an EAGLE-3 or MTP `speculative_config` names, on the target's device and dtype; None for
    n-gram drafts (or none). A target whose checkpoint cannot give the draft, or a GPU without room for it beside the
    target's weights, refuses (one ValueError)."""
    spec = config.speculative_config
    if spec is None or not spec.uses_draft_model:
        return None
    try:
        return _load(config, model, model_dir, load_format, draft_dir, max_model_len, shard, dtype, device)
    except torch.OutOfMemoryError:
        pass  # (outside the handler: its traceback holds the draft's tensors allocated so far)
    gc.collect()
    torch.cuda.empty_cache()
    gib = 1 << 30
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / gib
    room = ""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = f", {free / gib:.1f} GiB free of {total / gib:.1f} GiB"
    raise ValueError(
        f"out of GPU memory while loading the {spec.method} draft model on {device} beside the target's "
        f"{weights:.1f} GiB of weights{room}; a larger tensor_parallel_size or a smaller target leaves it room"
    )


def _load(config, model, model_dir, load_format, draft_dir, max_model_len, shard, dtype, device):
    """`load_draft`'s work, for a speculative_config that names a draft model."""
    spec = config.speculative_config
    target_config = model.config
    whole = _WholeTensors(model_dir, load_format, target_config, dtype, device)
    if spec.method == "mtp":
        draft = load_mtp(model_dir, load_format, target_config, model, dtype, device)
        if shard.size > 1:  # (the draft runs on rank 0, over the whole vocabulary)
            draft.embed_tokens = whole.embedding()
            tied = target_config.tie_word_embeddings
            draft.lm_head_weight = draft.embed_tokens.weight if tied else whole("lm_head.weight")
        return draft
    draft = load_eagle3(draft_dir, max_model_len, dtype, device)
    if draft.embed_tokens is None:  # the target's, as the draft was trained (whole: the draft runs on rank 0)
        draft.embed_tokens = model.model.embed_tokens if shard.size == 1 else whole.embedding()
    return draft


def check_draft(config: EngineConfig, target_config: ModelConfig, load_format: str, shard: TensorParallelShard) -> None:
    """What `load_draft` would refuse that is known before any weight is read (one ValueError)."""
    spec = config.speculative_config
    if spec is None or not spec.uses_draft_model:
        return
    if spec.method == "mtp" and (not target_config.linear_layers or load_format == "dummy"):
        raise ValueError(
            "speculative_config method mtp runs the MTP layer a Qwen3.5/3.6 or Qwen3-Next checkpoint ships"
        )
    if shard.size > 1 and load_format == "dummy":  # (the draft reads the target's whole embedding from it)
        raise ValueError("speculative drafts with tensor parallelism need the target's checkpoint, not dummy weights")


def draft_block_bytes(draft: Eagle3Draft | MtpDraft | None, block_size: int) -> int:
    """Bytes of the draft's own KV cache a block of the target's takes (its one attention layer's keys and values)."""
    if draft is None:
        return 0
    itemsize = next(draft.parameters()).element_size()
    return 2 * block_size * draft.num_kv_heads * draft.head_dim * itemsize


class _WholeTensors:
    """The target's checkpoint tensors, whole, on this rank's device: a draft on rank 0 reads what the ranks hold a
    slice each of."""

    def __init__(self, model_dir, load_format, model_config, dtype, device) -> None:
        self.model_dir, self.load_format, self.model_config = model_dir, load_format, model_config
        self.dtype, self.device = dtype, device

    def __call__(self, suffix: str) -> torch.Tensor:
        """The tensor whose name ends with `suffix` (a checkpoint's: `check_draft` refuses dummy weights)."""
        for _, name, tensor in checkpoint_tensors(self.model_dir, self.model_config, self.load_format):
            if name.endswith(suffix):
                return tensor[:].to(self.device, self.dtype)
        raise ValueError(f"{self.model_dir}: no {suffix} for the draft")

    def embedding(self) -> nn.Module:
        """The target's token embedding over the whole vocabulary (each rank holds a slice, its lookup a
        collective)."""
        config = self.model_config
        whole = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=self.device, dtype=self.dtype)
        whole.weight.data = self("embed_tokens.weight")
        return whole.requires_grad_(False)
