"""The low-latency engine: decode-time dispatch and combine over an NVSHMEM symmetric buffer in two halves
(docs/low_latency.md), and the GPU-sharing discovery that bounds its grid."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ... import _C, settings
from ..base import LowLatencyCombineArgs, LowLatencyDispatchArgs
from .common import EngineContext
from .nvshmem import init_nvshmem, release_nvshmem


@dataclass(frozen=True)
class LowLatencyState:
    """What a low-latency dispatch keeps for its combine (``LowLatencyHandle.backend_state``).

    send_slot: the send plan, each (token, k) entry's slot at its expert (what the combine reads).
    """

    send_slot: torch.Tensor


def ranks_sharing_this_gpu(group: dist.ProcessGroup) -> int:
    """How many ranks of ``group`` (this one included) run on this process's GPU (collective)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    me = (socket.gethostname(), str(getattr(props, "uuid", "")) or str(getattr(props, "pci_bus_id", "")))
    everyone: List[Optional[tuple]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return sum(1 for other in everyone if other == me)


def low_latency_max_blocks(group: dist.ProcessGroup) -> int:
    """Grid bound of the low-latency kernels: they spin on peers' signals, so every rank's blocks on one GPU must be
    resident together (one 512-thread block per SM always fits): SMs / ranks on the GPU. Env override:
    ``EP_DISPATCHER_LL_MAX_BLOCKS``."""
    sharing = ranks_sharing_this_gpu(group)  # collective: computed even when the env var is set
    if settings.low_latency_max_blocks() is not None:
        return settings.low_latency_max_blocks()
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return max(1, sm_count // sharing)


class LowLatencyEngine:
    """This rank's NVSHMEM low-latency buffer (``_C.LowLatencyBuffer``) and the calls that run on it."""

    def __init__(self, ctx: EngineContext, num_rdma_bytes: int, allow_nvlink: bool):
        self.ctx = ctx
        init_nvshmem(ctx.group, ctx.rank, ctx.num_ranks, num_rdma_bytes)
        device, max_blocks = torch.cuda.current_device(), low_latency_max_blocks(ctx.group)
        self.buffer: "_C.LowLatencyBuffer" = _C.LowLatencyBuffer(
            ctx.rank, ctx.num_ranks, num_rdma_bytes, allow_nvlink, ctx.timeout_ns, device, max_blocks
        )
        self.nvshmem_bytes = num_rdma_bytes
        self._combine_views: dict = {}  # (half, shape) -> the zero-copy combine buffer (a view of the half)

    def made(self, state: object) -> bool:
        """Whether a handle with this ``backend_state`` came from this engine."""
        return isinstance(state, LowLatencyState)

    def destroy(self) -> None:
        self._combine_views.clear()
        self.buffer.destroy()
        self.buffer = None  # a pending hook holds the C++ buffer, whose calls after destroy() raise (no freed memory)
        release_nvshmem(self.nvshmem_bytes)
        self.nvshmem_bytes = 0

    def take_error(self) -> Optional[tuple]:
        """``(code, token, k, value)`` of the last bad ``topk_idx`` entry the kernels that have run reported (then
        cleared), or None; codes in ``validation.low_latency_topk_error``."""
        return self.buffer.take_error()

    def low_latency_dispatch(self, args: LowLatencyDispatchArgs):
        """The send phase now; returns ``(handle, (recv_x, recv_scales, recv_count), receive)``, ``receive()`` runs the
        receive phase (the hook)."""
        # One C++ entry launches the send phase and allocates the outputs and the handle's tensors (at::empty is cheaper
        # than torch.empty from Python); it binds the receive phase, so the hook converts no arguments. send_slot is the
        # plan: each (token, k) entry's slot at its expert (what the combine reads). wait_stats: the receive kernel adds
        # the clock64 cycles it spun per source rank (no extra kernel).
        recv_x, recv_scales, recv_count, send_slot, src_info, layout_range, receive = self.buffer.dispatch_send(
            args.half,
            args.x,
            args.topk_idx,
            args.num_max_dispatch_tokens_per_rank,
            args.num_experts,
            args.use_fp8,
            args.round_scale,
            args.use_ue8m0,
            args.cumulative_stats,
            args.wait_stats,
            args.receive_now,
        )
        handle = args.make_handle(src_info, layout_range, LowLatencyState(send_slot))
        return handle, (recv_x, recv_scales, recv_count), receive

    def low_latency_combine(self, args: LowLatencyCombineArgs):
        """The send phase now; returns ``(out, receive)``, ``receive()`` runs the receive phase (the hook) into ``out``
        (``args.out``, else allocated by the C++ entry)."""
        handle = args.handle
        return self.buffer.combine_send(
            args.half,
            args.x,
            handle.layout_range,
            handle.num_max_dispatch_tokens_per_rank,
            handle.num_experts,
            args.topk_idx,
            args.topk_weights,
            handle.backend_state.send_slot,
            args.out,
            args.wait_stats,
            args.receive_now,
        )

    def combine_buffer(self, half: int, shape, device: torch.device) -> torch.Tensor:
        key = (half, tuple(shape))
        view = self._combine_views.get(key)
        if view is None:  # a view of the half's send area: made once, asked for on every zero-copy combine
            num_local_experts, num_slots, hidden = shape
            max_tokens = num_slots // self.ctx.num_ranks
            view = self.buffer.combine_buffer(half, max_tokens, num_local_experts * self.ctx.num_ranks, hidden)
            self._combine_views[key] = view
        return view

    def clean(self) -> None:
        # NVSHMEM's host barrier inside clean() has no timeout: meet in the process group first (it has one), so
        # a rank that died or diverged turns into an error here instead of a hang.
        torch.cuda.synchronize()
        dist.barrier(group=self.ctx.group)
        self.buffer.clean()
