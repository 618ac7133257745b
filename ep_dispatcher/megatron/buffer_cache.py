"""One ``Buffer`` per process group, created on first use and grown when a layer needs more bytes.

Every MoE layer of a model dispatches over the same ``TP x EP`` group, so they share one buffer (as DeepEP's
Megatron integration does); a buffer is re-created only when a larger hidden size or a different group shows up.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ..buffer import Buffer

_BACKEND_ENV = "EP_DISPATCHER_MEGATRON_BACKEND"  # "auto" | "cuda" | "reference"
_buffers: dict[int, Buffer] = {}
_backend_override: str | None = None


def set_backend(backend: str | None) -> None:
    """Backend of buffers created from now on (``None`` = env ``EP_DISPATCHER_MEGATRON_BACKEND`` or ``"auto"``)."""
    global _backend_override
    _backend_override = backend


def _backend() -> str:
    return _backend_override or os.environ.get(_BACKEND_ENV, "auto")


def required_bytes(hidden_bytes: int, num_ranks: int) -> tuple:
    """``(num_nvl_bytes, num_rdma_bytes)`` for dispatch and combine of ``hidden_bytes``-wide rows."""
    configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    return nvl, rdma


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    """The cached buffer of ``group``, large enough for rows of ``hidden_bytes`` (``hidden * max(elem_size, 2)``).

    Collective over ``group`` when it creates a buffer: every rank of the group reaches this point with the same
    ``hidden_bytes`` (same model), so they create it together.
    """
    key = id(group)
    num_ranks = dist.get_world_size(group)
    nvl, rdma = required_bytes(hidden_bytes, num_ranks)
    buffer = _buffers.get(key)
    if buffer is None or buffer.group is not group or buffer.num_nvl_bytes < nvl or buffer.num_rdma_bytes < rdma:
        if buffer is not None:
            nvl, rdma = max(nvl, buffer.num_nvl_bytes), max(rdma, buffer.num_rdma_bytes)
        buffer = Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, backend=_backend())
        _buffers[key] = buffer
    return buffer


def clear() -> None:
    """Forget every cached buffer (tests; or before destroying the process groups)."""
    _buffers.clear()
