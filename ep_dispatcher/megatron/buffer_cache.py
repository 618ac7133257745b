"""The Megatron plugin's buffers: one per ``TP x EP`` group, shared by all MoE layers (see ../buffer_cache.py)."""

from __future__ import annotations

import torch.distributed as dist

from ..buffer import Buffer
from ..buffer_cache import BufferCache

cache = BufferCache("EP_DISPATCHER_MEGATRON_BACKEND")  # env value: "auto" | "cuda" | "reference"


def set_backend(backend: str | None) -> None:
    """Backend of buffers created from now on (``None`` = env ``EP_DISPATCHER_MEGATRON_BACKEND`` or ``"auto"``)."""
    cache.backend_override = backend


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int, num_tokens: int) -> Buffer:
    """The cached buffer of ``group`` for ``num_tokens`` rows per rank of ``hidden_bytes``; collective on creation."""
    return cache.get(group, hidden_bytes, num_tokens)


def clear() -> None:
    """Forget every cached buffer (tests; or before destroying the process groups)."""
    cache.clear()
