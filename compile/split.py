"""Cut a Dynamo FX graph at every attention op (and every linear-attention op: `kiln::gated_delta_net`).

    [embed, norm, qkv, rope] | attention 0 | [o_proj, norm, mlp, norm, qkv, rope] | attention 1 | ... | [o_proj, norm]
      compute piece 0                         compute piece 1                                      compute piece L

Attention stays one opaque submodule between compute pieces; each compute piece is compiled alone.
"""

from __future__ import annotations

import torch
from torch.fx.passes.split_module import split_module

from kiln.backends.attention.aux_hidden import save_hidden
from kiln.backends.attention.op import attend  # (the module registers the op)
from kiln.backends.linear_attention.op import gated_delta_net

# each op the graph is split at, and the Python body its piece calls once compiled
OP_BODIES = {
    torch.ops.kiln.unified_attention: attend,
    torch.ops.kiln.unified_attention.default: attend,
    torch.ops.kiln.gated_delta_net: gated_delta_net,
    torch.ops.kiln.gated_delta_net.default: gated_delta_net,
    torch.ops.kiln.save_hidden: save_hidden,
    torch.ops.kiln.save_hidden.default: save_hidden,
}
ATTENTION_OPS = tuple(OP_BODIES)


def is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in ATTENTION_OPS


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """Returns the split module and the names of its compute and attention submodules, in order."""
    partition: dict[torch.fx.Node, int] = {}
    index = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention(node):
            partition[node] = index + 1  # its own partition, between two compute pieces
            index += 2
        else:
            partition[node] = index
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    names = [name for name, _ in split.named_children()]
    attention = [n for n in names if any(is_attention(node) for node in getattr(split, n).graph.nodes)]
    compute = [n for n in names if n not in attention]
    return split, compute, attention


def call_attention_directly(split: torch.fx.GraphModule, attention: list[str]) -> None:
    """Point each attention piece at the op's Python body (`attend`), skipping the dispatcher at run time.
    Only after the fake-tensor pass over the split graph, which needs the op's fake implementation."""
    for name in attention:
        piece = getattr(split, name)
        for node in piece.graph.nodes:
            if is_attention(node):
                node.target = OP_BODIES[node.target]
        piece.recompile()
