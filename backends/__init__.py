"""Kiln's GPU side below the models: `attention/` (the `kiln::unified_attention` op, its forward context and the
torch and Triton backends) and `kernels/` (the fused Triton kernels and ops the models and the sampler call)."""
