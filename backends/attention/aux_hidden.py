"""The `kiln::save_hidden` op: a layer's input hidden state copied out for a drafter (EAGLE-3 reads three target
layers' states), into the forward context's `aux_hidden` buffer.

Opaque to Dynamo and split at as attention is, so the copy runs between the compiled pieces (and is recorded in the
CUDA graphs) into a buffer the runner owns: the compiled code never holds a mutation of its own.
"""

from __future__ import annotations

import torch

from kiln.backends.attention.forward_context import get_forward_context


def save_hidden(hidden: torch.Tensor, index: int) -> None:
    """Write `hidden` [T, H] into columns index*H:(index+1)*H of the context's aux_hidden [max_tokens, n*H]."""
    buffer = get_forward_context().aux_hidden
    if buffer is None:
        return
    width = hidden.shape[1]
    buffer[: hidden.shape[0], index * width : (index + 1) * width].copy_(hidden)


# NOTE: declared as mutating its input so no tracer may drop it as dead code (it returns nothing anyone reads).
@torch.library.custom_op("kiln::save_hidden", mutates_args=("hidden",))
def save_hidden_op(hidden: torch.Tensor, index: int) -> None:
    save_hidden(hidden, index)


@save_hidden_op.register_fake
def _(hidden, index: int) -> None:
    return None
