"""DeepEP drop-in: make ``import deep_ep`` resolve to ep_dispatcher, and the pieces of DeepEP's API that have no
counterpart in our design (mpi4py bootstrap, the C++ ``runtime`` object).

    import ep_dispatcher
    ep_dispatcher.install_as_deep_ep()   # before anything imports deep_ep (Megatron, SGLang, vLLM, your code)

``docs/deepep_compat.md`` lists every public name of DeepEP v1.2.1 with ours beside it.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

DEEPEP_VERSION = "1.2.1"  # the DeepEP release whose API this module follows
_COMM_INIT_TIMEOUT_S = 300  # bootstrapping a group from an MPI communicator: a peer that never comes is a failure


def install_as_deep_ep(force: bool = False):
    """Register ep_dispatcher as the modules ``deep_ep`` and ``deep_ep.utils`` (and ``deep_ep.buffer``).

    Afterwards ``import deep_ep`` anywhere in the process returns ep_dispatcher, so clients that import DeepEP
    themselves (Megatron-core's ``fused_a2a.py``, SGLang, vLLM) use it with no other edit. Call it before they
    import ``deep_ep``. A real DeepEP that is already imported is left in place unless ``force=True``.

    Returns the module now registered as ``deep_ep``.
    """
    import ep_dispatcher
    from ep_dispatcher import buffer as buffer_module
    from ep_dispatcher import utils as utils_module

    existing = sys.modules.get("deep_ep")
    if existing is not None and existing is not ep_dispatcher and not force:
        raise RuntimeError(
            f"install_as_deep_ep: a different deep_ep ({getattr(existing, '__file__', existing)!r}) is already "
            "imported; call install_as_deep_ep() before anything imports deep_ep, or pass force=True to replace it"
        )
    sys.modules["deep_ep"] = ep_dispatcher
    sys.modules["deep_ep.utils"] = utils_module
    sys.modules["deep_ep.buffer"] = buffer_module
    return ep_dispatcher


def group_from_comm(comm) -> dist.ProcessGroup:
    """The torch.distributed group of the ranks of an ``mpi4py.MPI.Comm`` (DeepEP's ``Buffer(None, comm=comm)``).

    Uses only ``comm.Get_rank()``, ``comm.Get_size()`` and ``comm.allgather(obj)``. If torch.distributed is not
    initialised, the default group is created from the communicator (rank 0 publishes a TCP address; gloo, plus
    NCCL for CUDA tensors when a GPU is visible) and is the returned group. If it is initialised, the group holds
    the global ranks the communicator's members have, in communicator order: the default group when they are all
    ranks in order, else ``dist.new_group``, which every rank of the default group must enter (torch's rule).
    """
    for method in ("Get_rank", "Get_size", "allgather"):
        if not callable(getattr(comm, method, None)):
            raise TypeError(f"comm: expected an mpi4py.MPI.Comm (with {method}()), got {type(comm).__name__}")
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    if not dist.is_initialized():
        from .launch import free_port

        address = _host_address(f"tcp://127.0.0.1:{free_port()}") if rank == 0 else None
        address = comm.allgather(address)[0]
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=address, rank=rank, world_size=size, timeout=timedelta(seconds=_COMM_INIT_TIMEOUT_S)
        )
        return dist.group.WORLD
    members = [int(r) for r in comm.allgather(dist.get_rank())]
    if members == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(members)


def _host_address(loopback: str) -> str:
    """Rank 0's rendezvous address: loopback when every rank is on this host (MPI launched them here), which is all
    a single-host stand-in can know; set MASTER_ADDR to publish another interface."""
    from . import settings

    host = settings.master_addr()
    if not host:
        return loopback
    return f"tcp://{host}:{loopback.rsplit(':', 1)[1]}"


def is_sm90_compiled() -> bool:
    """DeepEP's ``Buffer.is_sm90_compiled()``: whether the kernels were built for sm_90 (Hopper), which is what
    FP8 paths need. True when the extension lists arch 90 (or newer); also True on the reference backend, which
    casts and moves FP8 in PyTorch on any device."""
    try:
        from . import _C
    except ImportError:
        return True  # reference backend: every FP8 path runs in PyTorch
    archs = [a.rstrip("a").rstrip("f") for a in str(_C.cuda_arch_list()).split(";") if a]
    return any(a.isdigit() and int(a) >= 90 for a in archs)


class Runtime:
    """What ``Buffer.runtime`` answers: the parts of DeepEP's C++ runtime object that clients call.

    ``buffer.runtime.get_num_rdma_ranks()``, ``get_rdma_rank()``, ``get_root_rdma_rank(global_rank)``,
    ``get_local_device_id()``, ``is_available()``, ``get_comm_stream()``, ``get_local_buffer_tensor(dtype, offset,
    use_rdma_buffer)``. The engine itself is ``buffer._backend``.
    """

    def __init__(self, buffer):
        self._buffer = buffer

    def is_available(self) -> bool:
        return not self._buffer._destroyed

    def get_num_rdma_ranks(self) -> int:
        b = self._buffer
        return max(1, b.group_size // b.num_ranks_per_node)

    def get_rdma_rank(self) -> int:
        return self._buffer.rank // self._buffer.num_ranks_per_node

    def get_root_rdma_rank(self, global_rank: bool) -> int:
        b = self._buffer
        local = b.rank % b.num_ranks_per_node
        return local if global_rank else 0

    def get_local_device_id(self) -> int:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1

    def get_comm_stream(self):
        return self._buffer.get_comm_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, offset: int = 0, use_rdma_buffer: bool = False):
        return self._buffer.get_local_buffer_tensor(dtype, None, offset, use_rdma_buffer)


def check_nvlink_connections(group: Optional[dist.ProcessGroup]) -> None:
    """DeepEP's ``deep_ep.utils.check_nvlink_connections``: a no-op here. Our engines check reachability
    themselves (CUDA IPC opens fail on peers without P2P, with the rank and peer named)."""
    return None
