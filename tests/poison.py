"""GPU tests' guard against stale memory: outputs come from torch's caching allocator, so fill freed blocks with
garbage first; a row a kernel forgot to write then cannot pass by still holding correct data from an earlier call."""

from __future__ import annotations

import torch


def poison_allocator(num_bytes: int, device="cuda", count: int = 1, value: int = 0x7F) -> None:
    """Leave ``count`` freed blocks of ``num_bytes`` filled with ``value`` (0x7F: NaN in bf16, 448 in e4m3) in the
    allocator of ``device``, for the next allocations to reuse."""
    blocks = [torch.full((num_bytes,), value, dtype=torch.uint8, device=device) for _ in range(count)]
    torch.cuda.synchronize(device)
    del blocks
