"""CUDA backend: the ``ep_dispatcher._C`` engine.

Calls the engine implements run as kernels; every other call is served by the reference implementation on
the same tensors (NCCL, or gloo staged through host memory), so a ``Buffer`` always works. ``ENGINE_CALLS``
lists which calls are kernels today; ``Buffer(...).backend`` says which backend a buffer uses.
"""

from __future__ import annotations

import torch

from .. import _C
from .reference import ReferenceBackend

ENGINE_CALLS = ("get_dispatch_layout",)


class CudaBackend(ReferenceBackend):
    name = "cuda"

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        if not topk_idx.is_cuda:
            return super().get_dispatch_layout(topk_idx, num_experts)
        return tuple(_C.get_dispatch_layout(topk_idx, num_experts, self.num_ranks, self.num_ranks_per_node))


def has_nvshmem() -> bool:
    """Whether the engine was built with NVSHMEM (internode and low-latency kernels need it)."""
    return bool(_C.has_nvshmem())
