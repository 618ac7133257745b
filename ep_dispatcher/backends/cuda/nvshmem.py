"""Process-wide NVSHMEM state: initialisation over a process group and the symmetric-heap accounting.

NVSHMEM is initialised once per process and sizes its symmetric heap once, at initialisation; every low-latency and
internode buffer of the process takes its ``num_rdma_bytes`` from that one heap.
"""

from __future__ import annotations

import torch.distributed as dist

from ... import _C, settings

_NVSHMEM_HEAP_SLACK = 256 << 20  # NVSHMEM keeps its own state in the symmetric heap too

_nvshmem_reserved = 0  # symmetric bytes held by this process's live buffers (low-latency and internode)


def has_nvshmem() -> bool:
    """Whether the engine was built with NVSHMEM (internode and low-latency kernels need it)."""
    return bool(_C.has_nvshmem())


def release_nvshmem(num_bytes: int) -> None:
    """Give back ``num_bytes`` a destroyed buffer held (accounting only: the buffer frees its memory itself)."""
    global _nvshmem_reserved
    _nvshmem_reserved = max(0, _nvshmem_reserved - num_bytes)


def init_nvshmem(group: dist.ProcessGroup, rank: int, num_ranks: int, num_rdma_bytes: int) -> None:
    """Initialise NVSHMEM over ``group`` (once per process): rank 0's unique id travels through the process group.

    The symmetric heap is sized once, at initialisation, from NVSHMEM_SYMMETRIC_SIZE; when unset it is set to this
    buffer plus slack. A process that holds both an internode and a low-latency buffer must set it to at least the
    sum of their num_rdma_bytes plus 256 MiB before creating the first one; otherwise the second raises here.
    """
    global _nvshmem_reserved
    if _C.nvshmem_is_initialized():
        heap = settings.nvshmem_symmetric_size()
        # Certain not to fit (NVSHMEM's own state needs room too, so nvshmem_malloc may still fail short of this).
        if heap is not None and _nvshmem_reserved + num_rdma_bytes > heap:
            raise ValueError(
                f"num_rdma_bytes: this process already holds {_nvshmem_reserved} bytes of NVSHMEM buffers and the "
                f"symmetric heap is NVSHMEM_SYMMETRIC_SIZE={heap} bytes; a further {num_rdma_bytes} bytes do not fit. "
                f"Set NVSHMEM_SYMMETRIC_SIZE >= {_nvshmem_reserved + num_rdma_bytes + _NVSHMEM_HEAP_SLACK} before the "
                "first Buffer is created (the heap is sized once per process)"
            )
        _C.nvshmem_init(b"", rank, num_ranks)  # only checks that the world is the same
        _nvshmem_reserved += num_rdma_bytes
        return
    # NVSHMEM sizes its symmetric heap from the environment at init; make room for this buffer unless the user chose.
    settings.default_nvshmem_symmetric_size(num_rdma_bytes + _NVSHMEM_HEAP_SLACK)
    _nvshmem_reserved += num_rdma_bytes
    unique_id = [_C.nvshmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
    _C.nvshmem_init(unique_id[0], rank, num_ranks)
