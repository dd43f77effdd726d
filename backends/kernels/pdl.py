"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the
kernel before it in the stream is still finishing, and waits (`griddepcontrol.wait`, Triton's
`gdc_wait`) only where it first needs that kernel's results. Kiln's Triton kernels load what no earlier
kernel writes (a matmul's weights) before that wait, so the next layer's weight reads overlap the tail of
the previous kernel and its launch, which at batch 1 is a large part of a 2-10 µs kernel.

Rule for every kernel launched with PDL: call `gdc_wait` before the first store and before the first load
of anything an earlier kernel may have written (an output buffer may be memory the previous kernel still
reads). Then `gdc_launch_dependents` lets the next kernel launch. It is on on GPUs of compute capability 9
and up, unless `KILN_PDL=0` (`kiln.backends.environment`).
"""

from __future__ import annotations

import functools

import torch

from kiln.backends import environment


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (t may be a fake tensor: only its device is read)."""
    if not (environment.ENV.pdl and t.is_cuda):
        return False
    return _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_kwargs(t: torch.Tensor) -> dict:
    """The keywords for launching a Kiln Triton kernel on t's device: its `USE_PDL` constexpr (which places the
    wait) and, when on, Triton's `launch_pdl` (absent otherwise: Triton's interpreter has no such option)."""
    on = enabled(t)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}
