"""Kiln's own Triton kernels and torch ops: RMSNorm and rotary (`fused`), the one-row matmul (`gemv`), the greedy
argmax (`argmax`), tensor-parallel collectives (`collectives`), and what they share (`ops`, `pdl`, `arrivals`)."""
