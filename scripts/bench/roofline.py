"""The memory-bandwidth roofline of the card a benchmark runs on.

4.3 TB/s is the copy bandwidth measured on an H200 (90% of its 4.8 TB/s HBM3e); other cards get the same share of
their published peak, so a figure's "% of roofline" means the same thing on an H100 as on an H200.
"""

from __future__ import annotations

import torch

# published HBM peak, bytes/s, by a substring of torch.cuda.get_device_name()
PUBLISHED_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "H20": 4.0e12, "A100": 2.0e12}
ACHIEVABLE_SHARE = 4.3 / 4.8


def peak_bytes_per_s() -> float:
    """The achievable bandwidth of this process's GPU (the H200's when there is none or the card is unknown)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    peak = next((bw for key, bw in PUBLISHED_PEAK.items() if key in name), PUBLISHED_PEAK["H200"])
    return peak * ACHIEVABLE_SHARE
