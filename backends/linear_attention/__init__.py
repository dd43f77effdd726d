"""Linear attention with a recurrent state (Gated DeltaNet): the `kiln::gated_delta_net` op and its kernels."""

from __future__ import annotations

from kiln.backends.linear_attention.op import gated_delta_net

__all__ = ["gated_delta_net"]
