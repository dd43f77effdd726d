"""Kiln's own torch ops for the compiled pieces (`kiln::linear`, `kiln::qk_norm_rope`, ...): opaque to Dynamo,
called by Inductor's code as externs, each with a fake for tracing.

NOTE: a plain `torch.library.Library` rather than `torch.library.custom_op`, whose Python wrapper costs tens of
microseconds a call more: the compiled pieces call these several times a layer. The CPU
registration serves the tests (the kernels under Triton's interpreter); the models call them on the GPU only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_lib = torch.library.Library("kiln", "FRAGMENT")
SCHEMAS: list[str] = []  # every op's, defined so far (the compile cache's key hashes them: a saved graph calls them)


def define(schema: str, impl: Callable, fake: Callable) -> None:
    """`kiln::<name>` from its schema ("name(Tensor x, ...) -> Tensor"), on the CPU and CUDA, and its fake."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    SCHEMAS.append(schema)
    for device in ("CPU", "CUDA"):
        _lib.impl(name, impl, device)
    torch.library.register_fake(f"kiln::{name}", fake, lib=_lib)
