"""What the kernel tests share: the device they run on (Triton's interpreter on a CPU), its dtypes, a tolerance."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
